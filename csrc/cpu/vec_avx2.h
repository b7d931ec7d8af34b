// 8 x fp32 AVX2 + FMA + F16C vector ops. Included inside an anonymous namespace of a TU
// compiled under a matching `#pragma GCC target`.

struct VecAvx2 {
  using V = __m256;
  using VI = __m256i;  // 8 x int32
  using M = __m256;    // lane mask: all-ones lanes
  static constexpr int W = 8;
  static constexpr int kPvRows = 4;  // 4 rows x 2 vectors = 8 accumulators of 16 ymm
  static constexpr int kPvVecs = 2;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static float hsum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float hmax(V v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }

  // Masks, selects and int32 lanes (online_softmax.h).
  static M lt(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  static M eq(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
  static V select(M m, V a, V b) { return _mm256_blendv_ps(b, a, m); }  // m ? a : b
  static bool any(M m) { return _mm256_movemask_ps(m) != 0; }
  static VI loadi(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static VI set1i(int32_t x) { return _mm256_set1_epi32(x); }
  static VI iotai() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static VI addi(VI a, VI b) { return _mm256_add_epi32(a, b); }
  static V cvti(VI a) { return _mm256_cvtepi32_ps(a); }
  static M outside(VI lo, VI k, VI hi) {  // k < lo or k > hi
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_cmpgt_epi32(lo, k), _mm256_cmpgt_epi32(k, hi)));
  }
  static int32_t hmaxi(VI v) {
    __m128i x = _mm_max_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    x = _mm_max_epi32(x, _mm_shuffle_epi32(x, 0x4E));
    return _mm_cvtsi128_si32(_mm_max_epi32(x, _mm_shuffle_epi32(x, 0xB1)));
  }
  static int32_t hmini(VI v) {
    __m128i x = _mm_min_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    x = _mm_min_epi32(x, _mm_shuffle_epi32(x, 0x4E));
    return _mm_cvtsi128_si32(_mm_min_epi32(x, _mm_shuffle_epi32(x, 0xB1)));
  }

  // Lane i of the result = sum of a[i]'s lanes (see VecAvx512::reduce_lanes). Always
  // inlined: as a call its 8 inputs go through memory.
  __attribute__((always_inline)) static V reduce_lanes(const V* a) {
    V b[4], c[2];
    for (int i = 0; i < 4; ++i)
      b[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                           _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int j = 0; j < 2; ++j) {
      const __m256d x = _mm256_castps_pd(b[2 * j]), y = _mm256_castps_pd(b[2 * j + 1]);
      c[j] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                           _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(c[0], c[1], 0x20),
                         _mm256_permute2f128_ps(c[0], c[1], 0x31));
  }

  // Same polynomial as VecAvx512::exp.
  static V exp(V x) {
    const V lo = _mm256_set1_ps(-87.33654f);
    const V tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    x = _mm256_max_ps(x, lo);
    V n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    V y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    V res = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(tiny, res);
  }

  static V cvt_load(const float* p) { return _mm256_loadu_ps(p); }
  static V cvt_load(const bf16_t* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static V cvt_load(const fp16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // fp8 -> fp16 bits by shifts (exact), F16C to fp32. E4M3: the byte's exponent and
  // mantissa land in fp16's, i.e. value / 256 (subnormals included), and magnitude 0x7f,
  // which would read 480, is its NaN. E5M2 is the top byte of an fp16 (inf/NaN included).
  static V cvt_load(const fp8_e4m3_t* p) {
    const __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i h = _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(static_cast<short>(0xBF80)));
    const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), _mm_set1_epi16(0x7f));
    const V x = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
    // a quiet NaN (an all-ones NaN would wrap to 0 in cvt_store's bf16 rounding)
    return _mm256_blendv_ps(x, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
                            _mm256_castsi256_ps(_mm256_cvtepi16_epi32(nan)));
  }
  static V cvt_load(const fp8_e5m2_t* p) {
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_cvtph_ps(_mm_slli_epi16(w, 8));
  }
  // One decoded cache row, 16 values per step: cvt_load's shifts on 16 words at once, and
  // E4M3's NaN (magnitude 0x7f) found by one byte compare per 16 and patched lane by lane
  // (a NaN is rare: it only gets there when the written value was NaN).
  static void cvt_row(const fp8_e4m3_t* src, float* dst, int D) {
    const auto* s = reinterpret_cast<const uint8_t*>(src);
    int d = 0;
    for (; d + 16 <= D; d += 16) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + d));
      const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                         _mm256_set1_epi16(static_cast<short>(0xBF80)));
      const V unit = _mm256_set1_ps(256.f);
      _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), unit));
      _mm256_storeu_ps(dst + d + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), unit));
      const __m128i ones = _mm_cmpeq_epi8(_mm_or_si128(b, _mm_set1_epi8(static_cast<char>(0x80))),
                                          _mm_set1_epi8(static_cast<char>(0xFF)));
      if (_mm_movemask_epi8(ones) != 0)
        for (int i = 0; i < 16; ++i)
          if ((s[d + i] & 0x7F) == 0x7F) dst[d + i] = std::numeric_limits<float>::quiet_NaN();
    }
    for (; d < D; d += W) _mm256_storeu_ps(dst + d, cvt_load(src + d));
  }
  static void cvt_row(const fp8_e5m2_t* src, float* dst, int D) {
    const auto* s = reinterpret_cast<const uint8_t*>(src);
    int d = 0;
    for (; d + 16 <= D; d += 16) {
      const __m256i h = _mm256_slli_epi16(
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + d))), 8);
      _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
      _mm256_storeu_ps(dst + d + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
    }
    for (; d < D; d += W) _mm256_storeu_ps(dst + d, cvt_load(src + d));
  }
  static void cvt_store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static void cvt_store(bf16_t* p, V v) {  // round to nearest even
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    u = _mm256_srli_epi32(u, 16);
    // packus works per 128-bit lane: [a0..3 a0..3 | a4..7 a4..7]; keep qwords 0 and 2.
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static void cvt_store(fp16_t* p, V v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }

  // Byte streaming (stream_read_impl.h): 32-byte loads; psadbw against zero sums each
  // 8-byte group into a u64 lane (4 lanes).
  using SB = __m256i;
  static constexpr int kStreamBytes = 32;
  static SB stream_zero() { return _mm256_setzero_si256(); }
  static SB stream_add(SB acc, const uint8_t* p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm256_add_epi64(acc, _mm256_sad_epu8(v, _mm256_setzero_si256()));
  }
  static uint64_t stream_total(SB acc) {
    const __m128i s = _mm_add_epi64(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    return static_cast<uint64_t>(_mm_cvtsi128_si64(s)) +
           static_cast<uint64_t>(_mm_extract_epi64(s, 1));
  }
};
