// lock: flock leases and waits (native/core/lock.h).
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <system_error>
#include <thread>

#include "../core/lock.h"

#include "batch.h"
#include "common.h"

namespace vmspace::binding {

// for as long as the holder keeps the lock, and UV_THREADPOOL_SIZE (4 by default) such waits would freeze every
// fs call of the process (node-pty runs its blocking waits on their own threads for the same reason).
struct LockWaitDone;
void lockWaitCallJs(Napi::Env env, Napi::Function cb, LockWaiter* waiter, LockWaitDone* done);
using LockWaitTsfn = Napi::TypedThreadSafeFunction<LockWaiter, LockWaitDone, lockWaitCallJs>;

struct LockWaiter {
  int fd;  // the wait's own until its callback: replaced when the file at `path` was (lockFollowPath)
  std::string path;
  bool shared;
  pthread_t thread{};
  std::mutex mu;
  bool done = false;      // guarded by mu: once set, the thread may be gone and must not be signalled
  bool tsfnGone = false;  // guarded by mu: the env tore the callback down (a worker thread ended)
  std::atomic<bool> cancelled{false};
  LockWaitTsfn tsfn;
};
using WaiterRef = std::shared_ptr<LockWaiter>;

struct LockWaitDone {
  WaiterRef waiter;
  int err;
  const char* syscall;  // of err: "flock", or the fstat/stat/open of lockFollowPath
};

// On the JS thread, or with a null env while the env is torn down (the wait's result is then dropped, and so is
// the lock it may have got: nobody is left to release it).
void lockWaitCallJs(Napi::Env env, Napi::Function cb, LockWaiter*, LockWaitDone* d) {
  std::unique_ptr<LockWaitDone> done(d);
  if (env == nullptr || cb.IsEmpty()) {
    vmspace::lockClose(done->waiter->fd);
    return;
  }
  // The fd goes back to the instance (held, or to be released by lib) before JS sees it.
  Instance& inst = instance(env);
  inst.waiters.erase(done->waiter);
  inst.locks.insert(done->waiter->fd);
  cb.Call({Napi::Number::New(env, done->err), Napi::Number::New(env, done->waiter->fd),
           Napi::String::New(env, done->syscall)});
}

namespace {

// lockOpen({path, shared, create, owner}): see vmspace::lockOpen.
Napi::Value LockOpen(const Napi::CallbackInfo& info) {
  Options opts(info, 0, "lockOpen");
  std::string path = opts.string("path");
  bool shared = opts.boolean("shared"), create = opts.boolean("create");
  long owner = opts.int32("owner");
  struct Opened {
    int fd = -1;
    bool acquired = false;
  };
  return Work<Opened>::Start(
      info.Env(),
      [path, shared, create, owner] {
        Opened o;
        o.fd = vmspace::lockOpen(path, shared, &o.acquired, create, owner);
        return o;
      },
      [](Napi::Env env, Opened& o) -> Napi::Value {
        int fd = std::exchange(o.fd, -1);
        instance(env).locks.insert(fd);
        Napi::Object r = Napi::Object::New(env);
        r.Set("fd", fd);
        r.Set("acquired", o.acquired);
        return r;
      },
      [](Opened& o) {
        if (o.fd >= 0) vmspace::lockClose(o.fd);
      });
}

// Interrupts a waiting thread (see LockCancel); a no-op once the thread is done.
void cancelWaiter(LockWaiter& w) {
  w.cancelled.store(true);
  int sig = vmspace::lockCancelSignal();
  std::lock_guard<std::mutex> lock(w.mu);
  if (!w.done && sig) pthread_kill(w.thread, sig);
}

}  // namespace

Instance::~Instance() {
  closeBatch(batch);
  for (int fd : leases) ::close(fd);
  for (int fd : locks) vmspace::lockClose(fd);
  // A wait still running closes its own fd when it finds the env gone (its callback can no longer be made).
  for (auto& w : waiters) cancelWaiter(*w);
}

namespace {

// A waiter for lockWait's options, its callback wrapped in a thread-safe function.
WaiterRef newWaiter(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  Options o(info, 0, "lockWait");
  auto waiter = std::make_shared<LockWaiter>();
  waiter->fd = o.int32("fd");
  waiter->path = o.string("path");
  waiter->shared = o.boolean("shared");
  if (!info[1].IsFunction()) throw Napi::TypeError::New(env, "vmspace binding: lockWait: callback must be a function");
  // Node frees a thread-safe function when its env is torn down, even while a thread still holds it; the
  // finalizer tells the thread (under mu) not to touch it any more.
  waiter->tsfn = LockWaitTsfn::New(
      env, info[1].As<Napi::Function>(), "vmspace lock wait", 0, 1, waiter.get(),
      [](Napi::Env, WaiterRef* ref, LockWaiter*) {
        {
          std::lock_guard<std::mutex> lock((*ref)->mu);
          (*ref)->tsfnGone = true;
        }
        delete ref;
      },
      new WaiterRef(waiter));
  return waiter;
}

// No V8 here: runs on the wait's own thread. Waits until the lock is held on the file at the waiter's path, or
// the wait is cancelled (ECANCELED), or a call fails: 0 or that errno, with the failed call in `*syscall`.
int waitForLock(LockWaiter& waiter, int sig, const char** syscall) {
  for (;;) {
    *syscall = "flock";
    if (waiter.cancelled.load()) return ECANCELED;
    int err;
    if (sig) {
      err = vmspace::lockWaitBlocking(waiter.fd, waiter.shared);
      if (err == EINTR) continue;  // a cancel (or another signal): check the flag again
    } else {
      // No signal to interrupt a blocking wait with: poll without blocking instead.
      err = vmspace::lockTry(waiter.fd, waiter.shared);
      if (err == EWOULDBLOCK) {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        continue;
      }
    }
    if (err != 0) return err;
    // Granted: on the file at the path, or on one deleted meanwhile (then wait again on the new one).
    err = vmspace::lockFollowPath(waiter.path, &waiter.fd, syscall);
    if (err != EAGAIN) return err;
  }
}

// On the wait's thread: hands the result to the JS thread, or drops the lock when the env is gone.
void deliver(LockWaiter& waiter, LockWaitDone* done, int err, const char* syscall) {
  std::lock_guard<std::mutex> lock(waiter.mu);
  waiter.done = true;
  if (waiter.tsfnGone) {
    vmspace::lockClose(waiter.fd);  // the env is gone: drop the lock (if we got it) here
    delete done;
    return;
  }
  done->err = err;
  done->syscall = syscall;
  if (waiter.tsfn.BlockingCall(done) != napi_ok) {
    vmspace::lockClose(waiter.fd);
    delete done;
  }
  waiter.tsfn.Release();
}

// Starts the wait's thread; without one (EAGAIN: RLIMIT_NPROC or the kernel's thread limit) the fd goes back to
// the caller, who closes it, and this throws.
void startWaitThread(Napi::Env env, const WaiterRef& waiter, int sig, LockWaitDone* done) {
  std::thread t;
  try {
    t = std::thread([waiter, sig, done] {
      const char* syscall = "flock";
      int err = waitForLock(*waiter, sig, &syscall);
      deliver(*waiter, done, err, syscall);
    });
  } catch (const std::system_error& e) {
    delete done;
    instance(env).waiters.erase(waiter);
    instance(env).locks.insert(waiter->fd);
    waiter->tsfn.Release();
    Napi::Error err = Napi::Error::New(env, std::string("vmspace: no thread for the lock wait: ") + e.what());
    err.Set("errno", Napi::Number::New(env, e.code().value()));
    throw err;
  }
  waiter->thread = t.native_handle();
  t.detach();
}

// lockWait({fd, path, shared}, callback(errno, fd, syscall)): callback gets 0 once the lock is held on the file
// at `path`, ECANCELED after lockCancel, or the errno of `syscall`; with the fd it ends with, which the caller
// releases (a new one when the file was replaced during the wait). Returns the handle for lockCancel.
Napi::Value LockWait(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  WaiterRef waiter = newWaiter(info);
  instance(env).locks.erase(waiter->fd);  // the wait owns it until its callback runs
  instance(env).waiters.insert(waiter);
  int sig = vmspace::lockCancelSignal();  // installed here, on the JS thread, before any cancel can be sent
  // The result's allocation is made here, on the JS thread, where a bad_alloc becomes a JS exception: on the
  // detached wait thread it would end the process (std::terminate).
  auto* done = new LockWaitDone{waiter, 0, "flock"};
  startWaitThread(env, waiter, sig, done);
  return Napi::External<WaiterRef>::New(env, new WaiterRef(waiter), [](Napi::Env, WaiterRef* w) { delete w; });
}

// Interrupts a wait. The signal can land just before the thread enters flock, so the caller repeats this until
// the callback has run (lib/lock.ts does, every 10 ms).
Napi::Value LockCancel(const Napi::CallbackInfo& info) {
  if (info[0].IsExternal()) cancelWaiter(**info[0].As<Napi::External<WaiterRef>>().Data());
  return info.Env().Undefined();
}

// Closes a lock fd (and its registration) on the pool: a close can block (NFS flushing).
Napi::Value LockRelease(const Napi::CallbackInfo& info) {
  int fd = static_cast<int>(intArg(info, 0));
  instance(info.Env()).locks.erase(fd);
  return runVoid(info.Env(), [fd] { vmspace::lockClose(fd); });
}

}  // namespace

void initLock(Napi::Env env, Napi::Object exports) {
  exportFunction(env, exports, "lockOpen", LockOpen);
  exportFunction(env, exports, "lockWait", LockWait);
  exportFunction(env, exports, "lockCancel", LockCancel);
  exportFunction(env, exports, "lockRelease", LockRelease);
}

}  // namespace vmspace::binding
