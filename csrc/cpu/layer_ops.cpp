// A transformer layer's elementwise steps as single ops (fp32 or bf16 activations, fp32
// arithmetic, an fp32 residual stream): rms_norm, fused_add_rms_norm, silu_and_mul and
// gelu_tanh_and_mul (vectorised row kernels, layer_kernel_impl.h) and the rotate-half rotary
// embedding, in place. Validation here, unchecked loops below it.
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "binding_utils.h"
#include "work_pool.h"

namespace pagedattn {

namespace {
// Rows per parallel chunk: at least 64k elements (twice torch's grain for elementwise loops),
// so a decode step's rows stay on the calling thread. Forking for a few microseconds of
// work costs more than it saves, and every fork/join is a point where a step waits for a
// thread that a busy neighbour has descheduled.
constexpr int64_t kMinChunkElements = 65536;

int64_t row_grain(int64_t row_elements) {
  return std::max<int64_t>(1, kMinChunkElements / std::max<int64_t>(1, row_elements));
}

DType activation_dtype(at::ScalarType t, const char* name) {
  TORCH_CHECK_TYPE(t == at::kFloat || t == at::kBFloat16, name,
                   " must be float32 or bfloat16, got ", t);
  return t == at::kFloat ? DType::kF32 : DType::kBF16;
}

void check_rows(const at::Tensor& t, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK_VALUE(t.dim() == 2, name, " must be 2-D [num_tokens, hidden], got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.size(1) <= 1 || t.stride(1) == 1, name,
                    " last dim must be contiguous, got strides ", t.strides());
}

void check_norm_weight(const at::Tensor& weight, int64_t d, double eps) {
  check_cpu(weight, "weight");
  TORCH_CHECK_TYPE(weight.scalar_type() == at::kFloat, "weight must be float32, got ",
                   weight.scalar_type());
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == d, "weight must be [", d,
                    "], got shape ", weight.sizes());
  TORCH_CHECK_VALUE(weight.is_contiguous(), "weight must be contiguous");
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0, "eps must be a finite number >= 0, got ", eps);
}

at::Tensor run_norm(const at::Tensor& x, float* residual, int64_t residual_stride,
                    const at::Tensor& weight, double eps, std::optional<at::ScalarType> out_dtype) {
  const at::ScalarType out_type = out_dtype.value_or(x.scalar_type());
  const DType o_dtype = activation_dtype(out_type, "out_dtype");
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(out_type));
  const NormParams p{x.data_ptr(), x.stride(0), residual, residual_stride,
                     weight.data_ptr<float>(), static_cast<float>(eps), out.data_ptr(),
                     out.size(1), x.size(1), activation_dtype(x.scalar_type(), "x"), o_dtype};
  const KernelTable* kt = current_kernels();
  pool_parallel_for(0, x.size(0), row_grain(x.size(1)),
                   [&](int64_t b, int64_t e) { kt->rms_norm_rows(p, b, e); });
  return out;
}
}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    std::optional<at::ScalarType> out_dtype) {
  check_rows(x, "x");
  activation_dtype(x.scalar_type(), "x");
  check_norm_weight(weight, x.size(1), eps);
  return run_norm(x, nullptr, 0, weight, eps, out_dtype);
}

at::Tensor fused_add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                              double eps, std::optional<at::ScalarType> out_dtype) {
  check_rows(x, "x");
  activation_dtype(x.scalar_type(), "x");
  check_rows(residual, "residual");
  TORCH_CHECK_TYPE(residual.scalar_type() == at::kFloat, "residual must be float32, got ",
                   residual.scalar_type());
  TORCH_CHECK_VALUE(residual.sizes() == x.sizes(), "residual shape ", residual.sizes(),
                    " must equal x shape ", x.sizes());
  TORCH_CHECK_VALUE(x.numel() == 0 || at::has_internal_overlap(residual) != at::MemOverlap::Yes,
                    "residual must not overlap itself (it is updated in place)");
  check_norm_weight(weight, x.size(1), eps);
  return run_norm(x, residual.data_ptr<float>(), residual.stride(0), weight, eps, out_dtype);
}

namespace {
at::Tensor act_and_mul(const at::Tensor& x, GatedActivation act) {
  check_rows(x, "x");
  const DType dtype = activation_dtype(x.scalar_type(), "x");
  TORCH_CHECK_VALUE(x.size(1) % 2 == 0, "x must have an even last dim [num_tokens, 2 * d], got ",
                    x.size(1));
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  at::Tensor out = at::empty({rows, d}, x.options());
  const KernelTable* kt = current_kernels();
  const void* xp = x.data_ptr();
  void* op = out.data_ptr();
  pool_parallel_for(0, rows, row_grain(d), [&](int64_t b, int64_t e) {
    kt->act_mul_rows(act, xp, x.stride(0), op, d, b, e, d, dtype);
  });
  return out;
}
}  // namespace

