// TilePack (tile_pack.h) on AVX-512: 16 x 16 blocks of 32-bit words transposed in
// registers (unpack 32, unpack 64, two 128-bit lane shuffles: 64 shuffles per 256 words),
// and 16-bit pairs interleaved by widening both rows to 32 bits (even row low). Column
// tails are masked loads and stores, so no element is moved alone. Included after
// attn_kernel_impl.h in the AVX-512 TUs' anonymous namespace.

template <>
struct TilePack<VecAvx512> {
  static __m512i load_words(const uint32_t* row, int c, __mmask16 m) {
    return row ? _mm512_maskz_loadu_epi32(m, row + c) : _mm512_setzero_si512();
  }

  __attribute__((always_inline)) static void transpose16(__m512i* r) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    // u[4q + k]: within each 128-bit lane, word k of rows 4q .. 4q + 3.
    for (int q = 0; q < 4; ++q) {
      u[4 * q + 0] = _mm512_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
      u[4 * q + 1] = _mm512_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
      u[4 * q + 2] = _mm512_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
      u[4 * q + 3] = _mm512_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
    }
    __m512i v[16];
    for (int k = 0; k < 4; ++k) {
      v[k] = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88);
      v[4 + k] = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xDD);
      v[8 + k] = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);
      v[12 + k] = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xDD);
    }
    for (int k = 0; k < 8; ++k) {
      r[k] = _mm512_shuffle_i32x4(v[k], v[8 + k], 0x88);
      r[8 + k] = _mm512_shuffle_i32x4(v[k], v[8 + k], 0xDD);
    }
  }

  static void transpose32(const uint32_t* const* rows, int nrows, int ncols, uint32_t* dst) {
    for (int n0 = 0; n0 < nrows; n0 += 16) {
      for (int c0 = 0; c0 < ncols; c0 += 16) {
        const int nc = std::min(16, ncols - c0);
        const __mmask16 m = static_cast<__mmask16>((1u << nc) - 1u);
        __m512i r[16];
        for (int i = 0; i < 16; ++i) r[i] = load_words(rows[n0 + i], c0, m);
        transpose16(r);
        for (int i = 0; i < nc; ++i)
          _mm512_storeu_si512(dst + static_cast<int64_t>(c0 + i) * nrows + n0, r[i]);
      }
    }
  }

  static __m512i widen(const uint16_t* row, int c, __mmask16 m) {
    if (!row) return _mm512_setzero_si512();
    return _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, row + c));
  }

  static void interleave16(const uint16_t* const* rows, int nrows, int ncols, uint32_t* dst) {
    for (int j = 0; j < nrows / 2; ++j) {
      const uint16_t *a = rows[2 * j], *b = rows[2 * j + 1];
      uint32_t* out = dst + static_cast<int64_t>(j) * ncols;
      for (int c = 0; c < ncols; c += 16) {
        const int nc = std::min(16, ncols - c);
        const __mmask16 m = static_cast<__mmask16>((1u << nc) - 1u);
        const __m512i w = _mm512_or_si512(widen(a, c, m), _mm512_slli_epi32(widen(b, c, m), 16));
        _mm512_mask_storeu_epi32(out + c, m, w);
      }
    }
  }

  static bool nonfinite_bf16(const uint16_t* x, int64_t n) {
    const __m512i e = _mm512_set1_epi16(0x7f80);
    __mmask32 bad = 0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
      bad |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(_mm512_loadu_si512(x + i), e), e);
    if (i < n) {
      const __mmask32 m = static_cast<__mmask32>((1ull << (n - i)) - 1u);
      bad |= _mm512_mask_cmpeq_epi16_mask(m, _mm512_and_si512(_mm512_maskz_loadu_epi16(m, x + i), e), e);
    }
    return bad != 0;
  }
  static bool nonfinite_f32(const uint32_t* x, int64_t n) {
    const __m512i e = _mm512_set1_epi32(0x7f800000);
    __mmask16 bad = 0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
      bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_loadu_si512(x + i), e), e);
    if (i < n) {
      const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
      bad |= _mm512_mask_cmpeq_epi32_mask(m, _mm512_and_si512(_mm512_maskz_loadu_epi32(m, x + i), e), e);
    }
    return bad != 0;
  }
};
