// Row kernels of a transformer layer's elementwise steps (computed in fp32; activations
// stored in fp32 or bf16): RMSNorm (optionally after a
// residual add) and SiLU-and-mul. One fused pass per row instead of torch's chain of ~8
// ops each allocating a tensor: a decode step runs them ~90 times per token.
//
// Included inside an anonymous namespace of an ISA TU, after that ISA's vector struct.

// Element access in fp32 whatever the storage (fp32, or bf16 rounded to nearest even on
// store), so one kernel body serves both activation dtypes.
template <class VT>
inline typename VT::V load_f32(const float* p) { return VT::load(p); }
template <class VT>
inline typename VT::V load_f32(const bf16_t* p) { return VT::cvt_load(p); }
template <class VT>
inline void store_f32(float* p, typename VT::V v) { VT::store(p, v); }
template <class VT>
inline void store_f32(bf16_t* p, typename VT::V v) { VT::cvt_store(p, v); }
inline float scalar_f32(float x) { return x; }
inline float scalar_f32(bf16_t x) { return bf16_to_float(x.bits); }
inline void scalar_store(float* p, float v) { *p = v; }
inline void scalar_store(bf16_t* p, float v) { p->bits = float_to_bf16(v); }

template <class VT, class T>
inline float sum_of_squares(const T* x, int64_t d) {
  using V = typename VT::V;
  V acc0 = VT::zero(), acc1 = VT::zero();
  int64_t i = 0;
  for (; i + 2 * VT::W <= d; i += 2 * VT::W) {
    const V a = load_f32<VT>(x + i), b = load_f32<VT>(x + i + VT::W);
    acc0 = VT::fma(a, a, acc0);
    acc1 = VT::fma(b, b, acc1);
  }
  for (; i + VT::W <= d; i += VT::W) {
    const V a = load_f32<VT>(x + i);
    acc0 = VT::fma(a, a, acc0);
  }
  float s = VT::hsum(VT::add(acc0, acc1));
  for (; i < d; ++i) s += scalar_f32(x[i]) * scalar_f32(x[i]);
  return s;
}

// out = (x * (1 / sqrt(mean(x^2) + eps))) * weight, the product order of Hugging Face's
// Llama RMSNorm in fp32 (rounded once, on store, when out is bf16).
template <class VT, class XT, class OT>
inline void rms_norm_row(const XT* x, const float* w, float eps, OT* out, int64_t d) {
  using V = typename VT::V;
  const float inv = 1.f / std::sqrt(sum_of_squares<VT>(x, d) / static_cast<float>(d) + eps);
  const V vinv = VT::set1(inv);
  int64_t i = 0;
  for (; i + VT::W <= d; i += VT::W)
    store_f32<VT>(out + i, VT::mul(VT::mul(load_f32<VT>(x + i), vinv), VT::load(w + i)));
  for (; i < d; ++i) scalar_store(out + i, (scalar_f32(x[i]) * inv) * w[i]);
}

template <class VT, class XT, class OT>
void rms_norm_rows_typed(const NormParams& p, int64_t row_begin, int64_t row_end) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    const XT* x = static_cast<const XT*>(p.x) + r * p.x_stride;
    OT* out = static_cast<OT*>(p.out) + r * p.out_stride;
    if (p.residual == nullptr) {
      rms_norm_row<VT>(x, p.weight, p.eps, out, p.d);
      continue;
    }
    float* res = p.residual + r * p.residual_stride;
    int64_t i = 0;
    for (; i + VT::W <= p.d; i += VT::W)
      VT::store(res + i, VT::add(VT::load(res + i), load_f32<VT>(x + i)));
    for (; i < p.d; ++i) res[i] += scalar_f32(x[i]);
    rms_norm_row<VT>(static_cast<const float*>(res), p.weight, p.eps, out, p.d);
  }
}

template <class VT>
void rms_norm_rows_entry(const NormParams& p, int64_t row_begin, int64_t row_end) {
  const bool x16 = p.x_dtype == DType::kBF16, o16 = p.out_dtype == DType::kBF16;
  if (x16 && o16) return rms_norm_rows_typed<VT, bf16_t, bf16_t>(p, row_begin, row_end);
  if (x16) return rms_norm_rows_typed<VT, bf16_t, float>(p, row_begin, row_end);
  if (o16) return rms_norm_rows_typed<VT, float, bf16_t>(p, row_begin, row_end);
  rms_norm_rows_typed<VT, float, float>(p, row_begin, row_end);
}

