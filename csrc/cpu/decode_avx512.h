// AVX-512 (no BF16) q.k and P.V for bf16 caches, read in place: one 64-byte load holds 32
// cache values, and a shift and an and turn it into two fp32 vectors (lane i: dims 2i and
// 2i + 1 of the chunk), a uop per 16 values instead of the generic widen-then-shift's two.
// Each converted key/value chunk feeds every query row of the tile (up to 8 rows for q.k,
// 4 for P.V), so a GQA group converts each K/V element once (the generic dot_group2
// converts it once per pair of rows). q is packed and P.V accumulates in that chunk
// layout; finish_row puts the dims back in order. The same design as decode_avx2.h's bf16
// source, at twice the width. Included by kernels_avx512.cpp after attn_kernel_impl.h
// (inside its anonymous namespace, under its target pragma). Measured: docs/performance.md
// ("AVX-512 decode").
//
// Chunk layout (q, accumulators): chunk c of 32 dims at [32c, 32c + 32) holds the even
// dims, then the odd ones; a trailing 16 (head sizes 16 mod 32) is natural.

struct Bf16x32 {
  static __m512i load(const bf16_t* p) { return _mm512_loadu_si512(p); }
  static __m512 even(__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }
  static __m512 odd(__m512i x) {
    return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  // Natural [a | b] (dims 0-15, 16-31) <-> layout [even | odd].
  static void to_layout(__m512 a, __m512 b, float* y) {
    const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i io = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    _mm512_storeu_ps(y, _mm512_permutex2var_ps(a, ie, b));
    _mm512_storeu_ps(y + 16, _mm512_permutex2var_ps(a, io, b));
  }
  static void from_layout(__m512 e, __m512 o, float* x) {
    const __m512i il = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i ih = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    _mm512_storeu_ps(x, _mm512_permutex2var_ps(e, il, o));
    _mm512_storeu_ps(x + 16, _mm512_permutex2var_ps(e, ih, o));
  }
};

// Keeps x in a register: GCC would otherwise fold the load of a q vector into each FMA
// that uses it (one load per FMA).
inline void in_zmm(__m512& x) { asm("" : "+v"(x)); }

// q.k of up to 8 query rows against a group of 16 keys, all rows per pass over the keys.
template <class T>
struct QkBf16Avx512 {
  using QElem = float;
  using V = __m512;

  static void pack(const T* src, QElem* dst, int D) {
    int d = 0;
    for (; d + 32 <= D; d += 32)
      Bf16x32::to_layout(VecAvx512::cvt_load(src + d), VecAvx512::cvt_load(src + d + 16), dst + d);
    if (d < D) _mm512_storeu_ps(dst + d, VecAvx512::cvt_load(src + d));
  }

  // Rows [0, RB) x keys [0, 16), KB keys per pass (RB * KB <= 16 accumulators):
  // out[r * lds + i] = q_r . k_i, via one lane reduction per row.
  template <int RB, int KB>
  static void tile(const float* q, const bf16_t* k, int64_t kst, int D, float* out, int lds,
                   PrefetchCursor& pf) {
    V res[RB][16];
    for (int k0 = 0; k0 < 16; k0 += KB) {
      // One tick per key, as the generic kernels do: the next step's lines arrive at an
      // even pace (one tick per pass left 4-line bursts, B1 on 2 threads ~5-10% slower).
#pragma GCC unroll 16
      for (int i = 0; i < KB; ++i) pf.tick();
      V x[RB][KB];
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r)
#pragma GCC unroll 16
        for (int i = 0; i < KB; ++i) x[r][i] = _mm512_setzero_ps();
      const bf16_t* kr = k + k0 * kst;
      int d = 0;
      for (; d + 32 <= D; d += 32) {
        __m512i h[KB];
        V kv[KB];
#pragma GCC unroll 16
        for (int i = 0; i < KB; ++i) h[i] = Bf16x32::load(kr + i * kst + d);
#pragma GCC unroll 16
        for (int i = 0; i < KB; ++i) kv[i] = Bf16x32::even(h[i]);
#pragma GCC unroll 8
        for (int r = 0; r < RB; ++r) {
          V qa = _mm512_loadu_ps(q + r * D + d);
          in_zmm(qa);
#pragma GCC unroll 16
          for (int i = 0; i < KB; ++i) x[r][i] = _mm512_fmadd_ps(qa, kv[i], x[r][i]);
        }
#pragma GCC unroll 16
        for (int i = 0; i < KB; ++i) kv[i] = Bf16x32::odd(h[i]);
#pragma GCC unroll 8
        for (int r = 0; r < RB; ++r) {
          V qb = _mm512_loadu_ps(q + r * D + d + 16);
          in_zmm(qb);
#pragma GCC unroll 16
          for (int i = 0; i < KB; ++i) x[r][i] = _mm512_fmadd_ps(qb, kv[i], x[r][i]);
        }
      }
      if (d < D) {  // 16 dims left, natural order
        V ka[KB];
#pragma GCC unroll 16
        for (int i = 0; i < KB; ++i) ka[i] = VecAvx512::cvt_load(kr + i * kst + d);
#pragma GCC unroll 8
        for (int r = 0; r < RB; ++r) {
          const V qv = _mm512_loadu_ps(q + r * D + d);
#pragma GCC unroll 16
          for (int i = 0; i < KB; ++i) x[r][i] = _mm512_fmadd_ps(qv, ka[i], x[r][i]);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r)
#pragma GCC unroll 16
        for (int i = 0; i < KB; ++i) res[r][k0 + i] = x[r][i];
    }
    for (int r = 0; r < RB; ++r) _mm512_storeu_ps(out + r * lds, VecAvx512::reduce_lanes(res[r]));
  }

