// AVX-512 kernels with AVX512-BF16: bf16 q.k uses vdpbf16ps (exact bf16 products, fp32 sums).
#if defined(__x86_64__)
#include <immintrin.h>

#include "kernel_tu_includes.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
namespace pagedattn {
namespace {
#include "vec_scalar.h"
#define PAGEDATTN_AVX512_BF16_CONVERT 1  // vec_avx512.h: bf16 stores in one instruction
#include "vec_avx512.h"
#include "vec_avx2.h"
#include "attn_kernel_impl.h"
#include "matrix_avx2.h"
#include "matrix_avx512.h"
template <>
inline void ProbVecAvx512<true>::store_bf16_pair(bf16_t* dst, __m512 lo, __m512 hi) {
  _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}
template <>
struct ProbVec<VecAvx512> : ProbVecAvx512<true> {};
#include "model_kernels_impl.h"
#include "linear_dpbf16_impl.h"

// bf16 words of a key/value row for the vdpbf16ps kernels below: 32 at a time, or the
// first 16 (rest zero). Specialised for each cache type the kernels read.
template <class C>
struct Bf16Src;
template <>
struct Bf16Src<bf16_t> {
  static __m512i load32(const bf16_t* p) { return _mm512_loadu_si512(p); }
  static __m512i load16(const bf16_t* p) { return _mm512_maskz_loadu_epi16(0xFFFFu, p); }
};

#include "fp8_bf16_avx512.h"

template <>
struct CacheConvert<VecAvx512, bf16_t, fp8_e4m3_t> : Fp8ToBf16Rows<fp8_e4m3_t, kE4m3Bf16> {};
template <>
struct CacheConvert<VecAvx512, bf16_t, fp8_e5m2_t> : Fp8ToBf16Rows<fp8_e5m2_t, kE5m2Bf16> {};

// q.k: q stays bf16, vdpbf16ps multiplies 32 bf16 pairs exactly and sums in fp32.
// head_size is a multiple of 16, so a 16-element tail is loaded masked (zeros add nothing).
template <class C>
struct QkDp {
  using QElem = bf16_t;
  using Src = Bf16Src<C>;
  static void pack(const bf16_t* src, QElem* dst, int D) { std::memcpy(dst, src, D * sizeof(bf16_t)); }
  // NC full 32-element chunks (+ one 16-element tail, loaded masked: zeros add nothing).
  // Key chunks are loaded into __m512i values and cast at the vdpbf16ps: casting a load
  // expression in place made GCC 12 bounce every chunk through a stack slot (~15% slower).
  template <int NC, bool TAIL>
  static __m512i qchunk(const bf16_t* row, int c) {
    return TAIL && c == NC ? _mm512_maskz_loadu_epi16(0xFFFFu, row + 32 * c)
                           : _mm512_loadu_si512(row + 32 * c);
  }
  template <int NC, bool TAIL>
  static __m512i chunk(const C* row, int c) {
    return TAIL && c == NC ? Src::load16(row + 32 * c) : Src::load32(row + 32 * c);
  }
  template <int NC, bool TAIL>
  static __m512 group(const QElem* q, const C* k, int64_t kst, PrefetchCursor& pf) {
    constexpr int NQ = NC + (TAIL ? 1 : 0);
    __m512bh qv[NQ];
    for (int c = 0; c < NQ; ++c) qv[c] = (__m512bh)qchunk<NC, TAIL>(q, c);
    __m512 a[16];
    const C* kr = k;
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i, kr += kst) {
      pf.tick();
      __m512 acc = _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int c = 0; c < NQ; ++c) {
        const __m512i kv = chunk<NC, TAIL>(kr, c);
        acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)kv);
      }
      a[i] = acc;
    }
    return VecAvx512::reduce_lanes(a);
  }
  // Head sizes past 256: q chunks are read from memory (too many to keep in registers).
  static __m512 group_any(const QElem* q, const C* k, int64_t kst, int D, PrefetchCursor& pf) {
    const int nc = D / 32;
    __m512 a[16];
    const C* kr = k;
    for (int i = 0; i < 16; ++i, kr += kst) {
      pf.tick();
      __m512 acc = _mm512_setzero_ps();
      for (int c = 0; c < nc; ++c)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + 32 * c),
                               (__m512bh)Src::load32(kr + 32 * c));
      if (D % 32 != 0)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(0xFFFFu, q + 32 * nc),
                               (__m512bh)Src::load16(kr + 32 * nc));
      a[i] = acc;
    }
    return VecAvx512::reduce_lanes(a);
  }
  // Two rows x 16 keys, 8 keys at a time: each key chunk is loaded once for both rows
  // (half the loads of two group() calls). reduce_lanes of a[row * 8 + key] puts
  // (row, key) in lane row * 8 + key; the two halves are regrouped into one vector per row.
  template <int NC, bool TAIL>
  static void group2(const QElem* q0, const QElem* q1, const C* k, int64_t kst, float* s0,
                     float* s1, PrefetchCursor& pf) {
    constexpr int NQ = NC + (TAIL ? 1 : 0);
    __m512bh qa[NQ], qb[NQ];
    for (int c = 0; c < NQ; ++c) {
      qa[c] = (__m512bh)qchunk<NC, TAIL>(q0, c);
      qb[c] = (__m512bh)qchunk<NC, TAIL>(q1, c);
    }
    __m512 half[2];
    const C* kr = k;
    for (int h = 0; h < 2; ++h) {
      __m512 a[16];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i, kr += kst) {
        pf.tick();
        __m512 x = _mm512_setzero_ps(), y = _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int c = 0; c < NQ; ++c) {
          const __m512i kv = chunk<NC, TAIL>(kr, c);
          x = _mm512_dpbf16_ps(x, qa[c], (__m512bh)kv);
          y = _mm512_dpbf16_ps(y, qb[c], (__m512bh)kv);
        }
        a[i] = x;
        a[8 + i] = y;
      }
      half[h] = VecAvx512::reduce_lanes(a);
    }
    _mm512_storeu_ps(s0, _mm512_shuffle_f32x4(half[0], half[1], 0x44));
    _mm512_storeu_ps(s1, _mm512_shuffle_f32x4(half[0], half[1], 0xEE));
  }
  // Up to 128 dims both rows' q fit in registers next to the accumulators; beyond that
  // two single-row passes spill less.
  static void dot_group2(const QElem* q0, const QElem* q1, const C* k, int64_t kst, int D,
                         float* s0, float* s1, PrefetchCursor& pf) {
    switch (D) {
      case 32: return group2<1, false>(q0, q1, k, kst, s0, s1, pf);
      case 48: return group2<1, true>(q0, q1, k, kst, s0, s1, pf);
      case 64: return group2<2, false>(q0, q1, k, kst, s0, s1, pf);
      case 80: return group2<2, true>(q0, q1, k, kst, s0, s1, pf);
      case 96: return group2<3, false>(q0, q1, k, kst, s0, s1, pf);
      case 112: return group2<3, true>(q0, q1, k, kst, s0, s1, pf);
      case 128: return group2<4, false>(q0, q1, k, kst, s0, s1, pf);
      default:
        PrefetchCursor none;  // dot_group2 ticks 16 times in all, like one dot_group
        _mm512_storeu_ps(s0, dot_group(q0, k, kst, D, pf));
        _mm512_storeu_ps(s1, dot_group(q1, k, kst, D, none));
    }
  }
  static __m512 dot_group(const QElem* q, const C* k, int64_t kst, int D, PrefetchCursor& pf) {
    switch (D) {  // head sizes are multiples of 16 here (kernel_shapes.py; others go 8-wide)
      case 32: return group<1, false>(q, k, kst, pf);
      case 48: return group<1, true>(q, k, kst, pf);
      case 64: return group<2, false>(q, k, kst, pf);
      case 80: return group<2, true>(q, k, kst, pf);
      case 96: return group<3, false>(q, k, kst, pf);
      case 112: return group<3, true>(q, k, kst, pf);
      case 128: return group<4, false>(q, k, kst, pf);
      case 144: return group<4, true>(q, k, kst, pf);
      case 160: return group<5, false>(q, k, kst, pf);
      case 176: return group<5, true>(q, k, kst, pf);
      case 192: return group<6, false>(q, k, kst, pf);
      case 208: return group<6, true>(q, k, kst, pf);
      case 224: return group<7, false>(q, k, kst, pf);
      case 240: return group<7, true>(q, k, kst, pf);
      case 256: return group<8, false>(q, k, kst, pf);
      default: return group_any(q, k, kst, D, pf);
    }
  }
};
template <>
struct Qk<VecAvx512, bf16_t> : QkDp<bf16_t> {};

