// 16 x fp32 AVX-512 vector ops (avx512f/bw/vl/dq + f16c). Included inside an anonymous
// namespace of a TU compiled under a matching `#pragma GCC target`.

struct VecAvx512 {
  using V = __m512;
  using VI = __m512i;  // 16 x int32
  using M = __mmask16;
  static constexpr int W = 16;
  static constexpr int kPvRows = 4;  // 4 rows x 4 vectors = 16 accumulators of 32 zmm
  static constexpr int kPvVecs = 4;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static float hsum(V v) { return _mm512_reduce_add_ps(v); }
  static float hmax(V v) { return _mm512_reduce_max_ps(v); }

  // Masks, selects and int32 lanes (online_softmax.h).
  static M lt(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static M eq(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
  static V select(M m, V a, V b) { return _mm512_mask_blend_ps(m, b, a); }  // m ? a : b
  static bool any(M m) { return m != 0; }
  static VI loadi(const int32_t* p) { return _mm512_loadu_si512(p); }
  static VI set1i(int32_t x) { return _mm512_set1_epi32(x); }
  static VI iotai() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static VI addi(VI a, VI b) { return _mm512_add_epi32(a, b); }
  static V cvti(VI a) { return _mm512_cvtepi32_ps(a); }
  static M outside(VI lo, VI k, VI hi) {  // k < lo or k > hi
    return _mm512_cmpgt_epi32_mask(lo, k) | _mm512_cmpgt_epi32_mask(k, hi);
  }
  static int32_t hmaxi(VI v) { return _mm512_reduce_max_epi32(v); }
  static int32_t hmini(VI v) { return _mm512_reduce_min_epi32(v); }

  // Lane i of the result = sum of a[i]'s lanes (16 horizontal sums for ~45 instructions
  // instead of 16 separate reductions): pairwise unpack-add trees, then 128-bit shuffles.
  // Always inlined: as a call GCC spilled the 16 inputs to the stack and reloaded them.
  __attribute__((always_inline)) static V reduce_lanes(const V* a) {
    V b[8], c[4];
    for (int i = 0; i < 8; ++i)
      b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                           _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int j = 0; j < 4; ++j) {
      const __m512d x = _mm512_castps_pd(b[2 * j]), y = _mm512_castps_pd(b[2 * j + 1]);
      c[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const V e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    const V e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xDD));
  }

  // Cephes-style exp: 2^n * P(r), |r| <= ln2/2, ~1 ulp; exact 0 below -87.3 (incl. -inf).
  static V exp(V x) {
    const V hi = _mm512_set1_ps(88.3762626647949f);
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654f), _CMP_LT_OQ);
    x = _mm512_min_ps(x, hi);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.33654f));
    V n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    V y = _mm512_set1_ps(1.9875691500E-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507E-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073E-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894E-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459E-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201E-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    // y * 2^n in one vscalefps rather than building 2^n's bits: the same result for every
    // fp32 input (docs/performance.md)
    return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~tiny), y, n);
  }

  static V cvt_load(const float* p) { return _mm512_loadu_ps(p); }
  static V cvt_load(const bf16_t* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static V cvt_load(const fp16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // fp8 -> fp16 bits -> fp32, as VecAvx2::cvt_load (E4M3's NaN by a mask blend).
  static V cvt_load(const fp8_e4m3_t* p) {
    const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(static_cast<short>(0xBF80)));
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)),
                                                  _mm256_set1_epi16(0x7f));
    const V x = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
    return _mm512_mask_blend_ps(nan, x, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
  }
  static V cvt_load(const fp8_e5m2_t* p) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_cvtph_ps(_mm256_slli_epi16(w, 8));
  }
  template <class C>  // one decoded cache row (fp8 caches; D is a multiple of 16 here)
  static void cvt_row(const C* src, float* dst, int D) {
    for (int d = 0; d < D; d += W) _mm512_storeu_ps(dst + d, cvt_load(src + d));
  }
  static void cvt_store(float* p, V v) { _mm512_storeu_ps(p, v); }
  // Round to nearest even. A TU whose target has avx512bf16 defines
  // PAGEDATTN_AVX512_BF16_CONVERT before including this file, for vcvtneps2bf16: one
  // instruction instead of five, which keeps every NaN a NaN and flushes fp32 denormals
  // (magnitudes below 2^-126) to zero.
  static void cvt_store(bf16_t* p, V v) {
#ifdef PAGEDATTN_AVX512_BF16_CONVERT
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
#endif
  }
  static void cvt_store(fp16_t* p, V v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }

  // Byte streaming (stream_read_impl.h): 64-byte loads; vpsadbw against zero sums each
  // 8-byte group into a u64 lane (8 lanes).
  using SB = __m512i;
  static constexpr int kStreamBytes = 64;
  static SB stream_zero() { return _mm512_setzero_si512(); }
  static SB stream_add(SB acc, const uint8_t* p) {
    return _mm512_add_epi64(acc, _mm512_sad_epu8(_mm512_loadu_si512(p), _mm512_setzero_si512()));
  }
  static uint64_t stream_total(SB acc) {
    return static_cast<uint64_t>(_mm512_reduce_add_epi64(acc));
  }
};