at::Tensor silu_and_mul(const at::Tensor& x) { return act_and_mul(x, GatedActivation::kSilu); }

at::Tensor gelu_tanh_and_mul(const at::Tensor& x) {
  return act_and_mul(x, GatedActivation::kGeluTanh);
}

namespace {
void check_rotary_input(const at::Tensor& t, const char* name, int64_t tokens, int64_t head_size) {
  check_cpu(t, name);
  activation_dtype(t.scalar_type(), name);
  TORCH_CHECK_VALUE(t.dim() == 3 && t.size(0) == tokens && t.size(2) == head_size, name,
                    " must be [", tokens, ", num_heads, ", head_size, "], got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.stride(2) == 1, name, " last dim must be contiguous, got strides ",
                    t.strides());
  TORCH_CHECK_VALUE(t.numel() == 0 || at::has_internal_overlap(t) != at::MemOverlap::Yes, name,
                    " must not overlap itself (it is rotated in place)");
}

// Each token's heads at its position, on the ISA's vector kernel (rotate_heads in
// layer_kernel_impl.h: Hugging Face's arithmetic term for term, no fused multiply-add).
void rotate_tokens(const int64_t* pos, at::Tensor& query, at::Tensor& key, const float* table,
                   int64_t head_size) {
  const int64_t half = head_size / 2;
  const DType dtype = activation_dtype(query.scalar_type(), "query");
  const size_t elem = query.element_size();
  char* q = static_cast<char*>(query.data_ptr());
  char* k = static_cast<char*>(key.data_ptr());
  const KernelTable* kt = current_kernels();
  pool_parallel_for(0, query.size(0),
                   row_grain((query.size(1) + key.size(1)) * head_size), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* cos = table + pos[t] * head_size;
      kt->rotate_heads(q + t * query.stride(0) * elem, dtype, query.size(1), query.stride(1),
                       cos, cos + half, half);
      kt->rotate_heads(k + t * key.stride(0) * elem, dtype, key.size(1), key.stride(1), cos,
                       cos + half, half);
    }
  });
}
}  // namespace

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                      const at::Tensor& cos_sin_cache) {
  check_index_tensor(positions, "positions", at::kLong, 1);
  check_cpu(cos_sin_cache, "cos_sin_cache");
  TORCH_CHECK_TYPE(cos_sin_cache.scalar_type() == at::kFloat, "cos_sin_cache must be float32, got ",
                   cos_sin_cache.scalar_type());
  TORCH_CHECK_VALUE(cos_sin_cache.dim() == 2 && cos_sin_cache.size(1) % 2 == 0 &&
                        cos_sin_cache.size(1) > 0 && cos_sin_cache.is_contiguous(),
                    "cos_sin_cache must be contiguous [max_positions, head_size] (cos then sin "
                    "halves), got shape ", cos_sin_cache.sizes());
  const int64_t tokens = positions.size(0), head_size = cos_sin_cache.size(1);
  const int64_t max_pos = cos_sin_cache.size(0);
  check_rotary_input(query, "query", tokens, head_size);
  check_rotary_input(key, "key", tokens, head_size);
  const at::Tensor pos_c = positions.contiguous();
  const int64_t* pos = pos_c.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK_VALUE(pos[t] >= 0 && pos[t] < max_pos, "positions[", t, "] (", pos[t],
                      ") is outside the cos_sin_cache's [0, ", max_pos, ")");
  TORCH_CHECK_TYPE(key.scalar_type() == query.scalar_type(), "key dtype ", key.scalar_type(),
                   " must equal query dtype ", query.scalar_type());
  const float* table = cos_sin_cache.data_ptr<float>();
  rotate_tokens(pos, query, key, table, head_size);
}

}  // namespace pagedattn

TORCH_LIBRARY_FRAGMENT(pagedattn, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, ScalarType? out_dtype=None) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps, "
        "ScalarType? out_dtype=None) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor x) -> Tensor");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, "
        "Tensor cos_sin_cache) -> ()");
}

TORCH_LIBRARY_IMPL(pagedattn, CPU, m) {
  m.impl("rms_norm", &pagedattn::rms_norm);
  m.impl("fused_add_rms_norm", &pagedattn::fused_add_rms_norm);
  m.impl("silu_and_mul", &pagedattn::silu_and_mul);
  m.impl("gelu_tanh_and_mul", &pagedattn::gelu_tanh_and_mul);
  m.impl("rotary_embedding", &pagedattn::rotary_embedding);
}