// P.V with vdpbf16ps: P is rounded to bf16 (relative error <= 2^-9 per weight, below the
// bf16 output rounding) and consecutive keys are paired: unpacklo/hi_epi16 of V[t], V[t+1]
// interleave them, so each fp32 accumulator lane gets p_t*v_t[d] + p_t1*v_t1[d]. The
// unpacks permute d inside each 32-wide chunk; finish_row undoes that once per item.
// Only for head_size % 32 == 0 (else the generic FMA path, unpermuted).
template <class C>
struct PvDp {
  using Base = PvGeneric<VecAvx512, C>;
  using Src = Bf16Src<C>;
  static constexpr int kMaxRows = 4;
  static constexpr int kMaxBlockKeys = static_cast<int>(kMaxBlockSize);

  static void finish_row(float* acc, int D) {
    if (D % 32 != 0) return;
    // chunk layout: lo = d {0-3, 8-11, 16-19, 24-27}, hi = d {4-7, 12-15, 20-23, 28-31}
    const __m512i idx0 = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i idx1 = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    for (int c = 0; c < D; c += 32) {
      const __m512 lo = _mm512_loadu_ps(acc + c), hi = _mm512_loadu_ps(acc + c + 16);
      _mm512_storeu_ps(acc + c, _mm512_permutex2var_ps(lo, idx0, hi));
      _mm512_storeu_ps(acc + c + 16, _mm512_permutex2var_ps(lo, idx1, hi));
    }
  }

