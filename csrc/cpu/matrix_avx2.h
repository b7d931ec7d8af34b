// The matrix kernel's packing (tile_pack.h) on AVX2: 8 x 8 blocks of 32-bit words
// transposed in registers (unpack 32, unpack 64, 128-bit lane permutes), 16-bit pairs
// interleaved by widening both rows to 32 bits (even row low). Column tails of 32-bit
// rows are masked loads; 16-bit rows are whole multiples of 8 columns here (head sizes
// are multiples of 8), and a shorter tail goes through a zero-padded copy. Included after
// attn_kernel_impl.h in the AVX2 and AVX-512 TUs' anonymous namespace (VecAvx2 also runs
// head sizes that are not a multiple of 16 there).

template <>
struct TilePack<VecAvx2> {
  static __m256i tail_mask(int n) {  // lanes [0, n) set
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }

  static void transpose32(const uint32_t* const* rows, int nrows, int ncols, uint32_t* dst) {
    for (int n0 = 0; n0 < nrows; n0 += 8) {
      for (int c0 = 0; c0 < ncols; c0 += 8) {
        const int nc = std::min(8, ncols - c0);
        const __m256i m = tail_mask(nc);
        __m256i r[8];
        for (int i = 0; i < 8; ++i) {
          const uint32_t* row = rows[n0 + i];
          r[i] = row ? _mm256_maskload_epi32(reinterpret_cast<const int*>(row + c0), m)
                     : _mm256_setzero_si256();
        }
        __m256i t[8], u[8];
        for (int i = 0; i < 4; ++i) {
          t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
          t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        // u[4q + k]: within each 128-bit lane, word k of rows 4q .. 4q + 3.
        for (int q = 0; q < 2; ++q) {
          u[4 * q + 0] = _mm256_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
          u[4 * q + 1] = _mm256_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
          u[4 * q + 2] = _mm256_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
          u[4 * q + 3] = _mm256_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
        }
        for (int k = 0; k < 4; ++k) {
          r[k] = _mm256_permute2x128_si256(u[k], u[4 + k], 0x20);      // columns k
          r[4 + k] = _mm256_permute2x128_si256(u[k], u[4 + k], 0x31);  // columns 4 + k
        }
        for (int i = 0; i < nc; ++i)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + static_cast<int64_t>(c0 + i) * nrows + n0),
                              r[i]);
      }
    }
  }

  static __m256i widen(const uint16_t* row, int c, int nc) {
    if (!row) return _mm256_setzero_si256();
    if (nc == 8)
      return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c)));
    uint16_t pad[8] = {};
    std::memcpy(pad, row + c, sizeof(uint16_t) * nc);
    return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pad)));
  }

  static void interleave16(const uint16_t* const* rows, int nrows, int ncols, uint32_t* dst) {
    for (int j = 0; j < nrows / 2; ++j) {
      const uint16_t *a = rows[2 * j], *b = rows[2 * j + 1];
      uint32_t* out = dst + static_cast<int64_t>(j) * ncols;
      for (int c = 0; c < ncols; c += 8) {
        const int nc = std::min(8, ncols - c);
        const __m256i w = _mm256_or_si256(widen(a, c, nc), _mm256_slli_epi32(widen(b, c, nc), 16));
        _mm256_maskstore_epi32(reinterpret_cast<int*>(out + c), tail_mask(nc), w);
      }
    }
  }

  // n is a multiple of 16 for the tiles checked here; a tail is checked by TilePack's loop.
  static bool nonfinite_bf16(const uint16_t* x, int64_t n) {
    const __m256i e = _mm256_set1_epi16(0x7f80);
    __m256i bad = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
      bad = _mm256_or_si256(bad, _mm256_cmpeq_epi16(_mm256_and_si256(v, e), e));
    }
    return !_mm256_testz_si256(bad, bad) || TilePack<VecScalar>::nonfinite_bf16(x + i, n - i);
  }
  static bool nonfinite_f32(const uint32_t* x, int64_t n) {
    const __m256i e = _mm256_set1_epi32(0x7f800000);
    __m256i bad = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
      bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(v, e), e));
    }
    return !_mm256_testz_si256(bad, bad) || TilePack<VecScalar>::nonfinite_f32(x + i, n - i);
  }
};