// out[:, i] = act(x[:, i]) * x[:, d + i], both activations a logistic gate a / (1 + exp(-z)):
// silu z = a; gelu_tanh z = 2 sqrt(2/pi) (a + 0.044715 a^3), since 0.5 (1 + tanh(u)) is
// 1 / (1 + exp(-2u)). The clamped exp keeps both finite at +-inf arguments.
constexpr float kGeluTanhScale = 1.5957691216057308f;  // 2 * sqrt(2 / pi)
constexpr float kGeluTanhCubic = 0.044715f;

// act(g) * u, lane by lane.
template <class VT>
inline typename VT::V gated_product(GatedActivation act, typename VT::V g, typename VT::V u) {
  const auto z = act == GatedActivation::kGeluTanh
                     ? VT::mul(VT::set1(-kGeluTanhScale),
                               VT::fma(VT::mul(VT::set1(kGeluTanhCubic), g), VT::mul(g, g), g))
                     : VT::mul(g, VT::set1(-1.f));
  return VT::mul(VT::div(g, VT::add(VT::set1(1.f), VT::exp(z))), u);
}

template <class VT, class T>
void act_mul_rows_typed(GatedActivation act, const T* x, int64_t x_stride, T* out,
                        int64_t out_stride, int64_t row_begin, int64_t row_end, int64_t d) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    const T* gate = x + r * x_stride;
    const T* up = gate + d;
    T* o = out + r * out_stride;
    int64_t i = 0;
    for (; i + VT::W <= d; i += VT::W)
      store_f32<VT>(o + i, gated_product<VT>(act, load_f32<VT>(gate + i), load_f32<VT>(up + i)));
    for (; i < d; ++i)
      scalar_store(o + i, gated_product<VecScalar>(act, scalar_f32(gate[i]), scalar_f32(up[i])));
  }
}

template <class VT>
void act_mul_rows_entry(GatedActivation act, const void* x, int64_t x_stride, void* out,
                        int64_t out_stride, int64_t row_begin, int64_t row_end, int64_t d,
                        DType dtype) {
  if (dtype == DType::kBF16)
    return act_mul_rows_typed<VT>(act, static_cast<const bf16_t*>(x), x_stride,
                                  static_cast<bf16_t*>(out), out_stride, row_begin, row_end, d);
  act_mul_rows_typed<VT>(act, static_cast<const float*>(x), x_stride, static_cast<float*>(out),
                         out_stride, row_begin, row_end, d);
}

template <class VT, class T>
void act_mul_f32_rows_typed(GatedActivation act, const float* gate, const float* up,
                            int64_t stride, int64_t rows, int64_t n, T* out, int64_t out_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate + r * stride;
    const float* u = up + r * stride;
    T* o = out + r * out_stride;
    int64_t i = 0;
    for (; i + VT::W <= n; i += VT::W)
      store_f32<VT>(o + i, gated_product<VT>(act, VT::load(g + i), VT::load(u + i)));
    for (; i < n; ++i) scalar_store(o + i, gated_product<VecScalar>(act, g[i], u[i]));
  }
}

template <class VT>
void act_mul_f32_rows_entry(GatedActivation act, const float* gate, const float* up,
                            int64_t stride, int64_t rows, int64_t n, void* out,
                            int64_t out_stride, DType out_dtype) {
  if (out_dtype == DType::kBF16)
    return act_mul_f32_rows_typed<VT>(act, gate, up, stride, rows, n, static_cast<bf16_t*>(out),
                                      out_stride);
  act_mul_f32_rows_typed<VT>(act, gate, up, stride, rows, n, static_cast<float*>(out), out_stride);
}

// v as it stands, rounded: the compiler may not fuse the multiply that made it into the
// add or subtract that reads it (GCC contracts a * b + c into an FMA under its default
// -ffp-contract=fast, intrinsics included), where the reference rounds the product first.
template <class V>
inline void keep_rounded(V& v) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+v"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#else
  volatile V held = v;
  v = held;
#endif
}

// Rotate-half RoPE of `heads` heads (head_stride elements apart, at x) at one position:
// x[i], x[i + half] <- x[i] cos[i] - x[i + half] sin[i], x[i + half] cos[i] + x[i] sin[i],
// each product rounded before the sum, as Hugging Face's x * cos + rotate_half(x) * sin
// computes it in fp32 (bf16 x widened, the result rounded once to nearest even).
template <class VT, class T>
void rotate_heads_typed(T* x, int64_t heads, int64_t head_stride, const float* cos,
                        const float* sin, int64_t half) {
  using V = typename VT::V;
  for (int64_t h = 0; h < heads; ++h) {
    T* a = x + h * head_stride;
    T* b = a + half;
    int64_t i = 0;
    for (; i + VT::W <= half; i += VT::W) {
      const V x1 = load_f32<VT>(a + i), x2 = load_f32<VT>(b + i);
      const V c = VT::load(cos + i), s = VT::load(sin + i);
      V x1c = VT::mul(x1, c), x2s = VT::mul(x2, s), x2c = VT::mul(x2, c), x1s = VT::mul(x1, s);
      keep_rounded(x1c), keep_rounded(x2s), keep_rounded(x2c), keep_rounded(x1s);
      store_f32<VT>(a + i, VT::sub(x1c, x2s));
      store_f32<VT>(b + i, VT::add(x2c, x1s));
    }
    for (; i < half; ++i) {
      const float x1 = scalar_f32(a[i]), x2 = scalar_f32(b[i]);
      float x1c = x1 * cos[i], x2s = x2 * sin[i], x2c = x2 * cos[i], x1s = x1 * sin[i];
      keep_rounded(x1c), keep_rounded(x2s), keep_rounded(x2c), keep_rounded(x1s);
      scalar_store(a + i, x1c - x2s);
      scalar_store(b + i, x2c + x1s);
    }
  }
}

