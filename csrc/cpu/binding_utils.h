// Shared helpers of the binding TUs (torch headers allowed here; never include this from a
// kernels_<isa>.cpp). Every check raises a Python exception that names the offending value:
// TypeError for dtypes, NotImplementedError for hardware the CPU lacks, ValueError otherwise.
#pragma once
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cmath>
#include <string>

#include "isa_generated.h"
#include "kernel_api.h"
#include "kernel_shapes_generated.h"

namespace pagedattn {

// ISA state (isa_dispatch.cpp).
bool cpu_isa_supported(CpuIsa isa);
CpuIsa current_cpu_isa();  // raises if PAGEDATTN_CPU_ISA named an unusable ISA
const KernelTable* current_kernels();
// Validates a hint code (range, availability on this CPU) and returns it.
IsaHint check_isa_hint(int64_t code, const char* op);
// The brgemm microkernels (matrix_engine.cpp), or nullptr where torch's brgemm does not
// run; each thread that used them calls matrix_engine_release() at the end of its region.
const MatrixEngine* matrix_engine();
void matrix_engine_release();
// The cost probe (matrix_engine_profile op): whether it is on, a worker's busy time added
// to its totals, and the clock it uses.
bool matrix_engine_profiling();
void matrix_engine_add_busy(int64_t ns);
int64_t matrix_engine_clock_ns();

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

// Head and block sizes: kernel_shapes_generated.h (from pagedattn/ops/kernel_shapes.py).
// A KV cache's dtype: the query dtype, or an fp8 format (fp8 caches take any query dtype).
inline DType to_cache_dtype(at::ScalarType t, const char* what) {
  if (t == at::kFloat8_e4m3fn) return DType::kFp8E4m3;
  if (t == at::kFloat8_e5m2) return DType::kFp8E5m2;
  TORCH_CHECK_TYPE(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, what,
                   " must be float32, bfloat16, float16, float8_e4m3fn or float8_e5m2, got ", t);
  return to_dtype(t, what);
}

inline bool is_fp8(DType t) { return t == DType::kFp8E4m3 || t == DType::kFp8E5m2; }

// Per-tensor fp8 scale (dequantised value = stored value * scale).
inline void check_kv_scale(double s, const char* name) {
  TORCH_CHECK_VALUE(std::isfinite(s) && s > 0, name, " must be a finite positive number, got ", s);
}

inline void check_head_size(int64_t hs, const char* what) {
  TORCH_CHECK_VALUE(is_supported_head_size(hs), what, " head_size ", hs,
                    " is not supported; expected ", kHeadSizeRule);
}

// The kernels read the block size from the cache tensor and run every supported one under
// any hint; which sizes vLLM's hint strings admit is the public wrappers' contract
// (pagedattn.ops), not the kernels'.
inline void check_block_size(int64_t bs, const char* what) {
  TORCH_CHECK_VALUE(is_supported_block_size(bs), what, " block_size ", bs,
                    " is not supported; expected ", kBlockSizeRule);
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
  to_cache_dtype(key_cache.scalar_type(), "key_cache");
  for (const auto* t : {&key_cache, &value_cache})
    TORCH_CHECK_VALUE(t->size(3) <= 1 || t->stride(3) == 1, "kv cache last dim must be contiguous, ",
                      "got strides ", t->strides());
}

}  // namespace pagedattn
