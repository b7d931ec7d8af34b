// Row kernels of a transformer layer's elementwise steps (fp32): RMSNorm (optionally after a
// residual add) and SiLU-and-mul. One fused pass per row instead of torch's chain of ~8
// ops each allocating a tensor: a decode step runs them ~90 times per token.
//
// Included inside an anonymous namespace of an ISA TU, after that ISA's vector struct.

template <class VT>
inline float sum_of_squares(const float* x, int64_t d) {
  using V = typename VT::V;
  V acc0 = VT::zero(), acc1 = VT::zero();
  int64_t i = 0;
  for (; i + 2 * VT::W <= d; i += 2 * VT::W) {
    const V a = VT::load(x + i), b = VT::load(x + i + VT::W);
    acc0 = VT::fma(a, a, acc0);
    acc1 = VT::fma(b, b, acc1);
  }
  for (; i + VT::W <= d; i += VT::W) {
    const V a = VT::load(x + i);
    acc0 = VT::fma(a, a, acc0);
  }
  float s = VT::hsum(VT::add(acc0, acc1));
  for (; i < d; ++i) s += x[i] * x[i];
  return s;
}

// out = (x * (1 / sqrt(mean(x^2) + eps))) * weight, the product order of Hugging Face's
// Llama RMSNorm in fp32.
template <class VT>
inline void rms_norm_row(const float* x, const float* w, float eps, float* out, int64_t d) {
  using V = typename VT::V;
  const float inv = 1.f / std::sqrt(sum_of_squares<VT>(x, d) / static_cast<float>(d) + eps);
  const V vinv = VT::set1(inv);
  int64_t i = 0;
  for (; i + VT::W <= d; i += VT::W)
    VT::store(out + i, VT::mul(VT::mul(VT::load(x + i), vinv), VT::load(w + i)));
  for (; i < d; ++i) out[i] = (x[i] * inv) * w[i];
}

template <class VT>
void rms_norm_rows_entry(const NormParams& p, int64_t row_begin, int64_t row_end) {
  using V = typename VT::V;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const float* x = p.x + r * p.x_stride;
    float* out = p.out + r * p.out_stride;
    if (p.residual == nullptr) {
      rms_norm_row<VT>(x, p.weight, p.eps, out, p.d);
      continue;
    }
    float* res = p.residual + r * p.residual_stride;
    int64_t i = 0;
    for (; i + VT::W <= p.d; i += VT::W) VT::store(res + i, VT::add(VT::load(res + i), VT::load(x + i)));
    for (; i < p.d; ++i) res[i] += x[i];
    rms_norm_row<VT>(res, p.weight, p.eps, out, p.d);
  }
}

// out[:, i] = silu(x[:, i]) * x[:, d + i], silu(a) = a / (1 + exp(-a)).
template <class VT>
void silu_mul_rows_entry(const float* x, int64_t x_stride, float* out, int64_t out_stride,
                         int64_t row_begin, int64_t row_end, int64_t d) {
  using V = typename VT::V;
  const V one = VT::set1(1.f), neg = VT::set1(-1.f);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const float* gate = x + r * x_stride;
    const float* up = gate + d;
    float* o = out + r * out_stride;
    int64_t i = 0;
    for (; i + VT::W <= d; i += VT::W) {
      const V g = VT::load(gate + i);
      const V s = VT::div(g, VT::add(one, VT::exp(VT::mul(g, neg))));
      VT::store(o + i, VT::mul(s, VT::load(up + i)));
    }
    for (; i < d; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
  }
}

// The model-layer entries of an ISA's table (needs linear_kernel_impl.h included first).
template <class VT>
KernelTable with_model_kernels(KernelTable table) {
  table.linear_block = &linear_block_entry<VT>;
  table.rms_norm_rows = &rms_norm_rows_entry<VT>;
  table.silu_mul_rows = &silu_mul_rows_entry<VT>;
  return table;
}
