// argmax_rows: greedy sampling's token per row of a step's logits, the first maximal entry
// (the first NaN where a row has one), as torch.argmax(dim=-1) answers, on the ISA's
// vector kernel (layer_kernel_impl.h). torch's CPU argmax reduces one element at a time;
// a 32-row batch over a 49,152-token vocabulary cost ~1.3 ms there, and the engine pays it
// on the main thread every decode step. Validation here, the unchecked loop below it.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "binding_utils.h"
#include "work_pool.h"

namespace pagedattn {

namespace {
// Rows per parallel chunk: at least 64k entries, so a single row, or a few short ones, stay
// on the calling thread.
constexpr int64_t kMinChunkEntries = 65536;
}  // namespace

at::Tensor argmax_rows(const at::Tensor& logits) {
  check_cpu(logits, "logits");
  TORCH_CHECK_TYPE(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
                   "logits must be float32 or bfloat16, got ", logits.scalar_type());
  TORCH_CHECK_VALUE(logits.dim() == 2, "logits must be 2-D [rows, vocab], got shape ",
                    logits.sizes());
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK_VALUE(n >= 1, "logits must have at least one entry per row, got shape ",
                    logits.sizes());
  TORCH_CHECK_VALUE(n == 1 || logits.stride(1) == 1,
                    "logits' last dim must be contiguous, got strides ", logits.strides());
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  if (rows == 0) return out;
  const DType dtype = logits.scalar_type() == at::kFloat ? DType::kF32 : DType::kBF16;
  const KernelTable* kt = current_kernels();
  const void* x = logits.const_data_ptr();
  const int64_t stride = logits.stride(0);
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, kMinChunkEntries / n);
  pool_parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
    kt->argmax_rows(x, stride, b, e, n, dtype, o);
  });
  return out;
}

}  // namespace pagedattn

TORCH_LIBRARY_FRAGMENT(pagedattn, m) { m.def("argmax_rows(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(pagedattn, CPU, m) { m.impl("argmax_rows", &pagedattn::argmax_rows); }
