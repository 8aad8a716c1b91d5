// Batched calls: many short operations served per libuv hop.
//
// A plain Work costs one uv_queue_work, one pool-thread wakeup, one async handle, one callback scope and one
// completion wakeup of the JS thread per call; with 64 allocate/dispose calls in flight those hand-offs cost as
// much as the calls' own syscalls. A Batch instead keeps one queue per env: a call is queued (no libuv request of
// its own), at most kWorkers pool threads take calls from it one after another, and the calls done meanwhile are
// settled together by one thread-safe-function wakeup of the JS thread. Each call still settles as soon as it is
// done (a long dispose never holds back a short allocate finished beside it), calls still run in parallel on up
// to kWorkers threads, and with one call in flight the cost is that of a Work.
//
// Lifecycle of a call (a Job): submit (JS thread) -> pending -> run on a pool thread -> done -> settled on the JS
// thread (resolve/reject) -> deleted. When the env is torn down (a worker thread ending, or the process), a call
// not run yet is dropped unrun, and a call run but not settled is dropped with its result: drop() releases what
// its result holds (a lease fd) and the workspace is then an orphan for a sweep.
#pragma once

#include <napi.h>

#include <functional>
#include <memory>

#include "../core/error.h"

namespace vmspace::binding {

// One queued call. run() does the work on a pool thread (it may throw: the exception is the rejection);
// resolve() makes its value on the JS thread; drop() releases a result, or the call's inputs when it never ran.
class Job {
 public:
  explicit Job(Napi::Env env);
  virtual ~Job() = default;
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  Napi::Promise promise() const { return deferred_.Promise(); }
  // Pool thread: runs the call, keeping its error (never throws).
  void execute() noexcept;
  // JS thread: resolves or rejects the promise; a result that cannot be delivered is dropped (never throws).
  // False when it could not be delivered (JS can no longer run: the env is ending).
  bool settle(Napi::Env env) noexcept;
  // The call will never be settled (env torn down): releases what it holds (never throws).
  void abandon() noexcept;
  // JS thread: the call could not be run (no pool thread could be asked for): releases its inputs and rejects
  // with `err` from uv_queue_work (never throws).
  void fail(Napi::Env env, int err) noexcept;
  // Its value hands a native object to a JS handle whose finalizer owns it (openPool's pool, warmBuild's entry):
  // then it is settled only while JS can still run (probed first), else dropped. A handle made while the env is
  // being torn down is never finalized: the pool's fds or the entry's lease would stay open in the process after
  // worker.terminate().
  void setOwnsHandle() { ownsHandle_ = true; }
  bool ownsHandle() const { return ownsHandle_; }

 protected:
  virtual void run() = 0;
  virtual Napi::Value resolve(Napi::Env env) = 0;
  // Called at most once: after run() succeeded with a result never delivered, or when run() never ran.
  virtual void drop(bool ran) noexcept { (void)ran; }

 private:
  Napi::Promise::Deferred deferred_;
  std::unique_ptr<Error> error_;
  bool ran_ = false;
  bool outOfMemory_ = false;
  bool ownsHandle_ = false;
  Job* next_ = nullptr;  // the queue it is on (batch.cc): intrusive, so queueing never allocates
  friend class JobList;
};

// A Job from lambdas, like Work: `exec` returns R on the pool thread, `toJs` makes the value, `drop` (optional)
// releases an undelivered R, `unrun` (optional) releases the inputs of a call that never ran.
template <typename R>
class LambdaJob : public Job {
 public:
  LambdaJob(Napi::Env env, std::function<R()> exec, std::function<Napi::Value(Napi::Env, R&)> toJs,
            std::function<void(R&)> drop = nullptr, std::function<void()> unrun = nullptr)
      : Job(env), exec_(std::move(exec)), toJs_(std::move(toJs)), drop_(std::move(drop)), unrun_(std::move(unrun)) {}

 protected:
  void run() override { result_ = exec_(); }
  Napi::Value resolve(Napi::Env env) override { return toJs_(env, result_); }
  void drop(bool ran) noexcept override {
    try {
      if (ran && drop_) drop_(result_);
      if (!ran && unrun_) unrun_();
    } catch (...) {
    }
  }

 private:
  std::function<R()> exec_;
  std::function<Napi::Value(Napi::Env, R&)> toJs_;
  std::function<void(R&)> drop_;
  std::function<void()> unrun_;
  R result_{};
};

// Queues `job` on the env's batch and returns its promise.
Napi::Promise submitBatched(Napi::Env env, std::unique_ptr<Job> job);

// Runs `job` on a uv_queue_work of its own (Work) and returns its promise: for calls that are long or rarely many
// at once. Throws (nothing queued, the job released unrun) when no work request can be made.
Napi::Promise runAlone(Napi::Env env, std::unique_ptr<Job> job);

// The env is ending: every call not settled yet is abandoned (Instance's destructor).
class Batch;
void closeBatch(const std::shared_ptr<Batch>& batch) noexcept;
void closeBatch(Batch& batch) noexcept;

}  // namespace vmspace::binding
