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

// out[:, i] = silu(x[:, i]) * x[:, d + i], silu(a) = a / (1 + exp(-a)).
template <class VT, class T>
void silu_mul_rows_typed(const T* x, int64_t x_stride, T* out, int64_t out_stride,
                         int64_t row_begin, int64_t row_end, int64_t d) {
  using V = typename VT::V;
  const V one = VT::set1(1.f), neg = VT::set1(-1.f);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const T* gate = x + r * x_stride;
    const T* up = gate + d;
    T* o = out + r * out_stride;
    int64_t i = 0;
    for (; i + VT::W <= d; i += VT::W) {
      const V g = load_f32<VT>(gate + i);
      const V s = VT::div(g, VT::add(one, VT::exp(VT::mul(g, neg))));
      store_f32<VT>(o + i, VT::mul(s, load_f32<VT>(up + i)));
    }
    for (; i < d; ++i) {
      const float g = scalar_f32(gate[i]);
      scalar_store(o + i, g / (1.f + std::exp(-g)) * scalar_f32(up[i]));
    }
  }
}

template <class VT>
void silu_mul_rows_entry(const void* x, int64_t x_stride, void* out, int64_t out_stride,
                         int64_t row_begin, int64_t row_end, int64_t d, DType dtype) {
  if (dtype == DType::kBF16)
    return silu_mul_rows_typed<VT>(static_cast<const bf16_t*>(x), x_stride,
                                   static_cast<bf16_t*>(out), out_stride, row_begin, row_end, d);
  silu_mul_rows_typed<VT>(static_cast<const float*>(x), x_stride, static_cast<float*>(out),
                          out_stride, row_begin, row_end, d);
}

// The model-layer entries of an ISA's table (needs linear_kernel_impl.h included first).
template <class VT>
KernelTable with_model_kernels(KernelTable table) {
  table.linear_block = &linear_block_entry<VT>;
  table.rms_norm_rows = &rms_norm_rows_entry<VT>;
  table.silu_mul_rows = &silu_mul_rows_entry<VT>;
  return table;
}
