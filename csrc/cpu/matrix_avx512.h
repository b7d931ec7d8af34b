// The matrix kernel's AVX-512 pieces, included after attn_kernel_impl.h in the AVX-512
// TUs' anonymous namespace.
//
// TilePack (tile_pack.h): 16 x 16 blocks of 32-bit words transposed in registers (unpack
// 32, unpack 64, two 128-bit lane shuffles: 64 shuffles per 256 words), and 16-bit pairs
// interleaved by widening both rows to 32 bits (even row low). Column tails are masked
// loads and stores, so no element is moved alone.

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

// ProbVec (prefill_matrix_impl.h): 2^x as p(f) * 2^floor(x), f = x - floor(x) in [0, 1)
// by vreduceps, p a degree-3 minimax polynomial of 2^f (relative error 7.5e-5, far below
// the bf16 rounding the probabilities get), and 2^floor(x) applied by vscalefps, which
// floors its exponent operand itself: 6 vector instructions (VecAvx512::exp takes ~17).
// x is clamped at -125, so no result underflows: an underflowing result takes a microcode
// assist (~150 cycles), and the masked lanes of every diagonal tile did. exp2 (tiles some
// row sees in part) turns lanes below -125, hidden keys' -inf included, into exact zeros
// with a zeroing mask (its compare is true for NaN, which passes through: vmaxps returns
// its second operand for a NaN); exp2_seen (tiles every row sees whole) skips the mask.
// kCvtNe: round to bf16 with vcvtne2ps2bf16, two vectors an instruction (AVX512-BF16 TUs),
// else with integer ops.
template <bool kCvtNe>
struct ProbVecAvx512 {
  static __m512 poly(__m512 x) {
    const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 p = _mm512_set1_ps(7.8024061e-2f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.2606674e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9583427e-1f));
    return _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9992508e-1f));
  }
  static __m512 exp2(__m512 x) {
    const __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-125.f), _CMP_NLT_UQ);
    x = _mm512_max_ps(_mm512_set1_ps(-125.f), x);
    return _mm512_maskz_scalef_ps(kept, poly(x), x);
  }
  static __m512 exp2_seen(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-125.f), x);
    return _mm512_scalef_ps(poly(x), x);
  }
  // The TU's own bf16 store (vcvtneps2bf16 where it has avx512bf16: vec_avx512.h).
  static void store_bf16(bf16_t* dst, __m512 v) { VecAvx512::cvt_store(dst, v); }
  static void store_bf16_pair(bf16_t* dst, __m512 lo, __m512 hi);
};
template <>
inline void ProbVecAvx512<false>::store_bf16_pair(bf16_t* dst, __m512 lo, __m512 hi) {
  VecAvx512::cvt_store(dst, lo);
  VecAvx512::cvt_store(dst + 16, hi);
}
