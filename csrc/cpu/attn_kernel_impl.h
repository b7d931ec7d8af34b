

// The paged-attention kernel template, written once over a vector-ops struct `VO`
// (VecPortable / VecAvx2 / VecAvx512 / VecNeon). Each kernels_<isa>.cpp includes the standard
// headers (kernel_tu_includes.h), then (under its #pragma GCC target) opens an anonymous
// namespace and includes its vec header and this file, so every ISA gets private copies of
// everything here.
//
// Work item = (request, kv head, query-token tile, key range). Rows of the tile are
// row = token * G + g for the G query heads sharing the kv head, so each K/V block is
// streamed once for the whole GQA group (and all tokens of a short spec-decode query).
// Per key block:  S = Q.K^T (fp32) -> scale, softcap, ALiBi, mask -> online softmax
// (running max m, sum l, rescaled accumulators; online_softmax.h) -> acc += P.V.

// Decode items stream each K/V block once per GQA group with software prefetch a step
// ahead and page touches further ahead; prefill items of >= 16 rows (8 on AVX2) take the
// rows-in-lanes kernels of prefill_lanes_avx512.h / prefill_lanes_avx2.h. Measurements,
// profiles and what was tried: docs/performance.md.

#include "online_softmax.h"  // kNegInf, softcap_scores, the softmax step

// Whether every row r < R sees all keys [a, b] (its visible range [lo[r], hi[r]] covers it).
template <class I>
inline bool every_row_sees(const I* lo, const I* hi, int R, int64_t a, int64_t b) {
  for (int r = 0; r < R; ++r)
    if (lo[r] > a || hi[r] < b) return false;
  return true;
}

// Whether V rows [t0, t1) of a block hold a NaN or inf. Kernels that share one P.V over
// rows with different visible keys give a key a row cannot see weight 0, and 0 * NaN =
// NaN: blocks where the rows differ check this and then sum each row's own keys only.
template <class T>
inline bool rows_have_nonfinite(const T* v, int64_t vst, int t0, int t1, int D) {
  bool bad = false;
  for (int t = t0; t < t1; ++t)
    for (int d = 0; d < D; ++d) bad |= !std::isfinite(VecScalar::cvt_load(v + t * vst + d));
  return bad;
}

// Walks the cache lines of one K block and one V block (a step ahead), issuing
// `per_tick` prefetches at each tick. The q.k and P.V loops tick at an even pace through a
// step, so the next step's lines are requested at the rate this one's are consumed: per
// core only a couple of dozen misses can be outstanding, and bursts of prefetches stall on
// them (a 256-line burst per step ran ~15% slower than the same lines spread out).
struct PrefetchCursor {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t k_left = 0, v_left = 0;  // bytes
  int per_tick = 0;
  int lines() const { return static_cast<int>((k_left + v_left + 63) / 64); }
  void issue(int n) {
    for (; n > 0 && k_left > 0; --n, k += 64, k_left -= 64) prefetch_l2(k);
    for (; n > 0 && v_left > 0; --n, v += 64, v_left -= 64) prefetch_l2(v);
  }
  void tick() { issue(per_tick); }
  // One line in each 4 KiB page of the K and V ranges.
  void touch_pages() const {
    touch_range(k, k_left);
    touch_range(v, v_left);
  }
  static void touch_range(const char* p, int64_t bytes) {
    if (bytes <= 0) return;
    prefetch_l2(p);
    const uintptr_t start = reinterpret_cast<uintptr_t>(p);
    for (uintptr_t a = (start | 4095) + 1; a < start + bytes; a += 4096)
      prefetch_l2(reinterpret_cast<const char*>(a));
  }
  // Spreads what is left over `ticks` ticks.
  void pace(int ticks) { per_tick = ticks > 0 ? (lines() + ticks - 1) / ticks : lines(); }
};

// Scores of one query row against W consecutive keys (lane i = key i); the generic path
// converts to fp32 and FMAs, then folds the W partial-sum vectors with one reduce_lanes.
// dot_group and dot_group2 each tick the prefetch cursor once per key row (W ticks).
// T: query type, C: cache type (T, or an fp8 format converted to fp32 by VO::cvt_load).
template <class VO, class T, class C = T>
struct QkGeneric {
  using QElem = float;
  using V = typename VO::V;
  static void pack(const T* src, QElem* dst, int D) {
    for (int d = 0; d < D; d += VO::W) VO::store(dst + d, VO::cvt_load(src + d));
  }
  static V dot(const QElem* q, const C* k, int64_t kst, int D) {
    V a[VO::W];
    for (int i = 0; i < VO::W; ++i) a[i] = VO::zero();
    for (int d = 0; d < D; d += VO::W) {
      const V qv = VO::load(q + d);
#pragma GCC unroll 16
      for (int i = 0; i < VO::W; ++i) a[i] = VO::fma(qv, VO::cvt_load(k + i * kst + d), a[i]);
    }
    return VO::reduce_lanes(a);
  }
  static V dot_group(const QElem* q, const C* k, int64_t kst, int D, PrefetchCursor& pf) {
    for (int i = 0; i < VO::W; ++i) pf.tick();
    return dot(q, k, kst, D);
  }
  // Scores of two query rows against the same W keys (into s0, s1): each key chunk is
  // loaded and converted once for both rows (a third fewer q.k instructions than two
  // dot() passes), KB keys at a time so the 2 x KB accumulators stay in registers.
  static void dot_group2(const QElem* q0, const QElem* q1, const C* k, int64_t kst, int D,
                         float* s0, float* s1, PrefetchCursor& pf) {
    constexpr int KB = VO::W < 4 ? VO::W : 4;
    V a0[VO::W], a1[VO::W];
#pragma GCC unroll 16
    for (int i0 = 0; i0 < VO::W; i0 += KB) {
      V x[KB], y[KB];
#pragma GCC unroll 4
      for (int i = 0; i < KB; ++i) {
        pf.tick();
        x[i] = VO::zero();
        y[i] = VO::zero();
      }
      for (int d = 0; d < D; d += VO::W) {
        const V qa = VO::load(q0 + d), qb = VO::load(q1 + d);
#pragma GCC unroll 4
        for (int i = 0; i < KB; ++i) {
          const V kv = VO::cvt_load(k + (i0 + i) * kst + d);
          x[i] = VO::fma(qa, kv, x[i]);
          y[i] = VO::fma(qb, kv, y[i]);
        }
      }
#pragma GCC unroll 4
      for (int i = 0; i < KB; ++i) {
        a0[i0 + i] = x[i];
        a1[i0 + i] = y[i];
      }
    }
    VO::store(s0, VO::reduce_lanes(a0));
    VO::store(s1, VO::reduce_lanes(a1));
  }
};

