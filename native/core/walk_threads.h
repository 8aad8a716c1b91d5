// The threads of a tree clone's walk (tree.cc): the pool that runs its directories in parallel, the queue of
// opened directories handed between its threads, and the CPU-wait measure (CpuWait) that decides how many threads
// a walk may use. What a thread does with a directory is the caller's (the Walk it is given); this file owns only
// the threads, the queue, their limits and the first error.
#pragma once

#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "clone.h"
#include "error.h"

namespace vmspace {

// How long the calling thread has waited for a CPU, against how long it ran, since it started on this walk: from
// /proc/thread-self/schedstat (run ns, run-queue wait ns, timeslices; the kernel's
// Documentation/scheduler/sched-stats.rst). Read at most once per kIntervalNs, so a walk of many tiny directories
// pays ~3 syscalls per 2 ms. The answer is yes once the thread has been runnable for kMinSpanNs and waited at
// least as long as it ran (it got at most half a CPU): a sum over the walk, so that a blip (a kworker, the JS
// thread) on an idle machine seldom counts, while a loaded machine is told apart from an idle one (a lower
// threshold raised the limit on idle machines too; docs/DESIGN.md, "Measurements behind the code"). Where the file
// cannot be read (no CONFIG_SCHED_INFO, /proc not mounted,
// EMFILE) the answer is always no: the walk keeps one thread per CPU, as on an idle machine.
class CpuWait {
 public:
  static constexpr int64_t kIntervalNs = 2'000'000;
  static constexpr uint64_t kMinSpanNs = 8'000'000;

  explicit CpuWait(bool wanted) : on_(wanted && read(&run0_, &wait0_)), last_(now()) {}

  // True once, when the thread has waited on a run queue at least as long as it ran (see above).
  bool waitedLong();

 private:
  static int64_t now();
  // The first two fields; false on any failure (open, read, a malformed line).
  static bool read(uint64_t* run, uint64_t* wait);

  uint64_t run0_ = 0, wait0_ = 0;  // at the start; declared before on_, whose initializer reads into them
  bool on_;
  int64_t last_;
};

// Adds the counts of `s` (one thread's) to `into`.
void addSummary(CloneSummary& into, const CloneSummary& s);

// The threads of a tree walk and the directories queued between them: one thread per CPU, up to kMaxThreads (the
// per-file cost is kernel work: openat(O_CREAT) and FICLONE), take tasks from a queue of at most kQueuePerThread
// per thread; a thread that finds a subdirectory while the queue has room hands it over (handOff), already opened,
// instead of entering it. When other processes keep the CPUs busy (a walking thread waits on a run queue at least
// as long as it runs: see CpuWait; asked between directories, so a walk of one flat directory never asks) and
// fds are plenty (the soft RLIMIT_NOFILE at least kDeepQueueFdLimit), the walk goes up to kMaxThreads threads, so
// that it keeps a share of the CPUs closer to its idle one; on an idle machine more threads than CPUs only contend,
// so the limit stays one per CPU there (docs/DESIGN.md, "Measurements behind the code"). When no thread can be
// started (EAGAIN at RLIMIT_NPROC) the threads there are (at least the caller's) do the work. The first error of any
// thread stops them all and is the one run() throws.
template <typename Task>
class WalkThreads {
 public:
  static constexpr unsigned kMaxThreads = 4;
  // Queued directories per thread (2 fds each). A queue of one per thread runs dry whenever the thread that fills
  // it is inside a directory of its own, and the other threads then sleep through much of a loaded clone.
  // Queued fds cannot be paged out under EMFILE as a walking thread's stack can, so the deeper queue is used only
  // where it is a small part of the fd limit (RLIMIT_NOFILE soft limit at least kDeepQueueFdLimit; Node raises the
  // soft limit to the hard one at startup): below, one per thread (at `ulimit -n 64` a queue of 16 directories
  // would take 32 of the ~40 free fds and the walk would fail with EMFILE).
  static constexpr unsigned kQueuePerThread = 8;
  static constexpr rlim_t kDeepQueueFdLimit = 4096;
  // What a thread does with a task: walks it, adding to the thread's own summary.
  using Walk = std::function<void(Task&, CloneSummary&)>;

  explicit WalkThreads(Walk walk) : walk_(std::move(walk)) {
    unsigned cores = std::thread::hardware_concurrency();
    maxThreads_ = std::max(1u, std::min(kMaxThreads, cores ? cores : 1u));
    struct rlimit nofile;
    bool roomy = getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur >= kDeepQueueFdLimit;
    // Each thread keeps up to 2 fds per open frame and pages out only its own under EMFILE: more threads than
    // CPUs only where fds are plenty (at `ulimit -n 64` four threads failed with EMFILE where two never did).
    canGrow_ = roomy && maxThreads_ < kMaxThreads;
    queueMax_ = maxThreads_ * (roomy ? kQueuePerThread : 1);
    helpers_.reserve(kMaxThreads);
    queue_.reserve(queueMax_);
  }
  WalkThreads(const WalkThreads&) = delete;
  WalkThreads& operator=(const WalkThreads&) = delete;
  ~WalkThreads() { joinHelpers(); }

