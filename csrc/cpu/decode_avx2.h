// AVX2 q.k and P.V for bf16 and fp8 (E4M3, E5M2) caches, read in place: every 16 cache
// values become two fp32 vectors inside the loops (no decoded copy of the block), and each
// converted key/value chunk feeds every query row of the tile (up to 8 rows for q.k, 4 for
// P.V), so a GQA group converts each K/V element once. Included by kernels_avx2.cpp after
// attn_kernel_impl.h (inside its anonymous namespace, under its target pragma). Why and what
// was measured: docs/performance.md ("AVX2 decode, fp8 vs bf16").
//
// A source policy S turns 16 cache values at p into two vectors (S::load16) in S's chunk
// layout, and 8 values (a head-size tail) into one vector in natural order (S::load8):
//   bf16: lane i of the first vector holds dim 2i, of the second dim 2i+1 (a shift and an
//         and of one 256-bit load); q is packed and P.V accumulates in that layout, and
//         finish_row puts the dims back in order.
//   fp8:  natural order, fp8 -> fp16 bits by integer shifts, then F16C. E4M3's fp16 is the
//         value / 256 (kUnit: q is packed times 256, finish_row multiplies the accumulator
//         by 256, both exact unless |q| > 2^120), and its NaN (magnitude 0x7f) would read
//         480 / 256: each key group and value range is scanned for it first (kNanScan,
//         ~5% of the fp8 time) and one that has it is decoded exactly into a float copy
//         (e4m3_to_float_rows) and read through SrcF32 instead. The tests' caches hold
//         NaN in every unwritten slot, so partial last blocks take that path there.

struct SrcF32 {
  using C = float;
  static constexpr bool kPermuted = false, kNanScan = false;
  static constexpr float kUnit = 1.f;
  static void load16(const float* p, __m256& a, __m256& b) {
    a = _mm256_loadu_ps(p);
    b = _mm256_loadu_ps(p + 8);
  }
  using H = const float*;
  static H prep(const float* p) { return p; }
  static __m256 half0(H h) { return _mm256_loadu_ps(h); }
  static __m256 half1(H h) { return _mm256_loadu_ps(h + 8); }
  static __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
};

struct SrcBf16 {
  using C = bf16_t;
  static constexpr bool kPermuted = true, kNanScan = false;
  static constexpr float kUnit = 1.f;
  static void load16(const bf16_t* p, __m256& a, __m256& b) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    a = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    b = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  // The same in two steps (q.k converts half a chunk at a time: fewer live registers).
  using H = __m256i;
  static H prep(const bf16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static __m256 half0(H x) { return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)); }
  static __m256 half1(H x) {
    return _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static __m256 load8(const bf16_t* p) { return VecAvx2::cvt_load(p); }
};

struct SrcE4m3 {
  using C = fp8_e4m3_t;
  static constexpr bool kPermuted = false, kNanScan = true;
  static constexpr float kUnit = 256.f;
  // Sign-extended byte << 7: sign to bit 15, magnitude to bits 7-13 (bit 14, a sign copy,
  // masked off): the fp16 with E4M3's exponent and mantissa, i.e. value / 256.
  static __m256i half_bits(__m128i b16) {
    return _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b16), 7),
                            _mm256_set1_epi16(static_cast<short>(0xBF80)));
  }
  static void load16(const fp8_e4m3_t* p, __m256& a, __m256& b) {
    const __m256i h = half_bits(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    a = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    b = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  }
  using H = __m256i;
  static H prep(const fp8_e4m3_t* p) {
    return half_bits(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static __m256 half0(H h) { return _mm256_cvtph_ps(_mm256_castsi256_si128(h)); }
  static __m256 half1(H h) { return _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)); }
  static __m256 load8(const fp8_e4m3_t* p) {
    const __m256i h = half_bits(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  }
  // Whether rows [0, n) (stride st, D bytes each) hold an E4M3 NaN (magnitude 0x7f):
  // max over (byte | 0x80) reaches 0xff exactly then.
  static bool any_nan(const fp8_e4m3_t* rows, int64_t st, int n, int D) {
    const auto* s = reinterpret_cast<const uint8_t*>(rows);
    const __m256i top = _mm256_set1_epi8(static_cast<char>(0x80));
    __m256i mx = _mm256_setzero_si256();
    __m128i mx8 = _mm_setzero_si128();
    for (int r = 0; r < n; ++r, s += st) {
      int d = 0;
      for (; d + 32 <= D; d += 32)
        mx = _mm256_max_epu8(mx, _mm256_or_si256(
                                     _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + d)), top));
      for (; d < D; d += 8)
        mx8 = _mm_max_epu8(mx8, _mm_or_si128(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + d)),
                                             _mm256_castsi256_si128(top)));
    }
    const __m256i all = _mm256_max_epu8(mx, _mm256_castsi128_si256(mx8));  // upper half: mx's
    const __m256i ff = _mm256_cmpeq_epi8(all, _mm256_set1_epi8(static_cast<char>(0xFF)));
    return _mm256_movemask_epi8(ff) != 0 || _mm_movemask_epi8(_mm_cmpeq_epi8(
                                                 mx8, _mm_set1_epi8(static_cast<char>(0xFF)))) != 0;
  }
};