// A Qk may score all R rows of a key group in one call instead (dot_rows(q, R, k, kst, D,
// out, lds, pf) and its tick count rows_ticks(R, t0, t1)), e.g. to convert each key chunk
// once for a whole GQA group (decode_avx2.h).
template <class Q, class = void>
struct HasDotRows : std::false_type {};
template <class Q>
struct HasDotRows<Q, std::void_t<decltype(&Q::dot_rows)>> : std::true_type {};

// ISA TUs may specialize Qk (e.g. AVX512-BF16 dot products) before instantiating.
template <class VO, class T, class C = T>
struct Qk : QkGeneric<VO, T, C> {};

// acc[r] += P[r] . V over keys [t0, t1) of one block; register-blocked rows x vectors.
// Specializations may keep acc in a permuted d order; finish_row restores it. pv ticks the
// prefetch cursor exactly ticks(R, t0, t1, D) times (once per key of each register tile).
template <class VO, class T>
struct PvGeneric {
  using V = typename VO::V;
  static constexpr int W = VO::W;
  static void finish_row(float*, int) {}

  // acc[0..RB) rows (stride D) += P[0..RB) rows (stride lds) . V[t0..t1)
  template <int RB, int DB>
  static void pv_tile(const float* P, int lds, const T* vb, int64_t vst, int t0, int t1,
                      float* acc, int D, int d, PrefetchCursor& pf) {
    V a[RB][DB];
    for (int i = 0; i < RB; ++i)
      for (int j = 0; j < DB; ++j) a[i][j] = VO::load(acc + i * D + d + j * W);
    for (int t = t0; t < t1; ++t) {
      pf.tick();
      const T* vt = vb + t * vst + d;
      V v[DB];
#pragma GCC unroll 8
      for (int j = 0; j < DB; ++j) v[j] = VO::cvt_load(vt + j * W);
#pragma GCC unroll 8
      for (int i = 0; i < RB; ++i) {
        const V pb = VO::set1(P[i * lds + t]);
#pragma GCC unroll 8
        for (int j = 0; j < DB; ++j) a[i][j] = VO::fma(pb, v[j], a[i][j]);
      }
    }
    for (int i = 0; i < RB; ++i)
      for (int j = 0; j < DB; ++j) VO::store(acc + i * D + d + j * W, a[i][j]);
  }

  template <int RB>
  static void pv_rows(const float* P, int lds, const T* vb, int64_t vst, int t0, int t1,
                      float* acc, int D, PrefetchCursor& pf) {
    constexpr int DB = VO::kPvVecs;
    int d = 0;
    for (; d + DB * W <= D; d += DB * W)
      pv_tile<RB, DB>(P, lds, vb, vst, t0, t1, acc, D, d, pf);
    for (; d < D; d += W) pv_tile<RB, 1>(P, lds, vb, vst, t0, t1, acc, D, d, pf);
  }

  static void pv(const float* P, int lds, int R, const T* vb, int64_t vst, int t0, int t1,
                 float* acc, int D, PrefetchCursor& pf) {
    constexpr int RB = VO::kPvRows;
    int r = 0;
    for (; r + RB <= R; r += RB)
      pv_rows<RB>(P + r * lds, lds, vb, vst, t0, t1, acc + r * D, D, pf);
    for (; r < R; ++r) pv_rows<1>(P + r * lds, lds, vb, vst, t0, t1, acc + r * D, D, pf);
  }
  static int ticks(int R, int t0, int t1, int D) {
    constexpr int span = VO::kPvVecs * W;
    const int row_tiles = R / VO::kPvRows + R % VO::kPvRows;
    return row_tiles * (D / span + D % span / W) * (t1 - t0);
  }

};

// Pv<VO, C, T>: values stored as C, for queries/outputs of type T (a specialization may
// trade precision only where T's own rounding hides it).
template <class VO, class C, class T = C>
struct Pv : PvGeneric<VO, C> {};