  template <int RB, int NC>
  static void tile(const uint16_t* pb, int ldp, const C* vb, int64_t vst, int t0, int t1,
                   float* acc, int D, int c0, PrefetchCursor& pf) {
    __m512 a[RB][2 * NC];
    for (int i = 0; i < RB; ++i)
      for (int j = 0; j < 2 * NC; ++j) a[i][j] = _mm512_loadu_ps(acc + i * D + c0 + 16 * j);
    int t = t0;
    for (; t + 1 < t1; t += 2) {
      pf.tick();
      __m512i v[2 * NC];
#pragma GCC unroll 4
      for (int j = 0; j < NC; ++j) {
        const __m512i x = Src::load32(vb + t * vst + c0 + 32 * j);
        const __m512i y = Src::load32(vb + (t + 1) * vst + c0 + 32 * j);
        v[2 * j] = _mm512_unpacklo_epi16(x, y);
        v[2 * j + 1] = _mm512_unpackhi_epi16(x, y);
      }
#pragma GCC unroll 4
      for (int i = 0; i < RB; ++i) {
        int32_t pair;
        std::memcpy(&pair, pb + i * ldp + t, 4);
        const __m512bh pv = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 8
        for (int j = 0; j < 2 * NC; ++j) a[i][j] = _mm512_dpbf16_ps(a[i][j], (__m512bh)v[j], pv);
      }
    }
    if (t < t1) {  // odd tail: pair with zeros (never read the key past t1: may be NaN)
      pf.tick();
      __m512i v[2 * NC];
      const __m512i z = _mm512_setzero_si512();
      for (int j = 0; j < NC; ++j) {
        const __m512i x = Src::load32(vb + t * vst + c0 + 32 * j);
        v[2 * j] = _mm512_unpacklo_epi16(x, z);
        v[2 * j + 1] = _mm512_unpackhi_epi16(x, z);
      }
      for (int i = 0; i < RB; ++i) {
        const __m512bh pv = (__m512bh)_mm512_set1_epi32(pb[i * ldp + t]);
        for (int j = 0; j < 2 * NC; ++j) a[i][j] = _mm512_dpbf16_ps(a[i][j], (__m512bh)v[j], pv);
      }
    }
    for (int i = 0; i < RB; ++i)
      for (int j = 0; j < 2 * NC; ++j) _mm512_storeu_ps(acc + i * D + c0 + 16 * j, a[i][j]);
  }