struct SrcE5m2 {
  using C = fp8_e5m2_t;
  static constexpr bool kPermuted = false, kNanScan = false;
  static constexpr float kUnit = 1.f;
  // The byte is the top half of an fp16 (inf and NaN included): F16C converts it exactly.
  static void load16(const fp8_e5m2_t* p, __m256& a, __m256& b) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i z = _mm_setzero_si128();
    a = _mm256_cvtph_ps(_mm_unpacklo_epi8(z, x));
    b = _mm256_cvtph_ps(_mm_unpackhi_epi8(z, x));
  }
  using H = __m128i;
  static H prep(const fp8_e5m2_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
  static __m256 half0(H x) { return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), x)); }
  static __m256 half1(H x) { return _mm256_cvtph_ps(_mm_unpackhi_epi8(_mm_setzero_si128(), x)); }
  static __m256 load8(const fp8_e5m2_t* p) {
    return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(),
                                             _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  };

template <class C>
struct SrcOf;
template <>
struct SrcOf<bf16_t> { using type = SrcBf16; };
template <>
struct SrcOf<fp8_e4m3_t> { using type = SrcE4m3; };
template <>
struct SrcOf<fp8_e5m2_t> { using type = SrcE5m2; };

// Rows [0, n) of an E4M3 cache (stride st) decoded exactly into dst [n, D], divided by
// SrcE4m3::kUnit so they read like SrcE4m3's vectors, NaN kept: the path of blocks that
// hold a NaN.
inline void e4m3_to_float_rows(const fp8_e4m3_t* src, int64_t st, float* dst, int n, int D) {
  for (int r = 0; r < n; ++r)
    for (int d = 0; d < D; ++d)
      dst[r * D + d] = fp8_decode<Fp8E4m3>(src[r * st + d].bits) * (1.f / SrcE4m3::kUnit);
}

// One chunk layout for q and the accumulators: chunk c of 16 dims at [16c, 16c + 16) holds
// S's order; a trailing 8 (head sizes 8 mod 16) is natural.
template <class S>
inline void to_layout(const float* x, float* y, int D) {
  int d = 0;
  for (; d + 16 <= D; d += 16)
    for (int i = 0; i < 8; ++i) {
      y[d + i] = S::kPermuted ? x[d + 2 * i] : x[d + i];
      y[d + 8 + i] = S::kPermuted ? x[d + 2 * i + 1] : x[d + 8 + i];
    }
  for (; d < D; ++d) y[d] = x[d];
}
template <class S>
inline void from_layout(const float* y, float* x, int D) {
  int d = 0;
  for (; d + 16 <= D; d += 16)
    for (int i = 0; i < 8; ++i) {
      x[S::kPermuted ? d + 2 * i : d + i] = y[d + i];
      x[S::kPermuted ? d + 2 * i + 1 : d + 8 + i] = y[d + 8 + i];
    }
  for (; d < D; ++d) x[d] = y[d];
}