  // Walks `root` on the calling thread and whatever is handed off on the others, until no task is queued and
  // none is running. Throws the first error; the summaries of all threads are added into `summary`.
  void run(std::unique_ptr<Task> root, CloneSummary& summary) {
    summary_ = &summary;
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(root));
    }
    work();
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return active_ == 0; });
      stop_ = true;
    }
    joinHelpers();
    if (failed_) throw firstError_;
  }

  // Queues `task` for another thread when the queue has room, starting a helper if none is free; false (the
  // caller walks it itself) otherwise.
  bool handOff(std::unique_ptr<Task>& task) {
    bool wake;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (maxThreads_ < 2 || stop_ || queue_.size() >= queueMax_) return false;
      queue_.push_back(std::move(task));
      wake = idle_ > 0;  // a busy thread takes the task when it is done: no wakeup owed
      startHelperLocked();
    }
    if (wake) cv_.notify_one();
    return true;
  }

  // Fds ran short (EMFILE, ENFILE): the queue, whose fds no thread can close, is held to one task per thread, and the
  // thread limit is not raised any more.
  void fdsShort() {
    std::lock_guard<std::mutex> lock(mu_);
    queueMax_ = std::min(queueMax_, maxThreads_);
    canGrow_ = false;  // no more threads, whose frames would take more fds
  }

  // True once the walk is to stop (an error in any thread): read between entries, without the lock.
  bool stopping() const { return stop_; }

 private:
  // Starts a helper (mu_ held) when a queued task has no idle thread to take it and the limit allows one more;
  // true when one was started.
  bool startHelperLocked() {
    if (stop_ || idle_ >= queue_.size() || helpers_.size() + 1 >= maxThreads_) return false;
    try {
      helpers_.emplace_back([this] { work(); });
      return true;
    } catch (const std::system_error&) {
      // No thread (EAGAIN: RLIMIT_NPROC or the kernel's thread limit): the threads there are do the work.
      maxThreads_ = static_cast<unsigned>(helpers_.size()) + 1;
      canGrow_ = false;
      return false;
    }
  }

  // Called by a thread between tasks once it has waited long on a run queue (CpuWait): the limit goes to kMaxThreads
  // (once per walk; never down again) and helpers start for the queued tasks.
  void cpuBusy() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!canGrow_) return;
    canGrow_ = false;
    maxThreads_ = kMaxThreads;
    while (startHelperLocked()) {
    }
  }

  // Whether a thread starting now should watch its CPU wait (the limit can still be raised).
  bool growable() {
    std::lock_guard<std::mutex> lock(mu_);
    return canGrow_;
  }

  void joinHelpers() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : helpers_) t.join();
    helpers_.clear();
  }

  // The loop of every thread: take a task, walk it, until no task is queued and none is running.
  void work() {
    CloneSummary local;
    CpuWait cpu(growable());
    for (;;) {
      std::unique_ptr<Task> t;
      {
        std::unique_lock<std::mutex> lock(mu_);
        idle_++;
        cv_.wait(lock, [&] { return stop_ || !queue_.empty() || active_ == 0; });
        idle_--;
        if (stop_ || queue_.empty()) break;
        t = std::move(queue_.back());
        queue_.pop_back();
        active_++;
      }
      try {
        walk_(*t, local);
      } catch (...) {
        // Whatever it is (an Error, bad_alloc, system_error): the clone fails with it, no thread ends on it.
        fail(currentError());
      }
      t.reset();
      if (cpu.waitedLong()) cpuBusy();
      bool last;
      {
        std::lock_guard<std::mutex> lock(mu_);
        last = --active_ == 0;
      }
      // Waiters wait for a task (handOff wakes them), a stop (fail) or the last task's end: only that one wakes them
      // here, not every finished task.
      if (last) cv_.notify_all();
    }
    std::lock_guard<std::mutex> lock(mu_);
    addSummary(*summary_, local);
  }

  void fail(const Error& e) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failed_) {
        failed_ = true;
        firstError_ = e;
      }
      stop_ = true;
    }
    cv_.notify_all();
  }

  Walk walk_;
  CloneSummary* summary_ = nullptr;  // run()'s, added to under mu_
  unsigned maxThreads_;              // lowered (under mu_) when a thread cannot be started; raised once by cpuBusy
  bool canGrow_ = false;             // (under mu_) the limit is below kMaxThreads and has not been raised yet
  unsigned queueMax_;                // lowered (under mu_) when fds run short
  std::mutex mu_;                    // guards everything below it but the atomic
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Task>> queue_;  // at most queueMax_
  std::vector<std::thread> helpers_;
  unsigned active_ = 0;
  size_t idle_ = 0;                // threads waiting for a task
  std::atomic<bool> stop_{false};  // also read without the lock, between entries
  bool failed_ = false;
  Error firstError_;
};

}  // namespace vmspace
