// Batched calls (batch.h).
#include "batch.h"

#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <utility>

#include "common.h"

namespace vmspace::binding {

Job::Job(Napi::Env env) : deferred_(Napi::Promise::Deferred::New(env)) {}

void Job::execute() noexcept {
  try {
    run();
  } catch (...) {
    try {
      error_ = std::make_unique<Error>(vmspace::currentError());
    } catch (...) {
      outOfMemory_ = true;  // not even the Error could be made
    }
  }
  ran_ = true;
}

bool Job::settle(Napi::Env env) noexcept {
  bool delivered = false;
  try {
    Napi::HandleScope scope(env);
    if (outOfMemory_) {
      deferred_.Reject(errorObject(env, vmspace::outOfMemoryError()));
    } else if (error_) {
      deferred_.Reject(errorObject(env, *error_));
    } else {
      deferred_.Resolve(resolve(env));
    }
    delivered = true;
  } catch (...) {
  }
  if (!delivered && ran_ && !error_ && !outOfMemory_) drop(true);
  return delivered;
}

void Job::fail(Napi::Env env, int err) noexcept {
  drop(false);
  try {
    Napi::HandleScope scope(env);
    Error e;
    e.err = err;
    e.syscall = "uv_queue_work";
    deferred_.Reject(errorObject(env, e));
  } catch (...) {
  }
}

void Job::abandon() noexcept {
  if (!ran_)
    drop(false);
  else if (!error_ && !outOfMemory_)
    drop(true);
}

// A FIFO of jobs linked through Job::next_.
class JobList {
 public:
  bool empty() const { return head_ == nullptr; }
  void push(Job* job) {
    job->next_ = nullptr;
    (tail_ ? tail_->next_ : head_) = job;
    tail_ = job;
  }
  Job* pop() {
    Job* job = head_;
    if (job) {
      head_ = job->next_;
      if (!head_) tail_ = nullptr;
      job->next_ = nullptr;
    }
    return job;
  }
  JobList take() { return std::exchange(*this, JobList{}); }

 private:
  Job* head_ = nullptr;
  Job* tail_ = nullptr;
};

namespace {

void batchCallJs(Napi::Env env, Napi::Function, Batch* batch, void*);
using BatchTsfn = Napi::TypedThreadSafeFunction<Batch, void, batchCallJs>;

// Pool threads serving one env's batch at once: one fewer than libuv's pool (UV_THREADPOOL_SIZE, 4 by default),
// at least one, so that other fs work of the process (a readFile, a list(), a clone) always finds a thread. On 2
// CPUs fewer threads also contend less for the pool directories' locks: 64 allocate/dispose pairs in flight on
// XFS ran at 30.5k pairs/s with 1 thread, 28.4k with 3 and 28.3k with 4 (one run each, load ~3).
int workerLimit() {
  static const int limit = [] {
    const char* s = std::getenv("UV_THREADPOOL_SIZE");
    long n = s ? std::strtol(s, nullptr, 10) : 4;
    if (n < 1) n = 4;  // libuv's own reading: 0 or garbage is its default
    return static_cast<int>(n > 1024 ? 1023 : n > 1 ? n - 1 : 1);
  }();
  return limit;
}

// Calls a worker runs before it gives its pool thread back, so that libuv requests queued meanwhile (other fs work
// of the process) are not held back by a long queue of allocate/dispose calls.
constexpr int kRunsPerWorker = 32;

// Whether JS can still run in `env`: false once the env is being torn down (a worker thread exiting or
// terminated), when N-API refuses to settle a promise. Probed with a throwaway promise.
bool canRunJs(Napi::Env env) {
  napi_deferred deferred;
  napi_value promise, undefined;
  if (napi_create_promise(env, &deferred, &promise) != napi_ok) return false;
  if (napi_get_undefined(env, &undefined) != napi_ok) return false;
  return napi_resolve_deferred(env, deferred, undefined) == napi_ok;
}

}  // namespace

class Batch {
 public:
  std::mutex mu;
  JobList pending;        // mu
  JobList done;           // mu: run, to be settled
  bool notified = false;  // mu: a wakeup of the JS thread is on its way
  bool closed = false;    // mu: the env is ending; jobs are abandoned, the tsfn is not touched
  bool tsfnGone = false;  // mu: Node finalized the tsfn (env teardown)
  int workers = 0;        // JS thread: workers queued and not yet completed
  BatchTsfn tsfn;

