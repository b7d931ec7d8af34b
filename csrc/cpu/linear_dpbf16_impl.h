// Linear layer on vdpbf16ps: out[m, n] = bias[n] + sum_k x[m, k] * W[n, k], x in (or
// rounded to) bf16, W bf16, products exact and summed in fp32, out fp32 or rounded to bf16 (LinearDpParams, kernel_api.h, for the
// layout).
//
// One k-pair step of a tile loads one 64-byte weight row per panel and broadcasts one
// 32-bit (x[m, 2i], x[m, 2i + 1]) pair per row; vdpbf16ps then adds both products into each
// column's fp32 lane. A tile is MR rows x NP panels: 6 x 4 keeps 24 accumulators, 4 weight
// rows and a broadcast in the 32 zmm registers and issues 10 loads per 24 dot products
// (a 1-panel tile would issue more loads than dot products).
//
// Included inside the anonymous namespace of the AVX512-BF16 TU.

constexpr int kDpTileRows = 6;
constexpr int kDpTilePanels = 4;

// Rows of x in bf16, padded with zeros to 2 * k_pairs columns: fp32 rows rounded
// (vcvtneps2bf16: nearest even; it also flushes fp32 subnormals, |x| < 2^-126, to zero),
// bf16 rows copied.
void linear_dp_round_rows(const LinearDpParams& p, int64_t m_begin, int64_t m_end, bf16_t* dst) {
  const int64_t kp = 2 * p.k_pairs;
  const auto lanes = [](int64_t n) {
    return static_cast<__mmask16>((1u << std::clamp<int64_t>(n, 0, 16)) - 1u);
  };
  const auto lanes32 = [](int64_t n) {
    return n >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << std::max<int64_t>(n, 0)) - 1u);
  };
  for (int64_t m = m_begin; m < m_end; ++m, dst += kp) {
    if (p.x_dtype == DType::kBF16) {
      const bf16_t* src = static_cast<const bf16_t*>(p.x) + m * p.x_stride;
      for (int64_t c = 0; c < kp; c += 32)
        _mm512_mask_storeu_epi16(dst + c, lanes32(kp - c),
                                 _mm512_maskz_loadu_epi16(lanes32(p.k - c), src + c));
      continue;
    }
    const float* src = static_cast<const float*>(p.x) + m * p.x_stride;
    for (int64_t c = 0; c < kp; c += 16) {
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(lanes(p.k - c), src + c));
      _mm256_mask_storeu_epi16(dst + c, lanes(kp - c), h);
    }
  }
}

// Rows m .. m + MR of the output; x: their bf16 copy, row stride 2 * k_pairs.
template <int MR, int NP>
inline void linear_dp_tile(const LinearDpParams& p, const bf16_t* x, int64_t m, int64_t panel) {
  const int64_t panel_elems = p.k_pairs * 32;
  const int64_t xs = 2 * p.k_pairs;
  const bf16_t* w = p.weight + panel * panel_elems;
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < p.k_pairs; ++i) {
    __m512i wv[NP];
    for (int j = 0; j < NP; ++j) wv[j] = _mm512_loadu_si512(w + j * panel_elems + i * 32);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * xs + 2 * i, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)wv[j], xb);
    }
  }
  for (int j = 0; j < NP; ++j) {
    const int64_t col = (panel + j) * kLinearPanel;
    // The last panel of a width that is not a multiple of 16: its padding columns are
    // computed and masked off.
    const int ncols = static_cast<int>(std::min<int64_t>(kLinearPanel, p.n - col));
    const __mmask16 mask = static_cast<__mmask16>((1u << ncols) - 1u);
    const __m512 b = p.bias != nullptr ? _mm512_maskz_loadu_ps(mask, p.bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r) {
      const __m512 y = _mm512_add_ps(acc[r][j], b);
      if (p.out_dtype == DType::kBF16)
        _mm256_mask_storeu_epi16(static_cast<bf16_t*>(p.out) + (m + r) * p.out_stride + col, mask,
                                 (__m256i)_mm512_cvtneps_pbh(y));
      else
        _mm512_mask_storeu_ps(static_cast<float*>(p.out) + (m + r) * p.out_stride + col, mask, y);
    }
  }
}

// Rows [m_begin, m_end) of NP panels: full tiles, then one tile for the leftover rows, one
// instantiation per count so every accumulator stays in a register.
template <int NP>
void linear_dp_panels(const LinearDpParams& p, const bf16_t* xb, int64_t m_begin, int64_t m_end,
                      int64_t panel) {
  const int64_t xs = 2 * p.k_pairs;
  int64_t m = m_begin;
  for (; m + kDpTileRows <= m_end; m += kDpTileRows)
    linear_dp_tile<kDpTileRows, NP>(p, xb + (m - m_begin) * xs, m, panel);
  const bf16_t* x = xb + (m - m_begin) * xs;
  switch (m_end - m) {
    case 5: return linear_dp_tile<5, NP>(p, x, m, panel);
    case 4: return linear_dp_tile<4, NP>(p, x, m, panel);
    case 3: return linear_dp_tile<3, NP>(p, x, m, panel);
    case 2: return linear_dp_tile<2, NP>(p, x, m, panel);
    case 1: return linear_dp_tile<1, NP>(p, x, m, panel);
    default: return;
  }
}
static_assert(kDpTileRows == 6, "linear_dp_panels' tail switch covers 1..5 leftover rows");

void linear_dpbf16_block(const LinearDpParams& p, int64_t m_begin, int64_t m_end,
                         int64_t p_begin, int64_t p_end, const bf16_t* x_bf16) {
  for (int64_t pi = p_begin; pi < p_end; pi += kDpTilePanels) {
    switch (std::min<int64_t>(kDpTilePanels, p_end - pi)) {
      case 4: linear_dp_panels<4>(p, x_bf16, m_begin, m_end, pi); break;
      case 3: linear_dp_panels<3>(p, x_bf16, m_begin, m_end, pi); break;
      case 2: linear_dp_panels<2>(p, x_bf16, m_begin, m_end, pi); break;
      default: linear_dp_panels<1>(p, x_bf16, m_begin, m_end, pi); break;
    }
  }
}
