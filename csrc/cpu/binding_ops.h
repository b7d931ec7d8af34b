// The binding-level entry points of the ops that other binding TUs call directly (the
// decoder stack runs a whole step through them without going back to Python). Each one
// validates its arguments as it does when called from Python.
#pragma once
#include <ATen/ATen.h>

#include <optional>

namespace pagedattn {

// layer_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    std::optional<at::ScalarType> out_dtype);
at::Tensor fused_add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                              double eps, std::optional<at::ScalarType> out_dtype);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor gelu_tanh_and_mul(const at::Tensor& x);
void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                      const at::Tensor& cos_sin_cache);

// linear_ops.cpp
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed_weight,
                         const std::optional<at::Tensor>& bias, int64_t out_features);
at::Tensor packed_gated_linear(const at::Tensor& x, const at::Tensor& packed_weight,
                               const std::optional<at::Tensor>& bias, int64_t out_features,
                               c10::string_view activation);
at::Tensor packed_linear_dpbf16(const at::Tensor& x, const at::Tensor& packed_weight,
                                const std::optional<at::Tensor>& bias, int64_t out_features,
                                std::optional<at::ScalarType> out_dtype);
at::Tensor packed_linear_amx(const at::Tensor& x, const at::Tensor& packed_weight,
                             const std::optional<at::Tensor>& bias, int64_t out_features,
                             std::optional<at::ScalarType> out_dtype);
at::Tensor packed_gated_linear_amx(const at::Tensor& x, const at::Tensor& packed_weight,
                                   const std::optional<at::Tensor>& bias, int64_t out_features,
                                   c10::string_view activation,
                                   std::optional<at::ScalarType> out_dtype);

// cache_ops.cpp, attention_ops.cpp
void cpu_attn_reshape_and_cache(const at::Tensor& key, const at::Tensor& value,
                                at::Tensor& key_cache, at::Tensor& value_cache,
                                const at::Tensor& slot_mapping, double k_scale, double v_scale);
// rotary_embedding then cpu_attn_reshape_and_cache in one pass over the tokens, the same
// arithmetic in the same order (so the same bits), for the decoder stack, which checks the
// arguments once per step: query [T, H, D] and key/value [T, KVH, D] (float32 or bfloat16,
// last dim contiguous, key's dtype the query's and the cache's unless the cache is fp8),
// positions[T] rows of cos_sin ([P, D] float32, contiguous), slots[n] (n <= T) in the
// cache or negative.
void rotate_and_cache_unchecked(const int64_t* positions, const float* cos_sin, at::Tensor& query,
                                at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                                at::Tensor& value_cache, const int64_t* slots, int64_t n,
                                double k_scale, double v_scale);
void cpu_attention_with_kv_cache(const at::Tensor& query, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache, at::Tensor& output,
                                 const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                                 double scale, bool causal,
                                 const std::optional<at::Tensor>& alibi_slopes,
                                 int64_t sliding_window_left, int64_t sliding_window_right,
                                 const at::Tensor& block_table, double softcap,
                                 const at::Tensor& scheduler_metadata,
                                 const std::optional<at::Tensor>& s_aux, double k_scale,
                                 double v_scale);

}  // namespace pagedattn