  // JS thread: settles every job done so far; false when one could not be delivered.
  bool settleDone(Napi::Env env) {
    JobList list;
    {
      std::lock_guard<std::mutex> lock(mu);
      list = done.take();
      notified = false;
    }
    bool delivered = true;
    while (Job* job = list.pop()) {
      delivered = job->settle(env) && delivered;
      delete job;
    }
    return delivered;
  }

  // JS thread: rejects every job still pending with `err` (no worker could be started to run them).
  void failPending(Napi::Env env, int err) {
    JobList list;
    {
      std::lock_guard<std::mutex> lock(mu);
      list = pending.take();
    }
    while (Job* job = list.pop()) {
      job->fail(env, err);
      delete job;
    }
  }
};

namespace {

class BatchWorker : public Napi::AsyncWorker {
 public:
  BatchWorker(Napi::Env env, std::shared_ptr<Batch> batch)
      : Napi::AsyncWorker(env, "vmspace batch"), batch_(std::move(batch)) {}

  // No V8 here: a pool thread. Runs pending jobs one after another and hands each to the JS thread when done.
  void Execute() override {
    Batch& b = *batch_;
    for (int n = 0; n < kRunsPerWorker; n++) {
      Job* job;
      {
        std::lock_guard<std::mutex> lock(b.mu);
        if (b.closed) return;
        job = b.pending.pop();
      }
      if (!job) return;
      job->execute();
      std::lock_guard<std::mutex> lock(b.mu);
      if (b.closed) {
        job->abandon();  // the env is gone: nobody will settle it
        delete job;
        return;
      }
      b.done.push(job);
      // Nothing more to run: this worker ends, and its OnOK settles the job (one JS wakeup, as with a Work).
      if (b.pending.empty() || n + 1 == kRunsPerWorker) return;
      if (!b.notified && !b.tsfnGone) {
        // Under mu: the tsfn is finalized under mu too, so it is alive here. Refused (the env is closing, or no
        // memory for the call): OnOK settles what is done.
        b.notified = b.tsfn.NonBlockingCall() == napi_ok;
      }
    }
  }

  // JS thread (also while the env is torn down: then closeBatch has abandoned every job and this does nothing).
  void OnOK() override {
    Batch& b = *batch_;
    b.workers--;
    {
      std::lock_guard<std::mutex> lock(b.mu);
      if (b.closed) return;
    }
    Napi::Env env = Env();
    bool delivered = b.settleDone(env);
    bool more;
    {
      std::lock_guard<std::mutex> lock(b.mu);
      more = !b.pending.empty();
    }
    // The env is ending (its libuv requests are drained before its cleanup hooks run): run nothing more. The
    // jobs still pending are dropped unrun, those done with their results (closeBatch). Probed only when a
    // settlement was refused or a worker is about to be started, not after every call.
    if ((!delivered || more) && !canRunJs(env)) {
      closeBatch(batch_);
      return;
    }
    startWorkers(env, batch_, workerLimit());
  }

  // Starts up to `count` workers while jobs wait and fewer than workerLimit() run. Without one
  // (napi_create_async_work or napi_queue_async_work failed: no memory) and none left to run them, the waiting
  // jobs are rejected with ENOMEM: every call settles.
  static void startWorkers(Napi::Env env, const std::shared_ptr<Batch>& batch, int count) {
    for (; count > 0 && batch->workers < workerLimit(); count--) {
      {
        std::lock_guard<std::mutex> lock(batch->mu);
        if (batch->pending.empty() || batch->closed) return;
      }
      try {
        auto* worker = new BatchWorker(env, batch);
        batch->workers++;
        try {
          worker->Queue();
        } catch (...) {
          batch->workers--;
          delete worker;
          throw;
        }
      } catch (...) {
        if (batch->workers == 0) batch->failPending(env, ENOMEM);
        return;
      }
    }
  }