// Initial row state of a rows-in-lanes prefill item (LaneRows, online_softmax.h, [Rp] each):
// the rows' visible keys, negated positions (int32: ALiBi's j - p is formed in integers)
// and slopes, m = -inf, l = 0; [*ulo, *uhi] is the union of the rows' visible keys
// (*ulo > *uhi: none).
inline void init_lane_rows(const AttnParams& p, const WorkItem& it, int Rp, const LaneRows& rows,
                           int64_t* ulo, int64_t* uhi) {
  int32_t *lo = rows.lo, *hi = rows.hi, *neg_pos = rows.neg_pos;
  float *slope = rows.slope, *m = rows.m, *l = rows.l;
  const int G = p.num_heads / p.num_kv_heads;
  const int64_t qs = p.query_start_loc[it.req];
  const int64_t q_len = p.query_start_loc[it.req + 1] - qs;
  const int64_t kv_len = p.seq_lens[it.req];
  *ulo = INT64_MAX, *uhi = -1;
  for (int r = 0; r < Rp; ++r) {
    lo[r] = 1, hi[r] = 0, neg_pos[r] = 0, slope[r] = 0.f;
    m[r] = kNegInf, l[r] = 0.f;
  }
  for (int t = 0; t < it.q_end - it.q_begin; ++t) {
    const int64_t ps = kv_len - q_len + it.q_begin + t;
    const KeyRange keys = visible_key_range(p, ps, it.kv_begin, it.kv_end);
    int64_t a = keys.first, b = keys.last;
    if (a <= b) {
      *ulo = std::min(*ulo, a);
      *uhi = std::max(*uhi, b);
    } else {
      a = 1, b = 0;
    }
    for (int g = 0; g < G; ++g) {
      const int r = t * G + g;
      lo[r] = static_cast<int32_t>(a);  // positions are < seq_lens (int32)
      hi[r] = static_cast<int32_t>(b);
      neg_pos[r] = static_cast<int32_t>(-ps);
      if (p.alibi != nullptr) slope[r] = p.alibi[it.kv_head * G + g];
    }
  }
}

// Hook for an ISA-specific kernel of whole prefill items (many query rows); returns false
// when it does not handle the item, which then takes the generic path below.
template <class VO, class T>
struct PrefillItem {
  static bool run(const AttnParams&, const WorkItem&, float*) { return false; }
};

// fp8 caches: each step's K rows (from its first key group) and V rows are decoded once
// into scratch of element type E, and the E-cache kernels run on that (L1-resident) copy;
// decoding inside q.k would redo it for every pair of query rows. E = float by default
// (VO::cvt_row: the ISA's vectorised decode); an ISA TU may pick another E, as
// AVX512-BF16 does (bf16, for vdpbf16ps), or read the bytes in place with kernels that
// convert each chunk once for all rows, as AVX2 does (decode_avx2.h). Other caches are
// read in place (kActive false).
template <class VO, class C>
struct Fp8ToFloatRows {
  using E = float;
  static constexpr bool kActive = true;
  static void rows(const C* src, int64_t sst, float* dst, int n, int D) {
    for (int r = 0; r < n; ++r) VO::cvt_row(src + r * sst, dst + static_cast<int64_t>(r) * D, D);
  }
};
template <class VO, class T, class C>
struct CacheConvert {
  using E = C;
  static constexpr bool kActive = false;
  static void rows(const C*, int64_t, E*, int, int) {}
};
template <class VO, class T>
struct CacheConvert<VO, T, fp8_e4m3_t> : Fp8ToFloatRows<VO, fp8_e4m3_t> {};
template <class VO, class T>
struct CacheConvert<VO, T, fp8_e5m2_t> : Fp8ToFloatRows<VO, fp8_e5m2_t> {};

// T: query/output type; C: cache type (T, or an fp8 format: q.k and P.V then run on the
// stored values, and p.scale / p.v_scale carry the cache's k_scale / v_scale).
template <class VO, class T, class C = T>
struct AttnKernel {
  using V = typename VO::V;
  static constexpr int W = VO::W;
  using Conv = CacheConvert<VO, T, C>;
  using E = typename Conv::E;  // element type the q.k / P.V kernels read
  using QkT = Qk<VO, T, E>;
  using PvT = Pv<VO, E, T>;

  static const T* q_row(const AttnParams& p, int64_t tok, int64_t head) {
    return static_cast<const T*>(p.q) + tok * p.q_stride_tok + head * p.q_stride_head;
  }
  static T* out_row(const AttnParams& p, int64_t tok, int64_t head) {
    return static_cast<T*>(p.out) + tok * p.o_stride_tok + head * p.o_stride_head;
  }