// Keeps x in a register: GCC would otherwise fold the load of a q vector into each of the
// KB FMAs that use it (one load per FMA: q.k became load-bound, 18 loads per 16 FMAs).
inline void in_register(__m256& x) { asm("" : "+x"(x)); }

// q.k of up to 8 query rows against a group of 8 keys, all rows per pass over the keys.
template <class T, class C>
struct QkAvx2 {
  using S = typename SrcOf<C>::type;
  using QElem = float;
  using V = __m256;
  static constexpr int kMaxD = static_cast<int>(kMaxHeadSize);

  static void pack(const T* src, QElem* dst, int D) {
    alignas(32) float tmp[kMaxD];
    for (int d = 0; d < D; d += 8)
      _mm256_store_ps(tmp + d, _mm256_mul_ps(VecAvx2::cvt_load(src + d), _mm256_set1_ps(S::kUnit)));
    to_layout<S>(tmp, dst, D);
  }

  // Rows [0, RB) x keys [0, 8), KB keys per pass (RB * KB <= 8 accumulators, each taking
  // both halves of a chunk): S[r * lds + i] = q_r . k_i, via one lane reduction per row.
  template <class Src, int RB, int KB>
  static void tile(const float* q, const typename Src::C* k, int64_t kst, int D, float* out,
                   int lds, PrefetchCursor& pf) {
    V res[RB][8];
    for (int k0 = 0; k0 < 8; k0 += KB) {
      pf.tick();
      V x[RB][KB];
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
        for (int i = 0; i < KB; ++i) x[r][i] = _mm256_setzero_ps();
      const auto* kr = k + k0 * kst;
      int d = 0;
      for (; d + 16 <= D; d += 16) {
        typename Src::H h[KB];
        V kv[KB];
#pragma GCC unroll 8
        for (int i = 0; i < KB; ++i) h[i] = Src::prep(kr + i * kst + d);
#pragma GCC unroll 8
        for (int i = 0; i < KB; ++i) kv[i] = Src::half0(h[i]);
#pragma GCC unroll 8
        for (int r = 0; r < RB; ++r) {
          V qa = _mm256_loadu_ps(q + r * D + d);
          in_register(qa);
#pragma GCC unroll 8
          for (int i = 0; i < KB; ++i) x[r][i] = _mm256_fmadd_ps(qa, kv[i], x[r][i]);
        }
#pragma GCC unroll 8
        for (int i = 0; i < KB; ++i) kv[i] = Src::half1(h[i]);
#pragma GCC unroll 8
        for (int r = 0; r < RB; ++r) {
          V qb = _mm256_loadu_ps(q + r * D + d + 8);
          in_register(qb);
#pragma GCC unroll 8
          for (int i = 0; i < KB; ++i) x[r][i] = _mm256_fmadd_ps(qb, kv[i], x[r][i]);
        }
      }
      if (d < D) {  // 8 dims left
        V ka[KB];
#pragma GCC unroll 8
        for (int i = 0; i < KB; ++i) ka[i] = Src::load8(kr + i * kst + d);
#pragma GCC unroll 8
        for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
          for (int i = 0; i < KB; ++i) x[r][i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * D + d), ka[i], x[r][i]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
        for (int i = 0; i < KB; ++i) res[r][k0 + i] = x[r][i];
    }
    for (int r = 0; r < RB; ++r) _mm256_storeu_ps(out + r * lds, VecAvx2::reduce_lanes(res[r]));
  }

  template <class Src>
  static void rows(const float* q, int R, const typename Src::C* k, int64_t kst, int D,
                   float* out, int lds, PrefetchCursor& pf) {
    int r = 0;
    for (; r + 8 <= R; r += 8) tile<Src, 8, 1>(q + r * D, k, kst, D, out + r * lds, lds, pf);
    switch (R - r) {
      case 7: return tile<Src, 7, 1>(q + r * D, k, kst, D, out + r * lds, lds, pf);
      case 6: return tile<Src, 6, 1>(q + r * D, k, kst, D, out + r * lds, lds, pf);
      case 5: return tile<Src, 5, 1>(q + r * D, k, kst, D, out + r * lds, lds, pf);
      case 4: return tile<Src, 4, 2>(q + r * D, k, kst, D, out + r * lds, lds, pf);
      case 3: return tile<Src, 3, 2>(q + r * D, k, kst, D, out + r * lds, lds, pf);
      case 2: return tile<Src, 2, 4>(q + r * D, k, kst, D, out + r * lds, lds, pf);
      case 1: return tile<Src, 1, 8>(q + r * D, k, kst, D, out + r * lds, lds, pf);
      default: return;
    }
  }
  static int tile_ticks(int rb) { return rb >= 5 ? 8 : rb >= 3 ? 4 : rb == 2 ? 2 : 1; }

  // The AttnKernel::qk hook: scores of rows [0, R) (q rows D apart) against the W = 8 keys
  // at k into out[r * lds + 0..8).
  static void dot_rows(const float* q, int R, const C* k, int64_t kst, int D, float* out,
                       int lds, PrefetchCursor& pf) {
    if constexpr (S::kNanScan) {
      if (S::any_nan(k, kst, 8, D)) {
        alignas(32) float kf[8 * kMaxD];
        e4m3_to_float_rows(k, kst, kf, 8, D);
        return rows<SrcF32>(q, R, kf, D, D, out, lds, pf);
      }
    }
    rows<S>(q, R, k, kst, D, out, lds, pf);
  }
  // Ticks of dot_rows for rows [0, R) over the key groups covering [t0, t1).
  static int rows_ticks(int R, int t0, int t1) {
    const int groups = (t1 - t0 / 8 * 8 + 7) / 8;
    return groups * (R / 8 * 8 + (R % 8 ? tile_ticks(R % 8) : 0));
  }
};

// acc[r] += P[r] . V over keys [t0, t1): RB rows x NC 16-dim chunks of accumulators in
// registers (8 of them), each value chunk converted once for all RB rows.
template <class C, class T>
struct PvAvx2 {
  using S = typename SrcOf<C>::type;
  using V = __m256;
  static constexpr int kMaxD = static_cast<int>(kMaxHeadSize);