  // The AttnKernel::qk hook: scores of rows [0, R) (q rows D apart) against the W = 16
  // keys at k into out[r * lds + 0..16).
  static void dot_rows(const float* q, int R, const bf16_t* k, int64_t kst, int D, float* out,
                       int lds, PrefetchCursor& pf) {
    int r = 0;
    for (; r + 8 <= R; r += 8) tile<8, 2>(q + r * D, k, kst, D, out + r * lds, lds, pf);
    q += r * D;
    out += r * lds;
    switch (R - r) {
      case 7: return tile<7, 2>(q, k, kst, D, out, lds, pf);
      case 6: return tile<6, 2>(q, k, kst, D, out, lds, pf);
      case 5: return tile<5, 2>(q, k, kst, D, out, lds, pf);
      case 4: return tile<4, 4>(q, k, kst, D, out, lds, pf);
      case 3: return tile<3, 4>(q, k, kst, D, out, lds, pf);
      case 2: return tile<2, 8>(q, k, kst, D, out, lds, pf);
      case 1: return tile<1, 8>(q, k, kst, D, out, lds, pf);
      default: return;
    }
  }
  // Ticks of dot_rows for rows [0, R) over the key groups covering [t0, t1).
  static int rows_ticks(int R, int t0, int t1) {
    const int groups = (t1 - t0 / 16 * 16 + 15) / 16;
    return groups * 16 * ((R + 7) / 8);
  }
};

// acc[r] += P[r] . V over keys [t0, t1): RB rows x NC 32-dim chunks of accumulators in
// registers (16 of them), each value chunk converted once for all RB rows.
template <class T>
struct PvBf16Avx512 {
  using V = __m512;

  static void finish_row(float* acc, int D) {
    for (int d = 0; d + 32 <= D; d += 32)
      Bf16x32::from_layout(_mm512_loadu_ps(acc + d), _mm512_loadu_ps(acc + d + 16), acc + d);
  }

  // NC chunks of 32 dims from d (NC == 0: the 16-dim tail at d).
  template <int RB, int NC>
  static void tile(const float* P, int lds, const bf16_t* vb, int64_t vst, int n, float* acc,
                   int D, int d, PrefetchCursor& pf) {
    constexpr int NV = NC == 0 ? 1 : 2 * NC;
    V a[RB][NV];
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) a[r][j] = _mm512_loadu_ps(acc + r * D + d + 16 * j);
    const bf16_t* vt = vb + d;
    for (int t = 0; t < n; ++t, vt += vst) {
      pf.tick();
      V v[NV];
      if (NC == 0) {
        v[0] = VecAvx512::cvt_load(vt);
      } else {
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) {
          const __m512i h = Bf16x32::load(vt + 32 * c);
          v[2 * c] = Bf16x32::even(h);
          v[2 * c + 1] = Bf16x32::odd(h);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) {
        const V p = _mm512_set1_ps(P[r * lds + t]);
#pragma GCC unroll 8
        for (int j = 0; j < NV; ++j) a[r][j] = _mm512_fmadd_ps(p, v[j], a[r][j]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + r * D + d + 16 * j, a[r][j]);
  }

  template <int RB, int NC>
  static void row_tile(const float* P, int lds, const bf16_t* vb, int64_t vst, int n,
                       float* acc, int D, PrefetchCursor& pf) {
    int d = 0;
    for (; d + 32 * NC <= D; d += 32 * NC) tile<RB, NC>(P, lds, vb, vst, n, acc, D, d, pf);
    for (; d + 32 <= D; d += 32) tile<RB, 1>(P, lds, vb, vst, n, acc, D, d, pf);
    if (d < D) tile<RB, 0>(P, lds, vb, vst, n, acc, D, d, pf);
  }
  static int row_tile_ticks(int rb, int D) {
    const int nc = rb >= 3 ? 2 : 4;
    return D / (32 * nc) + D % (32 * nc) / 32 + D % 32 / 16;
  }

  static void pv(const float* P, int lds, int R, const bf16_t* vb, int64_t vst, int t0, int t1,
                 float* acc, int D, PrefetchCursor& pf) {
    if (t1 <= t0) return;
    P += t0;
    vb += t0 * vst;
    const int n = t1 - t0;
    int r = 0;
    for (; r + 4 <= R; r += 4) row_tile<4, 2>(P + r * lds, lds, vb, vst, n, acc + r * D, D, pf);
    P += r * lds;
    acc += r * D;
    switch (R - r) {
      case 3: return row_tile<3, 2>(P, lds, vb, vst, n, acc, D, pf);
      case 2: return row_tile<2, 4>(P, lds, vb, vst, n, acc, D, pf);
      case 1: return row_tile<1, 4>(P, lds, vb, vst, n, acc, D, pf);
      default: return;
    }
  }
  static int ticks(int R, int t0, int t1, int D) {
    const int tiles = R / 4 * row_tile_ticks(4, D) + (R % 4 ? row_tile_ticks(R % 4, D) : 0);
    return tiles * (t1 - t0);
  }
};

template <>
struct Qk<VecAvx512, bf16_t, bf16_t> : QkBf16Avx512<bf16_t> {};
template <>
struct Pv<VecAvx512, bf16_t, bf16_t> : PvBf16Avx512<bf16_t> {};