 private:
  std::shared_ptr<Batch> batch_;
};

void batchCallJs(Napi::Env env, Napi::Function, Batch* batch, void*) {
  if (env == nullptr) return;  // teardown: closeBatch abandons what is left
  // worker.terminate() emits no 'exit' in the worker, and libuv requests are drained before the env's cleanup
  // hooks run: the first wakeup after JS stopped (a settlement refused, confirmed by the probe) drops the queue, so
  // the pool threads stop after their current call instead of running up to kRunsPerWorker more each.
  if (!batch->settleDone(env) && !canRunJs(env)) closeBatch(*batch);
}

std::shared_ptr<Batch> batchOf(Napi::Env env) {
  Instance& inst = instance(env);
  if (inst.batch) return inst.batch;
  auto batch = std::make_shared<Batch>();
  // Node finalizes a thread-safe function when its env is torn down, even while threads could still call it;
  // the finalizer says so under mu, and workers call it under mu only while it is alive.
  batch->tsfn = BatchTsfn::New(
      env, "vmspace batch", 0, 1, batch.get(),
      [](Napi::Env, std::shared_ptr<Batch>* ref, Batch*) {
        {
          std::lock_guard<std::mutex> lock((*ref)->mu);
          (*ref)->tsfnGone = true;
        }
        delete ref;
      },
      new std::shared_ptr<Batch>(batch));
  batch->tsfn.Unref(env);  // the workers' own libuv requests keep the loop alive while calls are in flight
  inst.batch = batch;
  return batch;
}

// One job on its own uv_queue_work. OnOK runs on the JS thread, also while the env is being torn down (a worker
// thread ending with this work in flight): then settle() finds no JS to run and drops the result.
class SoloWorker : public Napi::AsyncWorker {
 public:
  // Takes `job` only once the work request exists (a throw leaves it with the caller).
  SoloWorker(Napi::Env env, std::unique_ptr<Job>& job) : Napi::AsyncWorker(env, "vmspace"), job_(std::move(job)) {}
  void Execute() override { job_->execute(); }  // no V8 here: a pool thread
  void OnOK() override {
    if (job_->ownsHandle() && !canRunJs(Env())) {
      job_->abandon();  // its value released here, not handed to a handle nobody will finalize
      return;
    }
    job_->settle(Env());
  }

 private:
  std::unique_ptr<Job> job_;
};

}  // namespace

Napi::Promise runAlone(Napi::Env env, std::unique_ptr<Job> job) {
  Napi::Promise promise = job->promise();
  Job* raw = job.get();
  std::unique_ptr<SoloWorker> worker;
  try {
    worker = std::make_unique<SoloWorker>(env, job);
    worker->Queue();
    (void)worker.release();  // queued: node-addon-api deletes it after OnOK
  } catch (...) {
    raw->abandon();  // never run (owned by `job` or by `worker`): its inputs released
    throw;
  }
  return promise;
}

Napi::Promise submitBatched(Napi::Env env, std::unique_ptr<Job> job) {
  std::shared_ptr<Batch> batch = batchOf(env);
  Napi::Promise promise = job->promise();
  Job* raw = job.release();
  bool closed;
  {
    std::lock_guard<std::mutex> lock(batch->mu);
    closed = batch->closed;
    if (!closed) batch->pending.push(raw);
  }
  if (closed) {
    // The env is ending (closeBatch ran: process 'exit', or JS still running while a worker thread is terminated):
    // nothing will run the queue, so the call is released unrun and rejected now, not left on a dead queue
    // holding its inputs (a dispose's lease fd).
    raw->fail(env, ECANCELED);
    delete raw;
    return promise;
  }
  BatchWorker::startWorkers(env, batch, 1);  // a new call: at most one more worker
  return promise;
}

void closeBatch(const std::shared_ptr<Batch>& batch) noexcept {
  if (batch) closeBatch(*batch);
}

void closeBatch(Batch& batch) noexcept {
  JobList pending, done;
  {
    std::lock_guard<std::mutex> lock(batch.mu);
    batch.closed = true;
    pending = batch.pending.take();
    done = batch.done.take();
  }
  for (JobList* list : {&pending, &done}) {
    while (Job* job = list->pop()) {
      job->abandon();
      delete job;
    }
  }
}

}  // namespace vmspace::binding
