// Linear layer kernel over panel-packed weights: out[m, n] = bias[n] + sum_k x[m, k] * W[n, k],
// x and out fp32, W fp32/bf16/fp16 widened in registers, fp32 accumulation.
//
// W is packed as [num_panels, K, kLinearPanel]: panel p holds output columns
// p*16 .. p*16+15, one 16-wide row per k, so one k step reads 16 contiguous weights and
// the microkernel is a rank-1 update of an MR x 16 accumulator tile (no horizontal sums).
// A decode step (M = 1..32) is a stream over the weights; bf16 panels halve its bytes.
//
// Included inside an anonymous namespace of an ISA TU, after that ISA's vector struct.

template <class VT>
constexpr int linear_tile_rows() {
  // Accumulators (rows x 16/W vectors) + 16/W weight vectors + 1 broadcast must fit the
  // register file: AVX2 6 x 2 + 2 + 1 = 15 of 16, AVX-512 8 x 1 + 2 of 32, NEON 4 x 4 + 5.
  return VT::W >= 16 ? 8 : VT::W == 8 ? 6 : VT::W == 4 ? 4 : 1;
}

// One MR x 16 tile over the whole K: rows x[0..MR) (row stride xs), one weight panel.
template <class VT, class WT, int MR>
inline void linear_tile(const float* x, int64_t xs, const WT* panel, int64_t K, float* out,
                        int64_t os, const float* bias, int ncols) {
  using V = typename VT::V;
  constexpr int NV = kLinearPanel / VT::W;
  V acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = VT::zero();
  for (int64_t k = 0; k < K; ++k) {
    V w[NV];
    for (int v = 0; v < NV; ++v) w[v] = VT::cvt_load(panel + k * kLinearPanel + v * VT::W);
    for (int r = 0; r < MR; ++r) {
      const V xb = VT::set1(x[r * xs + k]);
      for (int v = 0; v < NV; ++v) acc[r][v] = VT::fma(w[v], xb, acc[r][v]);
    }
  }
  if (ncols == kLinearPanel) {
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) {
        V y = acc[r][v];
        if (bias != nullptr) y = VT::add(y, VT::load(bias + v * VT::W));
        VT::store(out + r * os + v * VT::W, y);
      }
    return;
  }
  // The last panel of a layer whose width is not a multiple of 16: its padding columns
  // (zero weights) are computed and dropped.
  float tmp[kLinearPanel];
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < NV; ++v) VT::store(tmp + v * VT::W, acc[r][v]);
    for (int c = 0; c < ncols; ++c) out[r * os + c] = tmp[c] + (bias != nullptr ? bias[c] : 0.f);
  }
}

// The tail rows of a row block (fewer than the tile's MR), one instantiation per count so
// every accumulator stays in a register.
template <class VT, class WT, int MR>
inline void linear_tail(int rows, const float* x, int64_t xs, const WT* panel, int64_t K,
                        float* out, int64_t os, const float* bias, int ncols) {
  if constexpr (MR > 0) {
    if (rows == MR) return linear_tile<VT, WT, MR>(x, xs, panel, K, out, os, bias, ncols);
    linear_tail<VT, WT, MR - 1>(rows, x, xs, panel, K, out, os, bias, ncols);
  }
}

template <class VT, class WT>
void linear_block_dtype(const LinearParams& p, int64_t m_begin, int64_t m_end,
                        int64_t p_begin, int64_t p_end) {
  constexpr int MR = linear_tile_rows<VT>();
  const auto* w = static_cast<const WT*>(p.weight);
  for (int64_t pi = p_begin; pi < p_end; ++pi) {
    const WT* panel = w + pi * p.k * kLinearPanel;
    const int64_t col = pi * kLinearPanel;
    const int ncols = static_cast<int>(std::min<int64_t>(kLinearPanel, p.n - col));
    const float* bias = p.bias != nullptr ? p.bias + col : nullptr;
    int64_t m = m_begin;
    for (; m + MR <= m_end; m += MR)
      linear_tile<VT, WT, MR>(p.x + m * p.x_stride, p.x_stride, panel, p.k,
                              p.out + m * p.out_stride + col, p.out_stride, bias, ncols);
    if (m < m_end)
      linear_tail<VT, WT, MR - 1>(static_cast<int>(m_end - m), p.x + m * p.x_stride, p.x_stride,
                                  panel, p.k, p.out + m * p.out_stride + col, p.out_stride,
                                  bias, ncols);
  }
}

template <class VT>
void linear_block_entry(const LinearParams& p, int64_t m_begin, int64_t m_end,
                        int64_t p_begin, int64_t p_end) {
  switch (p.weight_dtype) {
    case DType::kBF16: return linear_block_dtype<VT, bf16_t>(p, m_begin, m_end, p_begin, p_end);
    case DType::kF16: return linear_block_dtype<VT, fp16_t>(p, m_begin, m_end, p_begin, p_end);
    default: return linear_block_dtype<VT, float>(p, m_begin, m_end, p_begin, p_end);
  }
}