  // S[r, t] for t in [t0, t1) (computed for whole W-groups inside the block: keys past t1
  // may be garbage, their lanes are masked later and never reach P.V).
  // A key group reaching past the block's end (block sizes that are not a multiple of W:
  // 1, 8) is scored from `kpad` [W, D] instead: its keys [tg, t1) copied, the rest zeros,
  // so no read leaves the block.
  static void qk(const typename QkT::QElem* qp, int R, const E* kb, int64_t kst, int t0,
                 int t1, float* S, int lds, int D, int BS, E* kpad, PrefetchCursor& pf) {
    const int ta = t0 / W * W;
    for (int tg = ta; tg < t1; tg += W) {
      const E* kg = kb + tg * kst;
      int64_t gst = kst;
      if (tg + W > BS) {
        std::memset(static_cast<void*>(kpad), 0, sizeof(E) * W * D);
        for (int t = tg; t < t1; ++t)
          std::memcpy(static_cast<void*>(kpad + (t - tg) * D), kb + t * kst, sizeof(E) * D);
        kg = kpad;
        gst = D;
      }
      if constexpr (HasDotRows<QkT>::value) {
        QkT::dot_rows(qp, R, kg, gst, D, S + tg, lds, pf);
      } else {
        int r = 0;
        for (; r + 1 < R; r += 2)
          QkT::dot_group2(qp + r * D, qp + (r + 1) * D, kg, gst, D, S + r * lds + tg,
                          S + (r + 1) * lds + tg, pf);
        for (; r < R; ++r)
          VO::store(S + r * lds + tg, QkT::dot_group(qp + r * D, kg, gst, D, pf));
      }
    }
  }
  static int qk_ticks(int R, int t0, int t1) {
    if constexpr (HasDotRows<QkT>::value) return QkT::rows_ticks(R, t0, t1);
    return (R + 1) / 2 * ((t1 - t0 / W * W + W - 1) / W) * W;
  }

  // out[0..D) = acc * f (converted to T); f == 0 writes zeros (never NaN from 0 * inf).
  static void store_row(T* dst, const float* src, float f, int D) {
    const V fv = VO::set1(f);
    for (int d = 0; d < D; d += W) {
      const V x = f == 0.f ? VO::zero() : VO::mul(VO::load(src + d), fv);
      VO::cvt_store(dst + d, x);
    }
  }

  using QElem = typename QkT::QElem;

  // Where the item's buffers live in the kernel's scratch (attn_scratch_floats sizes it).
  struct Scratch {
    float* acc;    // [R, D]
    QElem* qp;     // [R, D]
    float* S;      // [Rh, lds] (one head at a time)
    float* m;      // [R] running max
    float* l;      // [R] running sum
    int64_t* lo;   // [Rh] first visible key (8-byte aligned)
    int64_t* hi;   // [Rh] last visible key
    int64_t* pos;  // [Rh] absolute query position
    E* kpad;       // [W, D] padded key group
    E* kconv;      // [BS, D] decoded K (fp8)
    E* vconv;      // [BS, D] decoded V (fp8)
    uint32_t* qt;  // the rows as decode_scores_bf16's B tiles (TileScores)
    int lds;
  };
  static Scratch carve(float* scratch, int R, int D, int BS) {
    Scratch s;
    s.lds = (BS + 2 * W + 15) / 16 * 16;
    s.acc = scratch;
    s.qp = reinterpret_cast<QElem*>(s.acc + R * D);
    s.S = s.acc + 2 * R * D;
    s.m = s.S + R * s.lds;
    s.l = s.m + R;
    s.lo = reinterpret_cast<int64_t*>(s.l + R);
    s.hi = s.lo + R;
    s.pos = s.hi + R;
    s.kpad = reinterpret_cast<E*>((reinterpret_cast<uintptr_t>(s.pos + R) + 63) / 64 * 64);
    s.kconv = reinterpret_cast<E*>((reinterpret_cast<uintptr_t>(s.kpad + W * D) + 63) / 64 * 64);
    s.vconv = s.kconv + static_cast<int64_t>(BS) * D;
    s.qt = reinterpret_cast<uint32_t*>(
        (reinterpret_cast<uintptr_t>(s.vconv + static_cast<int64_t>(BS) * D) + 63) / 64 * 64);
    return s;
  }

  static void run(const AttnParams& p, const WorkItem& it, float* scratch) {
    // The lanes kernels read T caches and the rows of one request only.
    if constexpr (std::is_same<T, C>::value)
      if (!p.row_invariant && it.tokens == nullptr && PrefillItem<VO, T>::run(p, it, scratch))
        return;
    const int G = p.num_heads / p.num_kv_heads;
    const int R = it.heads() * (it.q_end - it.q_begin) * G;
    const Scratch s = carve(scratch, R, p.head_size, p.block_size);
    const KeyRange keys = init_rows(p, it, s);
    if (keys.first <= keys.last) attend_blocks(p, it, s, keys.first, keys.last);
    for (int r = 0; r < R; ++r) PvT::finish_row(s.acc + r * p.head_size, p.head_size);
    finish(p, it, s.acc, s.m, s.l);
  }

  // Each row's visible keys and position, its packed query, and a zero accumulator, max
  // and sum. Returns the union of the rows' visible ranges (first > last when empty).
  static KeyRange init_rows(const AttnParams& p, const WorkItem& it, Scratch s) {
    const int D = p.head_size;
    const int G = p.num_heads / p.num_kv_heads;
    const int ntok = it.q_end - it.q_begin;
    const int Rh = ntok * G;  // rows per kv head
    const int R = it.heads() * Rh;
    int64_t ulo = INT64_MAX, uhi = -1;
    for (int t = 0; t < ntok; ++t) {
      const int64_t ps = item_token(p, it, t).pos;
      const KeyRange keys = visible_key_range(p, ps, it.kv_begin, it.kv_end);
      int64_t a = keys.first, b = keys.last;
      if (a <= b) {
        ulo = std::min(ulo, a);
        uhi = std::max(uhi, b);
      }
      for (int g = 0; g < G; ++g) {
        const int r = t * G + g;
        s.lo[r] = a;
        s.hi[r] = b;
        s.pos[r] = ps;
      }
    }
    for (int r = 0; r < R; ++r) {
      QkT::pack(q_row(p, item_token(p, it, row_token(r, Rh, G)).token, row_head(it, r, Rh, G)),
                s.qp + r * D, D);
      s.m[r] = kNegInf;
      s.l[r] = 0.f;
      for (int d = 0; d < D; d += W) VO::store(s.acc + r * D + d, VO::zero());
    }
    return KeyRange{ulo, uhi};
  }

