// stream_read: every byte of a CPU buffer read once, on every thread, with the ISA's widest
// loads (stream_read_impl.h), returning the bytes' sum -- the fastest plain read of memory
// this machine has, the bench's DRAM roof (pagedattn/bench/probes.py). Validation here,
// the unchecked loop below it.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "binding_utils.h"
#include "work_pool.h"

namespace pagedattn {

namespace {
// Parallel grain: a buffer of at most one chunk stays on the calling thread (waking the
// pool costs more than reading it); larger ones are split into one contiguous range per
// thread, so each thread's hardware prefetcher sees a single long stream.
constexpr int64_t kChunkBytes = int64_t{1} << 18;
}  // namespace

at::Tensor stream_read(const at::Tensor& buf) {
  check_cpu(buf, "buf");
  TORCH_CHECK_VALUE(buf.layout() == at::kStrided, "buf must be a dense (strided) tensor, got layout ",
                    buf.layout());
  TORCH_CHECK_VALUE(buf.numel() > 0, "buf must be non-empty, got shape ", buf.sizes());
  TORCH_CHECK_VALUE(buf.is_contiguous(), "buf must be contiguous, got shape ", buf.sizes(),
                    " with strides ", buf.strides(), " (call .contiguous() first)");
  const auto* p = static_cast<const uint8_t*>(buf.const_data_ptr());
  const int64_t n = static_cast<int64_t>(buf.nbytes());
  const int64_t chunks = (n + kChunkBytes - 1) / kChunkBytes;
  const KernelTable* kt = current_kernels();
  // One partial sum per range handed out (indexed by its first chunk): no shared writes.
  std::vector<uint64_t> partial(static_cast<size_t>(chunks), 0);
  pool_parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    const int64_t lo = begin * kChunkBytes, hi = std::min(n, end * kChunkBytes);
    partial[static_cast<size_t>(begin)] = kt->sum_bytes(p + lo, hi - lo);
  });
  uint64_t total = 0;
  for (uint64_t s : partial) total += s;
  return at::scalar_tensor(static_cast<int64_t>(total), buf.options().dtype(at::kLong));
}

}  // namespace pagedattn

TORCH_LIBRARY_FRAGMENT(pagedattn, m) {
  m.def("stream_read(Tensor buf) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedattn, CPU, m) {
  m.impl("stream_read", &pagedattn::stream_read);
}