template <class VT>
void rotate_heads_entry(void* x, DType dtype, int64_t heads, int64_t head_stride,
                        const float* cos, const float* sin, int64_t half) {
  if (dtype == DType::kBF16)
    return rotate_heads_typed<VT>(static_cast<bf16_t*>(x), heads, head_stride, cos, sin, half);
  rotate_heads_typed<VT>(static_cast<float*>(x), heads, head_stride, cos, sin, half);
}

// Index of the first maximal element of each row (a NaN counts as maximal, the first NaN
// wins: torch.argmax's answer), for greedy sampling. One pass keeps, per lane, the lane's
// max and the first index holding it (exact as a float below 2^24 entries); the row's
// answer is the least index among the lanes that hold its max. A row with a NaN (or of
// 2^24 entries and more) takes a second pass for its first wanted entry. A 32-row batch of
// 49,152 logits is then one streaming read, where torch's argmax reduces element by element.
template <class VT, class T>
void argmax_rows_typed(const T* x, int64_t stride, int64_t row_begin, int64_t row_end,
                       int64_t n, int64_t* out) {
  using V = typename VT::V;
  constexpr int W = VT::W;
  constexpr int64_t kExactIndices = int64_t{1} << 24;
  float lane[W];
  for (int l = 0; l < W; ++l) lane[l] = static_cast<float>(l);
  const V iota = VT::load(lane);
  const V zero = VT::zero(), one = VT::set1(1.f);
  constexpr int kChains = 4;  // independent max/index chains: a compare-and-blend chain
                              // alone runs at its latency, not at the loads' rate
  for (int64_t r = row_begin; r < row_end; ++r) {
    const T* row = x + r * stride;
    V vmax[kChains], vidx[kChains];
    V nan = zero;  // 1 in lanes that met a NaN (x != x)
    for (int c = 0; c < kChains; ++c)
      vmax[c] = VT::set1(-std::numeric_limits<float>::infinity()), vidx[c] = zero;
    int64_t i = 0;
    const auto step = [&](int c, int64_t at) {
      const V v = load_f32<VT>(row + at);
      const auto up = VT::lt(vmax[c], v);  // strictly: a lane keeps its first maximum
      vmax[c] = VT::select(up, v, vmax[c]);
      vidx[c] = VT::select(up, VT::add(iota, VT::set1(static_cast<float>(at))), vidx[c]);
      nan = VT::max(nan, VT::select(VT::eq(v, v), zero, one));
    };
    for (; i + kChains * W <= n; i += kChains * W)
      for (int c = 0; c < kChains; ++c) step(c, i + c * W);
    for (; i + W <= n; i += W) step(0, i);
    V all_max = vmax[0];
    for (int c = 1; c < kChains; ++c) all_max = VT::max(all_max, vmax[c]);
    float m = VT::hmax(all_max);
    bool has_nan = VT::hmax(nan) > 0.f;
    int64_t best = -1;  // none yet: the least index among the lanes holding m
    for (int c = 0; c < kChains && i > 0; ++c) {
      float lane_max[W], lane_idx[W];
      VT::store(lane_max, vmax[c]);
      VT::store(lane_idx, vidx[c]);
      for (int l = 0; l < W; ++l)
        if (lane_max[l] == m && (best < 0 || static_cast<int64_t>(lane_idx[l]) < best))
          best = static_cast<int64_t>(lane_idx[l]);
    }
    for (int64_t j = i; j < n; ++j) {
      const float v = scalar_f32(row[j]);
      has_nan |= v != v;
      if (best < 0 || v > m) m = v, best = j;
    }
    if (has_nan || n >= kExactIndices) {
      const auto wanted = [&](float v) { return has_nan ? v != v : v == m; };
      for (best = 0; best < n && !wanted(scalar_f32(row[best])); ++best) {
      }
    }
    out[r] = best;
  }
}