  // q.k on the AMX tiles (MatrixEngine::decode_scores_bf16), where the engine has them and
  // q.k reads bf16 rows: scores come out of one tile product per 16 keys and 32 dims, for
  // up to kDecodeTileRows rows at once, instead of a dot product and a lane reduction per
  // (row, key). Blocks must hold whole groups of 16 keys. Not in batch-invariant plans,
  // which keep every row on the generic path.
  struct TileScores {
    bool on = false;
    const MatrixEngine* engine = nullptr;
    const uint32_t* qt = nullptr;
    int Rh = 0, D = 0;
    int64_t head_words = 0, chunk_words = 0;
    TileScores(const AttnParams& p, const WorkItem& it, const Scratch& s, int rows_per_head) {
      if constexpr (std::is_same<QElem, bf16_t>::value && std::is_same<E, bf16_t>::value) {
        if (p.matrix == nullptr || p.matrix->decode_scores_bf16 == nullptr || p.row_invariant ||
            p.head_size % 32 != 0 || p.block_size % 16 != 0)
          return;
        on = true;
        engine = p.matrix;
        qt = s.qt;
        Rh = rows_per_head;
        D = p.head_size;
        chunk_words = int64_t{D} / 2 * 8;
        head_words = (Rh + kDecodeTileRows - 1) / kDecodeTileRows * chunk_words;
        for (int h = 0; h < it.heads(); ++h)
          for (int c = 0; c * kDecodeTileRows < Rh; ++c) {
            const int r = h * Rh + c * kDecodeTileRows;
            pack_decode_queries(s.qp + static_cast<int64_t>(r) * D,
                                std::min(kDecodeTileRows, Rh - c * kDecodeTileRows), D,
                                s.qt + h * head_words + c * chunk_words);
          }
      }
    }
    // Head h's rows against keys [t0, t1) of a block: S[r, t] for t in whole groups of 16.
    void scores(int h, const E* k, int64_t kst, int t0, int t1, float* S, int lds) const {
      if constexpr (std::is_same<E, bf16_t>::value) {
        const int ta = t0 / 16 * 16;
        const int groups = (t1 - ta + 15) / 16;
        for (int c = 0; c * kDecodeTileRows < Rh; ++c)
          engine->decode_scores_bf16(
              reinterpret_cast<const bf16_t*>(qt + h * head_words + c * chunk_words),
              std::min(kDecodeTileRows, Rh - c * kDecodeTileRows), k + ta * kst, kst, groups, D,
              S + static_cast<int64_t>(c) * kDecodeTileRows * lds + ta, lds);
      }
    }
  };

