// The parallel loop of pagedattn's native ops: a pool whose calling thread takes every
// chunk that no worker has claimed.
// An OpenMP region ends in a join that waits for each of its threads to have run its
// share, so while a busy neighbour holds the cores a region waits a scheduler time slice
// for a thread that has not even started. Here the threads claim chunks from one counter,
// and the caller waits only for chunks that a worker has already claimed and not yet
// finished. Which thread runs a chunk never changes a result: chunks write disjoint
// outputs, as at::parallel_for's do.
#pragma once
#include <algorithm>
#include <cstdint>

namespace pagedattn {

// Runs chunk(ctx, i) for every i in [0, chunks) on up to `threads` threads, the caller one
// of them; returns once every chunk has run. Rethrows the first exception a chunk threw.
void pool_run_chunks(int64_t chunks, int64_t threads, void (*chunk)(void*, int64_t),
                     void* ctx);
// The threads a loop may use: torch's intra-op count, or 1 inside a parallel region (of
// the pool or of torch), so nested loops run inline.
int64_t pool_threads_here();

// at::parallel_for's contract (fn(b, e) over disjoint ranges covering [begin, end), each at
// least `grain` long but the last), on the pool: one chunk per thread, as OpenMP splits
// it. Four per thread streamed a linear layer's cold weights 10-40% slower on Zen 4 (each
// thread hopping between regions), which moved measured paths to oneDNN.
template <class F>
void pool_parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t threads = n > grain ? pool_threads_here() : 1;
  if (threads <= 1) {
    fn(begin, end);
    return;
  }
  const int64_t min_size = std::max<int64_t>(grain, 1);
  const int64_t max_chunks = std::min<int64_t>(threads, (n + min_size - 1) / min_size);
  const int64_t size = (n + max_chunks - 1) / max_chunks;
  const int64_t chunks = (n + size - 1) / size;
  struct Loop {
    const F* fn;
    int64_t begin, end, size;
  } loop{&fn, begin, end, size};
  pool_run_chunks(
      chunks, threads,
      [](void* ctx, int64_t i) {
        const Loop& l = *static_cast<const Loop*>(ctx);
        const int64_t b = l.begin + i * l.size;
        (*l.fn)(b, std::min(l.end, b + l.size));
      },
      &loop);
}

}  // namespace pagedattn
