// The pool behind pool_parallel_for (work_pool.h).
// One job at a time, published in `ticket_`: its generation in the high 32 bits, the next
// unclaimed chunk in the low 32. A thread claims a chunk with a compare-and-swap that
// names the generation it read, so a worker that wakes late can never claim a chunk of a
// later job with the last job's function. Before the caller rewrites the job's fields it
// closes the finished job's ticket (no chunk left to claim), and it writes the fields
// with release: a worker that reads a new field has seen the close, and its claim fails.
#include "work_pool.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/ParallelGuard.h>
#include <pthread.h>
#include <sched.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace pagedattn {

namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// How long an idle worker spins for the next job before it sleeps. A sleeping worker
// wakes in tens of microseconds, and the caller runs the job's chunks meanwhile, so a
// short spin costs a quiet step nothing measurable, while a worker that sleeps instead of
// spinning through its time slice is ready when the scheduler gives a busy machine's
// cores back (docs/performance.md, "The kernels' own thread pool").
constexpr int64_t kWorkerSpinMicros = 50;
// The caller's spins on a chunk that a worker claimed before it yields its core.
constexpr int kCallerSpinsBeforeYield = 2048;

constexpr uint64_t kClosed = 0xffffffffu;  // a ticket's `next` while the fields change

uint32_t generation_of(uint64_t ticket) { return static_cast<uint32_t>(ticket >> 32); }
uint32_t next_of(uint64_t ticket) { return static_cast<uint32_t>(ticket); }

class WorkPool {
 public:
  void run(int64_t chunks, int64_t threads, void (*chunk)(void*, int64_t), void* ctx) {
    std::lock_guard<std::mutex> one_job(job_mutex_);  // callers on two threads take turns
    const int64_t helpers = threads - 1;
    ensure_workers(helpers);
    const uint32_t last = generation_of(ticket_.load(std::memory_order_relaxed));
    ticket_.store(static_cast<uint64_t>(last) << 32 | kClosed, std::memory_order_relaxed);
    chunks_.store(chunks, std::memory_order_release);
    helpers_.store(helpers, std::memory_order_release);
    chunk_.store(chunk, std::memory_order_release);
    ctx_.store(ctx, std::memory_order_release);
    done_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    const uint32_t gen = last + 1;
    ticket_.store(static_cast<uint64_t>(gen) << 32, std::memory_order_seq_cst);
    for (int64_t i = 0; i < helpers; ++i) slots_[i]->wake();
    claim_and_run(gen, chunks, chunk, ctx);
    for (int spins = 0; done_.load(std::memory_order_acquire) < chunks; ++spins) {
      if (spins < kCallerSpinsBeforeYield) cpu_relax();
      else sched_yield();
    }
    if (error_) std::rethrow_exception(error_);
  }

  // After fork the child has only the forking thread: forget the workers, and the locks
  // whatever thread held them.
  void forget_after_fork() {
    new (&job_mutex_) std::mutex();
    new (&error_mutex_) std::mutex();
    for (auto& s : slots_) s.release();  // their threads are gone; leak, never touch
    slots_.clear();
    forked_ = true;
  }

 private:
  // A worker's sleep: its own condition variable, so a job wakes only its helpers.
  struct Slot {
    std::mutex mutex;
    std::condition_variable cv;
    std::atomic<bool> sleeping{false};
    void wake() {
      if (!sleeping.load(std::memory_order_seq_cst)) return;
      { std::lock_guard<std::mutex> lock(mutex); }
      cv.notify_one();
    }
  };

  // A new worker runs where torch's OpenMP thread of the same number may run. A thread
  // inherits its creator's CPU mask, and a host that binds each OpenMP thread to a core
  // (vLLM's CPU workers do) binds the caller to one: left alone, every worker would share
  // the caller's core.
  void ensure_workers(int64_t wanted) {
    if (static_cast<int64_t>(slots_.size()) >= wanted) return;
    // libgomp does not survive fork: a forked child's workers keep the caller's mask.
    const std::vector<std::optional<cpu_set_t>> masks =
        forked_ ? std::vector<std::optional<cpu_set_t>>(static_cast<size_t>(wanted + 1))
                : openmp_thread_masks(wanted + 1);
    while (static_cast<int64_t>(slots_.size()) < wanted) {
      const int64_t index = static_cast<int64_t>(slots_.size());
      slots_.push_back(std::make_unique<Slot>());
      Slot* slot = slots_.back().get();
      const std::optional<cpu_set_t> mask = masks[index + 1];
      std::thread([this, index, slot, mask] {
        pthread_setname_np(pthread_self(), "pagedattn-pool");  // as top -H and /proc show it
        if (mask) pthread_setaffinity_np(pthread_self(), sizeof(cpu_set_t), &*mask);
        worker_loop(index, *slot);
      }).detach();
    }
  }