  // q.k, online softmax and P.V over the blocks holding keys [ulo, uhi], one (block, head)
  // step at a time, prefetching later steps' K/V.
  static void attend_blocks(const AttnParams& p, const WorkItem& it, Scratch s,
                            int64_t ulo, int64_t uhi) {
    const int D = p.head_size, BS = p.block_size;
    const int G = p.num_heads / p.num_kv_heads;
    const int NH = it.heads();
    const int Rh = (it.q_end - it.q_begin) * G;  // rows per kv head
    const int lds = s.lds;
    const ScoreTransform<VO> tr(p);
    const int32_t* bt = p.block_table + it.req * p.bt_stride;
    const C* kbase = static_cast<const C*>(p.k_cache) + it.kv_head * p.k_stride_head;
    const C* vbase = static_cast<const C*>(p.v_cache) + it.kv_head * p.v_stride_head;
    // Decode is memory-latency bound: a core's demand misses alone reach about a quarter
    // of DRAM bandwidth (the 4 KiB pages of a paged block are scattered, so hardware
    // prefetchers keep losing the stream), so software-prefetch K/V into L2 ~16 KiB
    // ahead, evenly over the step (see PrefetchCursor; 16-32 KiB beat 64-128 KiB once
    // spread). Steps are (block, head) pairs in the order they are computed.
    const TileScores tiles(p, it, s, Rh);
    const int64_t first = ulo / BS, last = uhi / BS;
    const int64_t k_bytes = static_cast<int64_t>(BS) * p.k_stride_tok * sizeof(C);
    const int64_t v_bytes = static_cast<int64_t>(BS) * p.v_stride_tok * sizeof(C);
    const int64_t dist = std::max<int64_t>(1, (16 * 1024) / (k_bytes + v_bytes));
    const int64_t nsteps = (last - first + 1) * NH;
    auto cursor = [&](int64_t step) {
      const int64_t phys = bt[first + step / NH];
      const int64_t h = step % NH;
      return PrefetchCursor{
          reinterpret_cast<const char*>(kbase + phys * p.k_stride_block + h * p.k_stride_head),
          reinterpret_cast<const char*>(vbase + phys * p.v_stride_block + h * p.v_stride_head),
          k_bytes, v_bytes};
    };
    // Pages are touched (one line each) further ahead than lines are prefetched: a
    // page's first access pays a page walk, as the pool is far larger than the TLB's
    // reach, and a prefetch waiting on a walk holds a miss slot (docs/performance.md,
    // "Decode prefetching").
    const int64_t page_ahead = std::max<int64_t>(dist + 1, (64 * 1024) / (k_bytes + v_bytes));
    // The item's first steps: step 0 too, whose loads would otherwise all miss on demand
    // (split decodes start several items per thread).
    for (int64_t st = 0; st < std::min(nsteps, page_ahead); ++st) {
      PrefetchCursor warm = cursor(st);
      if (st < dist) warm.issue(warm.lines());
      else warm.touch_pages();
    }
    for (int64_t st = 0; st < nsteps; ++st) {
      const int64_t blk = first + st / NH;
      const int h = static_cast<int>(st % NH);
      // The lines of step st + dist are spread over this step's q.k and P.V.
      PrefetchCursor pf;
      if (st + dist < nsteps) pf = cursor(st + dist);
      if (st + page_ahead < nsteps) cursor(st + page_ahead).touch_pages();
      const int64_t base = blk * BS;
      const int t0 = static_cast<int>(std::max<int64_t>(ulo - base, 0));
      const int t1 = static_cast<int>(std::min<int64_t>(uhi + 1 - base, BS));
      const int64_t phys = bt[blk];
      const C* kb = kbase + phys * p.k_stride_block + h * p.k_stride_head;
      const C* vb = vbase + phys * p.v_stride_block + h * p.v_stride_head;
      const E* ke = reinterpret_cast<const E*>(kb);  // the rows the kernels read
      const E* ve = reinterpret_cast<const E*>(vb);
      int64_t kst = p.k_stride_tok, vst = p.v_stride_tok;
      if constexpr (Conv::kActive) {
        const int ta = t0 / W * W;
        Conv::rows(kb + ta * kst, kst, s.kconv + ta * D, t1 - ta, D);
        Conv::rows(vb + t0 * vst, vst, s.vconv + t0 * D, t1 - t0, D);
        ke = s.kconv;
        ve = s.vconv;
        kst = vst = D;
      }
      const int r0 = h * Rh;
      pf.pace((tiles.on ? 0 : qk_ticks(Rh, t0, t1)) + PvT::ticks(Rh, t0, t1, D));
      if (tiles.on) tiles.scores(h, ke, kst, t0, t1, s.S, lds);
      else qk(s.qp + r0 * D, Rh, ke, kst, t0, t1, s.S, lds, D, BS, s.kpad, pf);
      for (int r = 0; r < Rh; ++r)
        softmax_row(p, tr, (it.kv_head + h) * G + r % G, s.S + r * lds, base, t0, t1, s.lo[r],
                    s.hi[r], s.pos[r], s.m + r0 + r, s.l + r0 + r, s.acc + (r0 + r) * D, D);
      pv_visible(s.S, lds, Rh, ve, vst, base, t0, t1, s.lo, s.hi, s.acc + r0 * D, D, pf);
      pf.issue(pf.lines());
    }
  }

  // acc[r] += P[r] . V over keys [t0, t1) of a block. Rows that see only part of it (the
  // diagonal of a causal tile, a window edge) sum their own keys only: a key a row cannot
  // see must add nothing, not 0 * V, which is NaN for a NaN/inf value. Runs of rows with
  // the same range (a token's GQA heads) share one call.
  static void pv_visible(const float* S, int lds, int Rh, const E* vb, int64_t vst,
                         int64_t base, int t0, int t1, const int64_t* lo, const int64_t* hi,
                         float* acc, int D, PrefetchCursor& pf) {
    auto row_range = [&](int r, int* a, int* b) {
      *a = static_cast<int>(std::max<int64_t>(t0, lo[r] - base));
      *b = static_cast<int>(std::min<int64_t>(t1, hi[r] + 1 - base));
    };
    if (every_row_sees(lo, hi, Rh, base + t0, base + t1 - 1))
      return PvT::pv(S, lds, Rh, vb, vst, t0, t1, acc, D, pf);
    for (int r = 0; r < Rh;) {
      int a, b;
      row_range(r, &a, &b);
      int n = 1;
      for (int a2, b2; r + n < Rh; ++n) {
        row_range(r + n, &a2, &b2);
        if (a2 != a || b2 != b) break;
      }
      if (a < b) PvT::pv(S + r * lds, lds, n, vb, vst, a, b, acc + r * D, D, pf);
      r += n;
    }
  }