  template <int RB>
  static void rows(const uint16_t* pb, int ldp, const C* vb, int64_t vst, int t0, int t1,
                   float* acc, int D, PrefetchCursor& pf) {
    int c = 0;
    for (; c + 64 <= D; c += 64) tile<RB, 2>(pb, ldp, vb, vst, t0, t1, acc, D, c, pf);
    if (c < D) tile<RB, 1>(pb, ldp, vb, vst, t0, t1, acc, D, c, pf);
  }

  static int ticks(int R, int t0, int t1, int D) {
    if (D % 32 != 0) return Base::ticks(R, t0, t1, D);
    return (R + kMaxRows - 1) / kMaxRows * ((D + 63) / 64) * ((t1 - t0 + 1) / 2);
  }

  static void pv(const float* P, int lds, int R, const C* vb, int64_t vst, int t0, int t1,
                 float* acc, int D, PrefetchCursor& pf) {
    if (D % 32 != 0) return Base::pv(P, lds, R, vb, vst, t0, t1, acc, D, pf);
    // P rows -> bf16 (round to nearest even), 4 rows at a time on the stack.
    constexpr int ldp = kMaxBlockKeys + 32;
    alignas(64) uint16_t pb[kMaxRows * ldp];
    for (int r0 = 0; r0 < R; r0 += kMaxRows) {
      const int nr = std::min(kMaxRows, R - r0);
      for (int i = 0; i < nr; ++i) {
        const float* src = P + (r0 + i) * lds;
        for (int t = t0 / 16 * 16; t < t1; t += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + i * ldp + t),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + t)));
      }
      float* a = acc + r0 * D;
      switch (nr) {
        case 4: rows<4>(pb, ldp, vb, vst, t0, t1, a, D, pf); break;
        case 3: rows<3>(pb, ldp, vb, vst, t0, t1, a, D, pf); break;
        case 2: rows<2>(pb, ldp, vb, vst, t0, t1, a, D, pf); break;
        default: rows<1>(pb, ldp, vb, vst, t0, t1, a, D, pf); break;
      }
    }
  }
};
template <>
struct Pv<VecAvx512, bf16_t> : PvDp<bf16_t> {};
#include "prefill_lanes_avx512.h"
template <>
struct PrefillItem<VecAvx512, bf16_t> : LanesPrefill<bf16_t> {};
template <>
struct PrefillItem<VecAvx512, float> : LanesPrefill<float> {};
}  // namespace

const KernelTable* kernels_avx512bf16() {
  static const KernelTable table = [] {
    KernelTable t = make_isa_kernel_table<VecAvx512, VecAvx2>("avx512bf16");
    t.linear_dpbf16_round = &linear_dp_round_rows;
    t.linear_dpbf16_block = &linear_dpbf16_block;
    return t;
  }();
  return &table;
}

}  // namespace pagedattn
#pragma GCC pop_options
#endif