  // The CPU mask of each of torch's first `threads` OpenMP threads (none where a thread
  // did not run or its mask could not be read).
  static std::vector<std::optional<cpu_set_t>> openmp_thread_masks(int64_t threads) {
    std::vector<std::optional<cpu_set_t>> masks(static_cast<size_t>(threads));
    std::mutex m;
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      const int t = at::get_thread_num();
      cpu_set_t set;
      CPU_ZERO(&set);
      if (t < 0 || t >= threads || sched_getaffinity(0, sizeof(set), &set) != 0) return;
      std::lock_guard<std::mutex> lock(m);
      masks[t] = set;
    });
    return masks;
  }

  void claim_and_run(uint32_t gen, int64_t chunks, void (*chunk)(void*, int64_t), void* ctx) {
    c10::ParallelGuard in_region(true);
    uint64_t t = ticket_.load(std::memory_order_acquire);
    while (generation_of(t) == gen && next_of(t) < static_cast<uint64_t>(chunks)) {
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel,
                                         std::memory_order_acquire))
        continue;
      try {
        chunk(ctx, next_of(t));
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
      done_.fetch_add(1, std::memory_order_acq_rel);
      t = ticket_.load(std::memory_order_acquire);
    }
  }

  void worker_loop(int64_t index, Slot& slot) {
    uint32_t seen = generation_of(ticket_.load(std::memory_order_acquire));
    bool helped = true;
    for (;;) {
      seen = generation_of(wait_for_job(seen, slot, /*spin=*/helped));
      // The fields as published for `seen`, or a later job's: then every claim below
      // fails on the generation and nothing runs.
      helped = index < helpers_.load(std::memory_order_acquire);
      if (!helped) continue;
      claim_and_run(seen, chunks_.load(std::memory_order_acquire),
                    chunk_.load(std::memory_order_acquire), ctx_.load(std::memory_order_acquire));
    }
  }

  uint64_t wait_for_job(uint32_t seen, Slot& slot, bool spin) {
    if (spin) {
      const auto until =
          std::chrono::steady_clock::now() + std::chrono::microseconds(kWorkerSpinMicros);
      for (int spins = 0;; ++spins) {
        const uint64_t t = ticket_.load(std::memory_order_acquire);
        if (generation_of(t) != seen) return t;
        cpu_relax();
        if ((spins & 63) == 63 && std::chrono::steady_clock::now() > until) break;
      }
    }
    std::unique_lock<std::mutex> lock(slot.mutex);
    slot.sleeping.store(true, std::memory_order_seq_cst);
    uint64_t t = 0;
    slot.cv.wait(lock, [&] {
      t = ticket_.load(std::memory_order_seq_cst);
      return generation_of(t) != seen;
    });
    slot.sleeping.store(false, std::memory_order_relaxed);
    return t;
  }

  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int64_t> chunks_{0};
  std::atomic<int64_t> helpers_{0};
  std::atomic<void (*)(void*, int64_t)> chunk_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  std::exception_ptr error_;
  std::mutex error_mutex_;
  std::mutex job_mutex_;
  std::vector<std::unique_ptr<Slot>> slots_;  // guarded by job_mutex_
  bool forked_ = false;                        // this process is a fork's child
};

// Never destroyed: detached workers may still be waiting on it at exit.
WorkPool& pool() {
  static WorkPool* p = [] {
    auto* made = new WorkPool();
    pthread_atfork(nullptr, nullptr, [] { pool().forget_after_fork(); });
    return made;
  }();
  return *p;
}

}  // namespace

int64_t pool_threads_here() { return at::in_parallel_region() ? 1 : at::get_num_threads(); }

void pool_run_chunks(int64_t chunks, int64_t threads, void (*chunk)(void*, int64_t),
                     void* ctx) {
  if (chunks <= 0) return;
  TORCH_CHECK(chunks < static_cast<int64_t>(kClosed), "pool_run_chunks: ", chunks,
              " chunks do not fit the ticket");
  if (threads <= 1 || chunks == 1) {
    c10::ParallelGuard in_region(true);
    for (int64_t i = 0; i < chunks; ++i) chunk(ctx, i);
    return;
  }
  pool().run(chunks, std::min(threads, chunks), chunk, ctx);
}

int64_t work_pool_spin_micros() { return kWorkerSpinMicros; }

namespace {
// Tests only: runs pool_parallel_for over [0, n) with `grain` and returns how many times
// each index was visited; the chunk holding index `throw_at` raises ValueError after its
// visits are counted.
at::Tensor work_pool_visits(int64_t n, int64_t grain, int64_t throw_at) {
  TORCH_CHECK_VALUE(n >= 0, "work_pool_visits: n must be >= 0, got ", n);
  TORCH_CHECK_VALUE(grain >= 1, "work_pool_visits: grain must be >= 1, got ", grain);
  std::vector<std::atomic<int32_t>> visits(static_cast<size_t>(n));
  pool_parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) visits[i].fetch_add(1, std::memory_order_relaxed);
    TORCH_CHECK_VALUE(!(throw_at >= b && throw_at < e), "chunk [", b, ", ", e,
                      ") raised as asked");
  });
  at::Tensor out = at::empty({n}, at::kInt);
  int32_t* o = out.data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i) o[i] = visits[i].load();
  return out;
}
}  // namespace

}  // namespace pagedattn

TORCH_LIBRARY_FRAGMENT(pagedattn, m) {
  m.def("work_pool_spin_micros() -> int", &pagedattn::work_pool_spin_micros);
  m.def("work_pool_visits(int n, int grain, int throw_at) -> Tensor",
        &pagedattn::work_pool_visits);
}