  // Writes the item's rows: acc [R, D] (unnormalized), running max m and sum l [R] ->
  // the output rows (sink folded in), or a normalized partial and its log-sum-exp.
  static void finish(const AttnParams& p, const WorkItem& it, const float* acc, const float* m,
                     const float* l) {
    const int D = p.head_size;
    const int G = p.num_heads / p.num_kv_heads;
    const int Rh = (it.q_end - it.q_begin) * G;
    const int R = it.heads() * Rh;
    if (it.part_out == nullptr) {
      for (int r = 0; r < R; ++r) {
        const int h = row_head(it, r, Rh, G);
        float f = 0.f;
        float mm = m[r];
        float denom = l[r];
        if (p.sink != nullptr) {
          const float sk = p.sink[h];
          const float mx = std::max(mm, sk);
          if (mx != kNegInf) {
            denom = (mm == kNegInf ? 0.f : l[r] * std::exp(mm - mx)) + std::exp(sk - mx);
            if (mm != kNegInf && denom > 0.f) f = std::exp(mm - mx) / denom;
          }
        } else if (denom > 0.f) {
          f = 1.f / denom;
        }
        f *= p.v_scale;
        store_row(out_row(p, item_token(p, it, row_token(r, Rh, G)).token, h), acc + r * D, f, D);
      }
    } else {
      for (int r = 0; r < R; ++r) {
        const bool any = l[r] > 0.f;
        it.part_lse[r] = any ? m[r] + std::log(l[r]) : kNegInf;
        const V fv = VO::set1(any ? p.v_scale / l[r] : 0.f);
        for (int d = 0; d < D; d += W)
          VO::store(it.part_out + r * D + d, any ? VO::mul(VO::load(acc + r * D + d), fv) : VO::zero());
      }
    }
  }

  // Query head and token offset of item row r (rows are head-major, see WorkItem).
  static int row_head(const WorkItem& it, int r, int Rh, int G) {
    return (it.kv_head + r / Rh) * G + (r % Rh) % G;
  }
  static int row_token(int r, int Rh, int G) { return (r % Rh) / G; }

  // Turns raw scores s[t0..t1) of one row into probabilities relative to the updated
  // running max, and rescales the row's accumulator and sum (the keys-in-lanes layout of
  // the online-softmax step, online_softmax.h). Not inlined: see lanes_softmax_block.
  __attribute__((noinline)) static void softmax_row(const AttnParams& p,
                                                    const ScoreTransform<VO>& tr, int qhead,
                                                    float* s, int64_t base, int t0, int t1,
                                                    int64_t lo, int64_t hi, int64_t ps,
                                                    float* m, float* l, float* acc, int D) {
    using VI = typename VO::VI;
    const int tl = static_cast<int>(std::max<int64_t>(t0, lo - base));
    const int th = static_cast<int>(std::min<int64_t>(t1 - 1, hi - base));
    if (tl > th) {  // nothing visible for this row in this block
      for (int t = t0; t < t1; ++t) s[t] = 0.f;
      return;
    }
    const VI iota = VO::iotai();
    // Plain scores (no softcap, no ALiBi) stay unscaled: the scale is folded into the
    // exponent's FMA below, which saves a load-multiply-store pass over the block.
    const bool fold_scale = tr.plain_scale;
    if (!fold_scale) {
      const V slope = VO::set1(tr.alibi ? p.alibi[qhead] : 0.f);
      for (int t = tl / W * W; t <= th; t += W) {
        V x = tr.scaled(VO::load(s + t));
        if (tr.alibi) {  // key - query position, exact in int32 (positions are int32)
          const VI dist = VO::addi(iota, VO::set1i(static_cast<int32_t>(base + t - ps)));
          x = tr.add_alibi(x, slope, dist);
        }
        VO::store(s + t, x);
      }
    }
    // Keys outside [tl, th] -> -inf, including the lanes of the last vector past t1 (lds
    // leaves room); the max over the row's vectors on the way.
    const VI tlv = VO::set1i(tl), thv = VO::set1i(th);
    V mxv = VO::set1(kNegInf);
    for (int t = t0; t < t1; t += W) {
      V x = VO::load(s + t);
      if (t < tl || t + W - 1 > th) {
        x = tr.hide(x, tlv, VO::addi(iota, VO::set1i(t)), thv);
        VO::store(s + t, x);
      }
      mxv = VO::max(mxv, x);
    }
    const float mx = fold_scale ? VO::hmax(mxv) * p.scale : VO::hmax(mxv);

    const MaxStep<VecScalar> ms = max_step<VecScalar>(*m, mx, kExactMax);
    const V sum = exp_sum<VO, 1>(
        t0, t1, W, VO::set1(fold_scale ? p.scale : 1.f), VO::set1(-ms.mu),
        [&](int t) { return VO::load(s + t); }, [&](int t, const V* e) { VO::store(s + t, e[0]); });
    *l = VecScalar::fma(*l, ms.corr, VO::hsum(sum));
    *m = ms.m;
    if (ms.moved) rescale<VO>(acc, W, D / W, VO::set1(ms.corr));
  }