template <class VT>
void argmax_rows_entry(const void* x, int64_t stride, int64_t row_begin, int64_t row_end,
                       int64_t n, DType dtype, int64_t* out) {
  if (dtype == DType::kBF16)
    return argmax_rows_typed<VT>(static_cast<const bf16_t*>(x), stride, row_begin, row_end, n,
                                 out);
  argmax_rows_typed<VT>(static_cast<const float*>(x), stride, row_begin, row_end, n, out);
}

// A gated MLP's projection and activation in one pass: out[m, j] = act(x . W[j]) *
// (x . W[d + j]) for j < d, over a packed [2d, k] weight (gate panels [0, d/16), up panels
// [d/16, 2d/16); d a multiple of 16). Each row tile computes its gate and up tiles into
// an L1 scratch and writes only the product: the [m, 2d] projection is never stored, and
// the activation costs no pass of its own. Panels [p_begin, p_end) index the d/16 output
// panels; p.n is 2d, p.out is [m, d].
template <class VT, class WT, int MR>
inline void gated_tile(const LinearParams& p, GatedActivation act, int rows, const float* x,
                       const WT* gate_panel, const WT* up_panel, const float* gate_bias,
                       const float* up_bias, float* out) {
  alignas(64) float gate[MR * kLinearPanel], up[MR * kLinearPanel];
  if (rows == MR) {
    linear_tile<VT, WT, MR>(x, p.x_stride, gate_panel, p.k, gate, kLinearPanel, gate_bias,
                            kLinearPanel);
    linear_tile<VT, WT, MR>(x, p.x_stride, up_panel, p.k, up, kLinearPanel, up_bias,
                            kLinearPanel);
  } else {
    linear_tail<VT, WT, MR - 1>(rows, x, p.x_stride, gate_panel, p.k, gate, kLinearPanel,
                                gate_bias, kLinearPanel);
    linear_tail<VT, WT, MR - 1>(rows, x, p.x_stride, up_panel, p.k, up, kLinearPanel, up_bias,
                                kLinearPanel);
  }
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < kLinearPanel; c += VT::W)
      VT::store(out + r * p.out_stride + c,
                gated_product<VT>(act, VT::load(gate + r * kLinearPanel + c),
                                  VT::load(up + r * kLinearPanel + c)));
}

template <class VT, class WT>
void gated_linear_block_dtype(const LinearParams& p, GatedActivation act, int64_t m_begin,
                              int64_t m_end, int64_t p_begin, int64_t p_end) {
  constexpr int MR = linear_tile_rows<VT>();
  const auto* w = static_cast<const WT*>(p.weight);
  const int64_t d = p.n / 2, up_offset = d / kLinearPanel * p.k * kLinearPanel;
  for (int64_t pi = p_begin; pi < p_end; ++pi) {
    const WT* gate_panel = w + pi * p.k * kLinearPanel;
    const int64_t col = pi * kLinearPanel;
    const float* gate_bias = p.bias != nullptr ? p.bias + col : nullptr;
    const float* up_bias = p.bias != nullptr ? p.bias + d + col : nullptr;
    for (int64_t m = m_begin; m < m_end; m += MR)
      gated_tile<VT, WT, MR>(p, act, static_cast<int>(std::min<int64_t>(MR, m_end - m)),
                             p.x + m * p.x_stride, gate_panel, gate_panel + up_offset,
                             gate_bias, up_bias, p.out + m * p.out_stride + col);
  }
}

template <class VT>
void gated_linear_block_entry(const LinearParams& p, GatedActivation act, int64_t m_begin,
                              int64_t m_end, int64_t p_begin, int64_t p_end) {
  switch (p.weight_dtype) {
    case DType::kBF16:
      return gated_linear_block_dtype<VT, bf16_t>(p, act, m_begin, m_end, p_begin, p_end);
    case DType::kF16:
      return gated_linear_block_dtype<VT, fp16_t>(p, act, m_begin, m_end, p_begin, p_end);
    default: return gated_linear_block_dtype<VT, float>(p, act, m_begin, m_end, p_begin, p_end);
  }
}

// The model-layer entries of an ISA's table (needs linear_kernel_impl.h included first).
template <class VT>
KernelTable with_model_kernels(KernelTable table) {
  table.linear_block = &linear_block_entry<VT>;
  table.gated_linear_block = &gated_linear_block_entry<VT>;
  table.rms_norm_rows = &rms_norm_rows_entry<VT>;
  table.act_mul_rows = &act_mul_rows_entry<VT>;
  table.act_mul_f32_rows = &act_mul_f32_rows_entry<VT>;
  table.argmax_rows = &argmax_rows_entry<VT>;
  table.rotate_heads = &rotate_heads_entry<VT>;
  return table;
}
