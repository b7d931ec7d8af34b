// One engine step of a decoder (every layer, then the final norm) in one op, in the layer
// shape of the Llama family or of Gemma 3.
// The Python layer loop spends a decode step's time between kernels: an interpreter frame,
// a dispatcher call and allocations per op, dozens of ops per layer, while the second
// thread spins waiting for the next parallel region. Here the same ops run back to back:
// the same kernels, called through their binding entry points in the same order with the
// same arguments (rotary and the cache write through one unchecked pass, on arguments
// checked once per step), so the result is bit for bit the Python loop's
// (pagedattn/models/llama.py: LlamaDecoderLayer.forward; pagedattn/models/gemma3.py:
// Gemma3DecoderLayer.forward; MeasuredLinear's paths).
// The caller (pagedattn/models/native_stack.py) decides per step whether a model and a
// step can run here and resolves each linear layer's path for the step's row count.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "binding_ops.h"
#include "binding_utils.h"

namespace pagedattn {

namespace {

// The linear paths of pagedattn/models/linear_paths.py (LinearPath), plus the packed
// path's fused gate/up projection with the MLP's activation.
enum class LinearPath : int64_t {
  kPacked = 0,
  kDpbf16 = 1,
  kTorch = 2,
  kOnednn = 3,
  kPackedGated = 4,
  kAmx = 5,
  kAmxGated = 6,
};
constexpr int64_t kLinearPaths = 7;
constexpr int64_t kLinearsPerLayer = 4;  // qkv, o, gate_up, down

// The layer shapes: Llama's (input and post-attention norms, SiLU) and Gemma 3's (norms on
// q and k, norms before and after the attention and the MLP blocks, GELU-tanh).
struct Style {
  int64_t norms_per_layer;
  const char* activation;  // packed_gated_linear's name for it
  at::Tensor (*act_and_mul)(const at::Tensor&);
  bool gemma;
};
Style parse_style(c10::string_view name) {
  if (name == "llama") return {2, "silu", &silu_and_mul, false};
  if (name == "gemma3") return {6, "gelu_tanh", &gelu_tanh_and_mul, true};
  TORCH_CHECK_VALUE(false, "style must be 'llama' or 'gemma3', got '", std::string(name), "'");
  return {};
}

// torch's prepacked oneDNN linear (pagedattn/ops/onednn.py), called boxed: its C++
// signature is private to torch.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed_weight) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  c10::List<std::optional<at::Scalar>> scalars;
  scalars.push_back(std::nullopt);
  std::vector<c10::IValue> stack{x, packed_weight, c10::IValue(), std::string("none"),
                                 scalars, std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// A half-precision GEMM's output with its fp32 bias added in fp32, in out_dtype.
at::Tensor half_gemm_out(const at::Tensor& out, const std::optional<at::Tensor>& bias,
                         at::ScalarType out_dtype) {
  if (!bias.has_value()) return out.to(out_dtype);
  return out.to(at::kFloat).add_(*bias).to(out_dtype);
}

struct LinearLayer {
  LinearPath path;
  at::Tensor weight;
  std::optional<at::Tensor> bias;
  int64_t out_features;
};

// MeasuredLinear's paths, as pagedattn/models/linear_paths.py runs them.
at::Tensor run_linear(const LinearLayer& l, at::Tensor x, at::ScalarType act_dtype,
                      const Style& style) {
  if (x.scalar_type() != act_dtype) x = x.to(act_dtype);
  const at::Tensor& w = l.weight;
  switch (l.path) {
    case LinearPath::kPacked:
      return packed_linear(x.to(at::kFloat), w, l.bias, l.out_features).to(act_dtype);
    case LinearPath::kDpbf16:
      return packed_linear_dpbf16(x, w, l.bias, l.out_features, act_dtype);
    case LinearPath::kAmx:
      return packed_linear_amx(x, w, l.bias, l.out_features, act_dtype);
    case LinearPath::kTorch:
      if (w.scalar_type() == at::kFloat) return at::linear(x, w, l.bias);
      return half_gemm_out(at::linear(x.to(w.scalar_type()), w), l.bias, act_dtype);
    case LinearPath::kOnednn: {
      at::Tensor out = onednn_linear(x.to(w.scalar_type()), w);
      if (w.scalar_type() == at::kFloat) return l.bias.has_value() ? out.add_(*l.bias) : out;
      return half_gemm_out(out, l.bias, act_dtype);
    }
    case LinearPath::kPackedGated:
      return packed_gated_linear(x.to(at::kFloat), w, l.bias, l.out_features, style.activation)
          .to(act_dtype);
    case LinearPath::kAmxGated:
      return packed_gated_linear_amx(x, w, l.bias, l.out_features, style.activation, act_dtype);
  }
  TORCH_CHECK(false, "unreachable linear path");
}

// The gated MLP's act(gate) * up: one kernel on the fused packed path, else the layer's
// path, then the activation.
at::Tensor gated_mlp(const LinearLayer& l, const at::Tensor& x, at::ScalarType act_dtype,
                     const Style& style) {
  if (l.path == LinearPath::kPackedGated || l.path == LinearPath::kAmxGated)
    return run_linear(l, x, act_dtype, style);
  return style.act_and_mul(run_linear(l, x, act_dtype, style));
}

// Gemma's per-head norm: [T, heads * D] (a view into the QKV output) -> [T, heads, D].
at::Tensor head_norm(const at::Tensor& x, int64_t tokens, int64_t heads, int64_t head_size,
                     const at::Tensor& weight, double eps, at::ScalarType act_dtype) {
  return rms_norm(x.reshape({tokens * heads, head_size}).contiguous(), weight, eps, act_dtype)
      .view({tokens, heads, head_size});
}

}  // namespace

at::Tensor decoder_stack(
    c10::string_view style_name, at::Tensor& x, const at::Tensor& positions, at::TensorList cos_sin,
    at::TensorList norm_weights, const c10::List<std::optional<at::Tensor>>& linear_weights,
    const c10::List<std::optional<at::Tensor>>& linear_biases, at::IntArrayRef linear_paths,
    at::IntArrayRef linear_out_features, at::TensorList kv_caches, const at::Tensor& slot_mapping,
    const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_table,
    const at::Tensor& scheduler_metadata, bool causal, at::ArrayRef<double> attn_scalars,
    at::IntArrayRef windows, const std::optional<at::Tensor>& output_rows,
    int64_t num_heads, int64_t num_kv_heads, double eps, at::ScalarType act_dtype,
    std::optional<at::ScalarType> attn_dtype) {
  const Style style = parse_style(style_name);
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK_VALUE(layers > 0, "kv_caches must hold one cache per layer, got none");
  const auto expect_len = [layers](size_t got, int64_t per_layer, int64_t extra,
                                   const char* name) {
    TORCH_CHECK_VALUE(static_cast<int64_t>(got) == layers * per_layer + extra, name, " must hold ",
                      per_layer, " entries per layer", extra ? " plus one" : "", " (",
                      layers * per_layer + extra, " for ", layers, " layers), got ", got);
  };
  expect_len(norm_weights.size(), style.norms_per_layer, 1, "norm_weights");
  expect_len(cos_sin.size(), 1, 0, "cos_sin");
  expect_len(linear_weights.size(), kLinearsPerLayer, 0, "linear_weights");
  expect_len(linear_biases.size(), kLinearsPerLayer, 0, "linear_biases");
  expect_len(linear_paths.size(), kLinearsPerLayer, 0, "linear_paths");
  expect_len(attn_scalars.size(), 4, 0, "attn_scalars (scale, softcap, k_scale, v_scale)");
  expect_len(windows.size(), 2, 0, "windows (left, right)");
  TORCH_CHECK_VALUE(static_cast<int64_t>(linear_out_features.size()) == kLinearsPerLayer,
                    "linear_out_features must hold ", kLinearsPerLayer,
                    " widths (qkv, o, gate_up, down), got ", linear_out_features.size());
  for (size_t i = 0; i < linear_paths.size(); ++i) {
    TORCH_CHECK_VALUE(linear_paths[i] >= 0 && linear_paths[i] < kLinearPaths, "linear_paths[",
                      i, "] (", linear_paths[i], ") is not a linear path code in [0, ",
                      kLinearPaths, ")");
    TORCH_CHECK_VALUE(linear_weights.get(i).has_value(), "linear_weights[", i,
                      "] is None: its path reads a weight");
    const bool fused = linear_paths[i] == static_cast<int64_t>(LinearPath::kPackedGated) ||
                       linear_paths[i] == static_cast<int64_t>(LinearPath::kAmxGated);
    TORCH_CHECK_VALUE(!fused || i % kLinearsPerLayer == 2,
                      "linear_paths[", i, "]: only the gate/up projection takes the fused path");
  }
  TORCH_CHECK_TYPE(act_dtype == at::kFloat || act_dtype == at::kBFloat16,
                   "act_dtype must be float32 or bfloat16, got ", act_dtype);
  const at::ScalarType attn_type = attn_dtype.value_or(act_dtype);
  for (const at::Tensor& table : cos_sin)
    TORCH_CHECK_VALUE(table.dim() == 2 && table.size(1) == cos_sin[0].size(1),
                      "every cos_sin table must be 2-D [max_positions, head_size] with one "
                      "head size, got shapes ", table.sizes(), " and ", cos_sin[0].sizes());
  TORCH_CHECK_VALUE(num_heads > 0 && num_kv_heads > 0, "num_heads and num_kv_heads must be "
                    "positive, got ", num_heads, " and ", num_kv_heads);
  const int64_t head_size = cos_sin[0].size(1);
  const int64_t q_size = num_heads * head_size, kv_size = num_kv_heads * head_size;
  TORCH_CHECK_VALUE(linear_out_features[0] == q_size + 2 * kv_size, "the qkv projection's width (",
                    linear_out_features[0], ") must be (num_heads + 2 * num_kv_heads) * head_size = ",
                    q_size + 2 * kv_size);
  check_cpu(x, "x");
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be 2-D [num_tokens, hidden], got shape ", x.sizes());
  const int64_t tokens = x.size(0);
  if (output_rows.has_value()) check_index_tensor(*output_rows, "output_rows", at::kLong, 1);

  // Rotary and the cache write run fused, on arguments checked here once for the step,
  // where the attention takes the activations' dtype; else through their ops, per layer.
  const bool fused_rotary_cache = attn_type == act_dtype;
  at::Tensor positions_c, slots_c;
  if (fused_rotary_cache) {
    check_index_tensor(positions, "positions", at::kLong, 1);
    TORCH_CHECK_VALUE(positions.size(0) == tokens, "positions must hold one entry per token (",
                      tokens, "), got ", positions.size(0));
    check_index_tensor(slot_mapping, "slot_mapping", at::kLong, 1);
    TORCH_CHECK_VALUE(slot_mapping.size(0) <= tokens, "slot_mapping has ", slot_mapping.size(0),
                      " entries but there are only ", tokens, " tokens");
    positions_c = positions.contiguous();
    slots_c = slot_mapping.contiguous();
    const int64_t* pos = positions_c.data_ptr<int64_t>();
    const int64_t* slot = slots_c.data_ptr<int64_t>();
    for (size_t i = 0; i < cos_sin.size(); ++i) {
      const at::Tensor& table = cos_sin[i];
      check_cpu(table, "cos_sin");
      TORCH_CHECK_TYPE(table.scalar_type() == at::kFloat, "cos_sin tables must be float32, got ",
                       table.scalar_type());
      TORCH_CHECK_VALUE(head_size % 2 == 0 && table.is_contiguous(), "cos_sin tables must be "
                        "contiguous [max_positions, head_size] with an even head size, got shape ",
                        table.sizes());
      for (int64_t t = 0; t < tokens; ++t)
        TORCH_CHECK_VALUE(pos[t] >= 0 && pos[t] < table.size(0), "positions[", t, "] (", pos[t],
                          ") is outside cos_sin[", i, "]'s [0, ", table.size(0), ")");
    }
    for (int64_t layer = 0; layer < layers; ++layer) {
      const at::Tensor& kv = kv_caches[layer];
      TORCH_CHECK_VALUE(kv.dim() == 5 && kv.size(0) == 2, "kv_caches[", layer, "] must be [2, "
                        "num_blocks, num_kv_heads, block_size, head_size], got shape ", kv.sizes());
      const at::Tensor key_cache = kv.select(0, 0), value_cache = kv.select(0, 1);
      check_cache_pair(key_cache, value_cache);
      const DType cache_dt = to_cache_dtype(key_cache.scalar_type(), "key_cache");
      TORCH_CHECK_TYPE(key_cache.scalar_type() == act_dtype || is_fp8(cache_dt), "kv_caches[",
                       layer, "] dtype ", key_cache.scalar_type(), " must be the activations' (",
                       act_dtype, ") or an fp8 format");
      TORCH_CHECK_VALUE(key_cache.size(1) == num_kv_heads && key_cache.size(3) == head_size,
                        "kv_caches[", layer, "] shape ", kv.sizes(), " does not match num_kv_heads ",
                        num_kv_heads, " and head_size ", head_size);
      check_block_size(key_cache.size(2), "kv cache");
      check_kv_scale(attn_scalars[layer * 4 + 2], "k_scale");
      check_kv_scale(attn_scalars[layer * 4 + 3], "v_scale");
      const int64_t capacity = key_cache.size(0) * key_cache.size(2);
      for (int64_t i = 0; i < slot_mapping.size(0); ++i)
        TORCH_CHECK_VALUE(slot[i] < capacity, "slot_mapping[", i, "] (", slot[i], ") is out of "
                          "range for kv_caches[", layer, "] of ", capacity,
                          " slots (negative = padding)");
    }
  }

  std::vector<LinearLayer> linears;
  linears.reserve(linear_paths.size());
  for (size_t i = 0; i < linear_paths.size(); ++i)
    linears.push_back({static_cast<LinearPath>(linear_paths[i]), *linear_weights.get(i),
                       linear_biases.get(i), linear_out_features[i % kLinearsPerLayer]});
  const auto linear = [&](int64_t layer, int64_t which) -> const LinearLayer& {
    return linears[layer * kLinearsPerLayer + which];
  };

  at::Tensor hidden = x, residual, normed;
  for (int64_t layer = 0; layer < layers; ++layer) {
    // Llama: input, post-attention. Gemma 3: input, q, k, post-attention, pre- and
    // post-feedforward.
    const at::Tensor* norm = &norm_weights[layer * style.norms_per_layer];
    if (layer == 0) {
      normed = rms_norm(hidden, norm[0], eps, act_dtype);
      residual = hidden;
    } else {
      normed = fused_add_rms_norm(hidden, residual, norm[0], eps, act_dtype);
    }
    const at::Tensor qkv = run_linear(linear(layer, 0), normed, act_dtype, style);
    at::Tensor q = qkv.narrow(1, 0, q_size);
    at::Tensor k = qkv.narrow(1, q_size, kv_size);
    if (style.gemma) {
      q = head_norm(q, tokens, num_heads, head_size, norm[1], eps, act_dtype);
      k = head_norm(k, tokens, num_kv_heads, head_size, norm[2], eps, act_dtype);
    } else {
      q = q.view({tokens, num_heads, head_size});
      k = k.view({tokens, num_kv_heads, head_size});
    }
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size)
                             .reshape({tokens, num_kv_heads, head_size});
    const double* s = &attn_scalars[layer * 4];  // scale, softcap, k_scale, v_scale
    at::Tensor key_cache = kv_caches[layer].select(0, 0);
    at::Tensor value_cache = kv_caches[layer].select(0, 1);
    at::Tensor qa = q;
    if (fused_rotary_cache) {
      rotate_and_cache_unchecked(positions_c.data_ptr<int64_t>(), cos_sin[layer].data_ptr<float>(),
                                 q, k, v, key_cache, value_cache, slots_c.data_ptr<int64_t>(),
                                 slots_c.size(0), s[2], s[3]);
    } else {
      rotary_embedding(positions, q, k, cos_sin[layer]);
      // attention in its own dtype (bf16 attention under fp32 activations)
      qa = q.to(attn_type);
      cpu_attn_reshape_and_cache(k.to(attn_type), v.to(attn_type), key_cache, value_cache,
                                 slot_mapping, s[2], s[3]);
    }
    at::Tensor attn = at::empty({tokens, num_heads, head_size}, qa.options());
    cpu_attention_with_kv_cache(qa, key_cache, value_cache, attn, query_start_loc, seq_lens, s[0],
                                causal, std::nullopt, windows[layer * 2], windows[layer * 2 + 1],
                                block_table, s[1], scheduler_metadata, std::nullopt, s[2], s[3]);
    attn = attn.to(act_dtype).view({tokens, q_size});
    if (layer == layers - 1 && output_rows.has_value()) {
      // Every row's keys and values are cached by now; only the sampled rows go on.
      attn = attn.index_select(0, *output_rows);
      residual = residual.index_select(0, *output_rows);
    }
    const at::Tensor o = run_linear(linear(layer, 1), attn, act_dtype, style);
    if (style.gemma) {
      normed = fused_add_rms_norm(rms_norm(o, norm[3], eps, act_dtype), residual, norm[4], eps,
                                  act_dtype);
    } else {
      normed = fused_add_rms_norm(o, residual, norm[1], eps, act_dtype);
    }
    hidden = run_linear(linear(layer, 3), gated_mlp(linear(layer, 2), normed, act_dtype, style),
                        act_dtype, style);
    if (style.gemma) hidden = rms_norm(hidden, norm[5], eps, act_dtype);
  }
  return fused_add_rms_norm(hidden, residual, norm_weights.back(), eps, act_dtype);
}

}  // namespace pagedattn

TORCH_LIBRARY_FRAGMENT(pagedattn, m) {
  m.def(
      "decoder_stack(str style, Tensor(b!) x, Tensor positions, Tensor[] cos_sin, "
      "Tensor[] norm_weights, "
      "Tensor?[] linear_weights, Tensor?[] linear_biases, int[] linear_paths, "
      "int[] linear_out_features, Tensor(a!)[] kv_caches, Tensor slot_mapping, "
      "Tensor query_start_loc, Tensor seq_lens, Tensor block_table, Tensor scheduler_metadata, "
      "bool causal, float[] attn_scalars, int[] windows, Tensor? output_rows, int num_heads, "
      "int num_kv_heads, float eps, ScalarType act_dtype, ScalarType? attn_dtype=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedattn, CPU, m) {
  m.impl("decoder_stack", &pagedattn::decoder_stack);
}

// oneDNN's prepacked weights are MkldnnCPU tensors, which select this key.
TORCH_LIBRARY_IMPL(pagedattn, MkldnnCPU, m) {
  m.impl("decoder_stack", &pagedattn::decoder_stack);
}