  // Log-sum-exp merge of nsplit partials, the shared-prefix partials where the item has
  // them (it.prefix_out / prefix_lse, rows as part_out's, prefix_parts of them
  // prefix_part_rows rows apart), and the sink, into the output rows.
  static void merge(const AttnParams& p, const WorkItem& it, int nsplit, int64_t split_stride,
                    int64_t lse_stride) {
    const int D = p.head_size;
    const int G = p.num_heads / p.num_kv_heads;
    const int64_t qs = p.query_start_loc[it.req];
    const int Rh = (it.q_end - it.q_begin) * G;
    const int R = it.heads() * Rh;
    // Partial s < nsplit: split s; s >= nsplit: the shared prefix's chunk s - nsplit.
    const int nparts = nsplit + (it.prefix_out != nullptr ? it.prefix_parts : 0);
    const auto lse_of = [&](int s, int r) {
      return s < nsplit ? it.part_lse[s * lse_stride + r]
                        : it.prefix_lse[(s - nsplit) * it.prefix_part_rows + r];
    };
    const auto out_of = [&](int s, int r) {
      return s < nsplit ? it.part_out + s * split_stride + r * D
                        : it.prefix_out + ((s - nsplit) * it.prefix_part_rows + r) * D;
    };
    for (int r = 0; r < R; ++r) {
      const int h = row_head(it, r, Rh, G);
      float mx = p.sink != nullptr ? p.sink[h] : kNegInf;
      for (int s = 0; s < nparts; ++s) mx = std::max(mx, lse_of(s, r));
      T* dst = out_row(p, qs + it.q_begin + row_token(r, Rh, G), h);
      if (mx == kNegInf) {
        for (int d = 0; d < D; d += W) VO::cvt_store(dst + d, VO::zero());
        continue;
      }
      float denom = p.sink != nullptr ? std::exp(p.sink[h] - mx) : 0.f;
      float wts[2 * kMaxSplits];
      for (int s = 0; s < nparts; ++s) {
        const float lse = lse_of(s, r);
        wts[s] = lse == kNegInf ? 0.f : std::exp(lse - mx);
        denom += wts[s];
      }
      for (int d = 0; d < D; d += W) {
        V a = VO::zero();
        for (int s = 0; s < nparts; ++s)
          if (wts[s] != 0.f) a = VO::fma(VO::set1(wts[s]), VO::load(out_of(s, r) + d), a);
        VO::cvt_store(dst + d, denom > 0.f ? VO::mul(a, VO::set1(1.f / denom)) : VO::zero());
      }
    }
  }
};

#include "tile_pack.h"
#include "prefill_matrix_impl.h"

template <class VO, class T, class C>
void attn_item_run(const AttnParams& p, const WorkItem& it, float* scratch) {
  if (runs_on_matrix(p, it)) MatrixPrefill<VO, T, C>::run(p, it, scratch);
  else AttnKernel<VO, T, C>::run(p, it, scratch);
}

template <class VO, class T>
void attn_item_cache(const AttnParams& p, const WorkItem& it, float* scratch) {
  switch (p.cache_dtype) {
    case DType::kFp8E4m3: attn_item_run<VO, T, fp8_e4m3_t>(p, it, scratch); break;
    case DType::kFp8E5m2: attn_item_run<VO, T, fp8_e5m2_t>(p, it, scratch); break;
    default: attn_item_run<VO, T, T>(p, it, scratch); break;  // cache dtype == query dtype
  }
}

template <class VO>
void attn_item_dtype(const AttnParams& p, const WorkItem& it, float* scratch) {
  switch (p.dtype) {
    case DType::kF32: attn_item_cache<VO, float>(p, it, scratch); break;
    case DType::kBF16: attn_item_cache<VO, bf16_t>(p, it, scratch); break;
    case DType::kF16: attn_item_cache<VO, fp16_t>(p, it, scratch); break;
    default: break;  // fp8 is a cache format only (rejected by the binding)
  }
}

// The merge reads only fp32 partials and writes T rows: the cache type does not matter.
template <class VO>
void merge_dtype(const AttnParams& p, const WorkItem& it, int32_t nsplit, int64_t split_stride,
                 int64_t lse_stride) {
  switch (p.dtype) {
    case DType::kF32: AttnKernel<VO, float>::merge(p, it, nsplit, split_stride, lse_stride); break;
    case DType::kBF16: AttnKernel<VO, bf16_t>::merge(p, it, nsplit, split_stride, lse_stride); break;
    case DType::kF16: AttnKernel<VO, fp16_t>::merge(p, it, nsplit, split_stride, lse_stride); break;
    default: break;
  }
}

// Every row loop steps by the vector width, so head sizes that are not a multiple of
// VO::W (40, 72, ... on 16-lane AVX-512) run the kernels of the narrower VN (8 lanes).
template <class VO, class VN>
void attn_item_entry(const AttnParams& p, const WorkItem& it, float* scratch) {
  if (p.head_size % VO::W == 0) attn_item_dtype<VO>(p, it, scratch);
  else attn_item_dtype<VN>(p, it, scratch);
}

template <class VO, class VN>
void merge_entry(const AttnParams& p, const WorkItem& it, int32_t nsplit, int64_t split_stride,
                 int64_t lse_stride) {
  if (p.head_size % VO::W == 0) merge_dtype<VO>(p, it, nsplit, split_stride, lse_stride);
  else merge_dtype<VN>(p, it, nsplit, split_stride, lse_stride);
}

template <class VO>
void pack_rows_entry(PackKind kind, const void* const* rows, int nrows, int ncols, void* dst) {
  if (kind == PackKind::kTranspose32)
    TilePack<VO>::transpose32(reinterpret_cast<const uint32_t* const*>(rows), nrows, ncols,
                              static_cast<uint32_t*>(dst));
  else
    TilePack<VO>::interleave16(reinterpret_cast<const uint16_t* const*>(rows), nrows, ncols,
                               static_cast<uint32_t*>(dst));
}

template <class VO, class VN = VO>
KernelTable make_kernel_table(const char* name) {
  return KernelTable{name, &attn_item_entry<VO, VN>, &merge_entry<VO, VN>,
                     &pack_rows_entry<VO>};
}