  static void finish_row(float* acc, int D) {
    alignas(32) float tmp[kMaxD];
    from_layout<S>(acc, tmp, D);
    const V u = _mm256_set1_ps(S::kUnit);
    for (int d = 0; d < D; d += 8) _mm256_storeu_ps(acc + d, _mm256_mul_ps(_mm256_load_ps(tmp + d), u));
  }

  // NC chunks of 16 dims from d (NC == 0: the 8-dim tail at d).
  template <class Src, int RB, int NC>
  static void tile(const float* P, int lds, const typename Src::C* vb, int64_t vst, int n,
                   float* acc, int D, int d, PrefetchCursor& pf) {
    constexpr int NV = NC == 0 ? 1 : 2 * NC;
    V a[RB][NV];
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) a[r][j] = _mm256_loadu_ps(acc + r * D + d + 8 * j);
    const auto* vt = vb + d;
    for (int t = 0; t < n; ++t, vt += vst) {
      pf.tick();
      V v[NV];
      if (NC == 0) {
        v[0] = Src::load8(vt);
      } else {
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) Src::load16(vt + 16 * c, v[2 * c], v[2 * c + 1]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) {
        const V p = _mm256_broadcast_ss(P + r * lds + t);
#pragma GCC unroll 8
        for (int j = 0; j < NV; ++j) a[r][j] = _mm256_fmadd_ps(p, v[j], a[r][j]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) _mm256_storeu_ps(acc + r * D + d + 8 * j, a[r][j]);
  }

  template <class Src, int RB, int NC>
  static void row_tile(const float* P, int lds, const typename Src::C* vb, int64_t vst, int n,
                       float* acc, int D, PrefetchCursor& pf) {
    int d = 0;
    for (; d + 16 * NC <= D; d += 16 * NC) tile<Src, RB, NC>(P, lds, vb, vst, n, acc, D, d, pf);
    for (; d + 16 <= D; d += 16) tile<Src, RB, 1>(P, lds, vb, vst, n, acc, D, d, pf);
    if (d < D) tile<Src, RB, 0>(P, lds, vb, vst, n, acc, D, d, pf);
  }
  static int row_tile_ticks(int rb, int D) {
    const int nc = rb >= 3 ? 1 : rb == 2 ? 2 : 4;
    return D / (16 * nc) + D % (16 * nc) / 16 + D % 16 / 8;
  }

  // P and V start at key t0 here; n keys.
  template <class Src>
  static void run(const float* P, int lds, int R, const typename Src::C* vb, int64_t vst, int n,
                  float* acc, int D, PrefetchCursor& pf) {
    int r = 0;
    for (; r + 4 <= R; r += 4) row_tile<Src, 4, 1>(P + r * lds, lds, vb, vst, n, acc + r * D, D, pf);
    switch (R - r) {
      case 3: return row_tile<Src, 3, 1>(P + r * lds, lds, vb, vst, n, acc + r * D, D, pf);
      case 2: return row_tile<Src, 2, 2>(P + r * lds, lds, vb, vst, n, acc + r * D, D, pf);
      case 1: return row_tile<Src, 1, 4>(P + r * lds, lds, vb, vst, n, acc + r * D, D, pf);
      default: return;
    }
  }

  static void pv(const float* P, int lds, int R, const C* vb, int64_t vst, int t0, int t1,
                 float* acc, int D, PrefetchCursor& pf) {
    if (t1 <= t0) return;
    if constexpr (S::kNanScan) {
      if (S::any_nan(vb + t0 * vst, vst, t1 - t0, D)) {
        constexpr int kChunk = 16;
        alignas(32) float vf[kChunk * kMaxD];
        for (int t = t0; t < t1; t += kChunk) {
          const int n = std::min(kChunk, t1 - t);
          e4m3_to_float_rows(vb + t * vst, vst, vf, n, D);
          PrefetchCursor none;  // the chunks' ticks would not add up to ticks(): skip them
          run<SrcF32>(P + t, lds, R, vf, D, n, acc, D, none);
        }
        return;
      }
    }
    run<S>(P + t0, lds, R, vb + t0 * vst, vst, t1 - t0, acc, D, pf);
  }
  static int ticks(int R, int t0, int t1, int D) {
    const int tiles = R / 4 * row_tile_ticks(4, D) + (R % 4 ? row_tile_ticks(R % 4, D) : 0);
    return tiles * (t1 - t0);
  }
};

template <class T>
struct Qk<VecAvx2, T, bf16_t> : QkAvx2<T, bf16_t> {};
template <class T>
struct Qk<VecAvx2, T, fp8_e4m3_t> : QkAvx2<T, fp8_e4m3_t> {};
template <class T>
struct Qk<VecAvx2, T, fp8_e5m2_t> : QkAvx2<T, fp8_e5m2_t> {};
template <class T>
struct Pv<VecAvx2, bf16_t, T> : PvAvx2<bf16_t, T> {};
template <class T>
struct Pv<VecAvx2, fp8_e4m3_t, T> : PvAvx2<fp8_e4m3_t, T> {};
template <class T>
struct Pv<VecAvx2, fp8_e5m2_t, T> : PvAvx2<fp8_e5m2_t, T> {};
// fp8 blocks are read in place here (no decoded fp32 copy per step).
template <class C>
struct InPlaceCache {
  using E = C;
  static constexpr bool kActive = false;
  static void rows(const C*, int64_t, E*, int, int) {}
};
template <class T>
struct CacheConvert<VecAvx2, T, fp8_e4m3_t> : InPlaceCache<fp8_e4m3_t> {};
template <class T>
struct CacheConvert<VecAvx2, T, fp8_e5m2_t> : InPlaceCache<fp8_e5m2_t> {};
