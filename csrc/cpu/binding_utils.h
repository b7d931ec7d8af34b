// Shared helpers of the binding TUs (torch headers allowed here; never include this from a
// kernels_<isa>.cpp). Every check raises a Python exception that names the offending value:
// TypeError for dtypes, NotImplementedError for hardware the CPU lacks, ValueError otherwise.
#pragma once
#include <torch/library.h>
#include <ATen/ATen.h>

#include <string>

#include "isa_generated.h"
#include "kernel_api.h"

namespace pagedattn {

// Head sizes the kernels are instantiated and tested for (all multiples of 16).
constexpr int64_t kSupportedHeadSizes[] = {32, 64, 80, 96, 112, 128, 160, 192, 224, 256};
constexpr const char* kSupportedHeadSizeList = "32, 64, 80, 96, 112, 128, 160, 192, 224, 256";
constexpr int64_t kMaxBlockSize = 256;

// ISA state (isa_dispatch.cpp).
bool cpu_isa_supported(CpuIsa isa);
CpuIsa current_cpu_isa();  // raises if PAGEDATTN_CPU_ISA named an unusable ISA
const KernelTable* current_kernels();
// Validates a hint code (range, availability on this CPU) and returns it.
IsaHint check_isa_hint(int64_t code, const char* op);

inline DType to_dtype(at::ScalarType t, const char* what) {
  switch (t) {
    case at::kFloat: return DType::kF32;
    case at::kBFloat16: return DType::kBF16;
    case at::kHalf: return DType::kF16;
    default:
      TORCH_CHECK_TYPE(false, what, " must be float32, bfloat16 or float16, got ", t);
  }
  return DType::kF32;
}

inline void check_head_size(int64_t hs, const char* what) {
  for (int64_t s : kSupportedHeadSizes)
    if (s == hs) return;
  TORCH_CHECK_VALUE(false, what, " head_size ", hs, " is not supported; supported: ",
                    kSupportedHeadSizeList);
}

inline void check_block_size(int64_t bs, IsaHint hint, const char* what) {
  TORCH_CHECK_VALUE(bs == 16 || (bs % 32 == 0 && bs > 0 && bs <= kMaxBlockSize), what,
                    " block_size ", bs, " is not supported; expected 16 or a multiple of 32 up to ",
                    kMaxBlockSize);
  const int64_t mult = isa_hint_block_multiple(static_cast<int64_t>(hint));
  TORCH_CHECK_VALUE(bs % mult == 0, what, " block_size ", bs, " does not suit isa hint '",
                    isa_hint_name(static_cast<int64_t>(hint)), "', which needs a multiple of ",
                    mult);
}

inline void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.defined(), name, " must be a tensor, got None");
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor, got device ", t.device());
}

inline void check_index_tensor(const at::Tensor& t, const char* name, at::ScalarType dt,
                               int64_t dim) {
  check_cpu(t, name);
  TORCH_CHECK_TYPE(t.scalar_type() == dt, name, " must have dtype ", dt, ", got ",
                   t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == dim, name, " must be ", dim, "-D, got shape ", t.sizes());
}

// key_cache/value_cache of one layer: CPU, 4-D [num_blocks, num_kv_heads, block_size,
// head_size], equal shapes and dtypes, a supported dtype, contiguous last dim. Shared by
// reshape_and_cache and the attention op so both raise the same messages.
inline void check_cache_pair(const at::Tensor& key_cache, const at::Tensor& value_cache) {
  check_cpu(key_cache, "key_cache");
  check_cpu(value_cache, "value_cache");
  TORCH_CHECK_VALUE(key_cache.dim() == 4, "key_cache must be 4-D [num_blocks, num_kv_heads, ",
                    "block_size, head_size], got shape ", key_cache.sizes());
  TORCH_CHECK_VALUE(value_cache.sizes() == key_cache.sizes(), "value_cache shape ",
                    value_cache.sizes(), " must equal key_cache shape ", key_cache.sizes());
  TORCH_CHECK_TYPE(value_cache.scalar_type() == key_cache.scalar_type(), "value_cache dtype ",
                   value_cache.scalar_type(), " must equal key_cache dtype ",
                   key_cache.scalar_type());
  to_dtype(key_cache.scalar_type(), "key_cache");
  for (const auto* t : {&key_cache, &value_cache})
    TORCH_CHECK_VALUE(t->size(3) <= 1 || t->stride(3) == 1, "kv cache last dim must be contiguous, ",
                      "got strides ", t->strides());
}

}  // namespace pagedattn
