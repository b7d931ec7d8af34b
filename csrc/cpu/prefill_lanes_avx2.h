// Prefill items (>= 8 query rows of one kv head) with query rows in the 8 lanes of AVX2
// vectors, every dtype computed in fp32 with FMA. Included by kernels_avx2.cpp after
// attn_kernel_impl.h; the AVX-512 twin (prefill_lanes_avx512.h) explains the layout:
// Q^T [D][Rp] and O^T [D][Rp] in scratch, q.k as KT keys x NG row-group outer products of
// broadcast key elements, online softmax elementwise over 8 rows (the same
// lanes_softmax_block, online_softmax.h), P.V with broadcast V.
// AVX2 has no broadcast operand for bf16/fp16, so each chunk of up to 32 keys of a block is
// first converted to fp32 (fp32 caches are read in place).
template <class T>
struct LanesPrefillAvx2 {
  static constexpr int L = 8;    // rows per vector
  static constexpr int KT = 6;   // keys per q.k tile
  static constexpr int DT = 6;   // d rows per P.V tile
  static constexpr int SB = 32;  // keys per chunk (16 for blocks that are odd multiples of 16)
  static constexpr bool kConvert = !std::is_same<T, float>::value;
  using Kern = AttnKernel<VecAvx2, T>;

  // st[t][rows] (t in [ta, tb), NK keys at a time) = Q.K^T for row groups [g0, g0 + NG);
  // key t at kf + (t - ta) * kst.
  template <int NK, int NG>
  static void qk(const float* qp, int Rp, int g0, const float* kf, int64_t kst, int ta, int tb,
                 int D, float* st) {
    for (int t = ta; t + NK <= tb; t += NK) {
      __m256 a[NK][NG];
      for (int k = 0; k < NK; ++k)
        for (int g = 0; g < NG; ++g) a[k][g] = _mm256_setzero_ps();
      const float* qi = qp + g0 * L;
      const float* kr = kf + (t - ta) * kst;
      for (int i = 0; i < D; ++i, qi += Rp) {
        __m256 q[NG];
        for (int g = 0; g < NG; ++g) q[g] = _mm256_loadu_ps(qi + g * L);
#pragma GCC unroll 8
        for (int k = 0; k < NK; ++k) {
          const __m256 b = _mm256_broadcast_ss(kr + k * kst + i);
          for (int g = 0; g < NG; ++g) a[k][g] = _mm256_fmadd_ps(q[g], b, a[k][g]);
        }
      }
      for (int k = 0; k < NK; ++k)
        for (int g = 0; g < NG; ++g) _mm256_storeu_ps(st + (t + k) * Rp + (g0 + g) * L, a[k][g]);
    }
  }

  // ot[d][rows] += sum_j P^T[j][rows] * V[j][d] for j in [j0, j1) and d in [d_begin, d_end)
  // (ND at a time); key j at vf + (j - j0) * vst.
  template <int ND, int NG>
  static void pv(const float* P, const float* vf, int64_t vst, int j0, int j1, int Rp, int g0,
                 int d_begin, int d_end, float* ot) {
    for (int d0 = d_begin; d0 + ND <= d_end; d0 += ND) {
      __m256 a[ND][NG];
      for (int k = 0; k < ND; ++k)
        for (int g = 0; g < NG; ++g) a[k][g] = _mm256_loadu_ps(ot + (d0 + k) * Rp + (g0 + g) * L);
      const float* pj = P + j0 * Rp + g0 * L;
      const float* vj = vf + d0;
      for (int j = j0; j < j1; ++j, pj += Rp, vj += vst) {
        __m256 pr[NG];
        for (int g = 0; g < NG; ++g) pr[g] = _mm256_loadu_ps(pj + g * L);
#pragma GCC unroll 8
        for (int k = 0; k < ND; ++k) {
          const __m256 b = _mm256_broadcast_ss(vj + k);
          for (int g = 0; g < NG; ++g) a[k][g] = _mm256_fmadd_ps(pr[g], b, a[k][g]);
        }
      }
      for (int k = 0; k < ND; ++k)
        for (int g = 0; g < NG; ++g) _mm256_storeu_ps(ot + (d0 + k) * Rp + (g0 + g) * L, a[k][g]);
    }
  }

  // Rows [ta, tb) of a cache block as fp32 [tb - ta][D] at dst (row t at dst + (t - ta) * D);
  // rows outside [t0, t1) are zeros (unwritten cache rows may hold NaN).
  static void to_f32(const T* src, int64_t st, int ta, int tb, int t0, int t1, int D, float* dst) {
    for (int t = ta; t < tb; ++t) {
      float* row = dst + (t - ta) * D;
      const bool in = t >= t0 && t < t1;
      for (int d = 0; d < D; d += L)
        _mm256_storeu_ps(row + d, in ? VecAvx2::cvt_load(src + t * st + d) : _mm256_setzero_ps());
    }
  }

  // Register tiles of KT keys (q.k) or DT d rows (P.V) x 2 row groups, 6 x 2 = 12
  // accumulators of the 16 ymm registers; the last keys / d rows take tiles of 2.
  template <int NG>
  static void qk_tiles(const float* qp, int Rp, int g0, const float* kf, int64_t kst, int ta,
                       int tb, int D, float* st) {
    const int tm = ta + (tb - ta) / KT * KT;
    qk<KT, NG>(qp, Rp, g0, kf, kst, ta, tm, D, st);
    qk<2, NG>(qp, Rp, g0, kf + (tm - ta) * kst, kst, tm, tb, D, st);
  }
  static void qk_groups(const float* qp, int Rp, int NGall, const float* kf, int64_t kst, int ta,
                        int tb, int D, float* st) {
    int g0 = 0;
    for (; g0 + 2 <= NGall; g0 += 2) qk_tiles<2>(qp, Rp, g0, kf, kst, ta, tb, D, st);
    if (g0 < NGall) qk_tiles<1>(qp, Rp, g0, kf, kst, ta, tb, D, st);
  }
  template <int NG>
  static void pv_tiles(const float* P, const float* vf, int64_t vst, int j0, int j1, int Rp,
                       int g0, int D, float* ot) {
    const int dm = D / DT * DT;
    pv<DT, NG>(P, vf, vst, j0, j1, Rp, g0, 0, dm, ot);
    pv<2, NG>(P, vf, vst, j0, j1, Rp, g0, dm, D, ot);
  }
  static void pv_groups(const float* P, const float* vf, int64_t vst, int j0, int j1, int Rp,
                        int NGall, int D, float* ot) {
    int g0 = 0;
    for (; g0 + 2 <= NGall; g0 += 2) pv_tiles<2>(P, vf, vst, j0, j1, Rp, g0, D, ot);
    if (g0 < NGall) pv_tiles<1>(P, vf, vst, j0, j1, Rp, g0, D, ot);
  }

  static bool run(const AttnParams& p, const WorkItem& it, float* scratch) {
    const int D = p.head_size, BS = p.block_size;
    const int G = p.num_heads / p.num_kv_heads;
    const int ntok = it.q_end - it.q_begin;
    const int R = ntok * G;
    if (it.heads() != 1 || R < L || BS % 16 != 0) return false;
    const int Rp = (R + L - 1) / L * L, NG = Rp / L;
    const int CB = BS % SB == 0 ? SB : 16;  // keys per chunk: chunks never straddle blocks
    const size_t need = 2 * static_cast<size_t>(D) * Rp + static_cast<size_t>(CB) * Rp +
                        (kConvert ? static_cast<size_t>(CB) * D : 0) +
                        LaneRows::kFloatsPerRow * static_cast<size_t>(Rp);
    if (need > attn_scratch_floats(R, D, BS)) return false;
    float* qp = scratch;                 // [D][Rp] Q^T; at the end the output rows [R][D]
    float* ot = qp + D * Rp;             // [D][Rp] O^T accumulators
    float* st = ot + D * Rp;             // [CB][Rp] scores, then probabilities
    float* kv = st + CB * Rp;            // [CB][D] fp32 K, then V, of one chunk
    const LaneRows rows = LaneRows::at(kv + (kConvert ? CB * D : 0), Rp);  // softmax state
    const int32_t *lo = rows.lo, *hi = rows.hi;

    const int64_t qs = p.query_start_loc[it.req];
    int64_t ulo, uhi;
    init_lane_rows(p, it, Rp, rows, &ulo, &uhi);
    for (int r = 0; r < Rp; ++r) {  // Q^T, padding rows 0
      const T* q = r < R ? Kern::q_row(p, qs + it.q_begin + r / G, it.kv_head * G + r % G) : nullptr;
      for (int d = 0; d < D; ++d) qp[d * Rp + r] = q != nullptr ? VecScalar::cvt_load(q + d) : 0.f;
    }
    for (int i = 0; i < D * Rp; i += L) _mm256_storeu_ps(ot + i, _mm256_setzero_ps());

    if (ulo <= uhi) {
      const int32_t* bt = p.block_table + it.req * p.bt_stride;
      const T* kbase = static_cast<const T*>(p.k_cache) + it.kv_head * p.k_stride_head;
      const T* vbase = static_cast<const T*>(p.v_cache) + it.kv_head * p.v_stride_head;
      for (int64_t c = ulo / CB; c <= uhi / CB; ++c) {  // chunks of CB keys, inside one block
        const int64_t base = c * CB;
        const int64_t blk = base / BS;
        const int off = static_cast<int>(base - blk * BS);  // chunk start within the block
        const int t0 = static_cast<int>(std::max<int64_t>(ulo - base, 0));
        const int t1 = static_cast<int>(std::min<int64_t>(uhi + 1 - base, CB));
        const int ta = t0 / 2 * 2, tb = (t1 + 1) / 2 * 2;  // tiles of 6 and 2 keys; tb <= CB
        const int64_t phys = bt[blk];
        const T* kb = kbase + phys * p.k_stride_block + off * p.k_stride_tok;
        const T* vb = vbase + phys * p.v_stride_block + off * p.v_stride_tok;

        // q.k over keys [ta, tb); scores of keys outside [t0, t1) are masked below.
        if constexpr (kConvert) {
          to_f32(kb, p.k_stride_tok, ta, tb, t0, t1, D, kv);
          qk_groups(qp, Rp, NG, kv, D, ta, tb, D, st);
        } else {
          // fp32 keys in place; keys in [ta, tb) outside [t0, t1) exist in the block.
          qk_groups(qp, Rp, NG, kb + ta * p.k_stride_tok, p.k_stride_tok, ta, tb, D, st);
        }

        // Online softmax, 8 rows per vector, one key a step.
        lanes_softmax_block<VecAvx2, 1>(p, rows, Rp, base, ta, tb, st, ot, D,
                                        [&](int o, int t, const __m256* e) {
          _mm256_storeu_ps(st + t * Rp + o, e[0]);
        });

        // P.V over the visible keys [t0, t1) only (the others may be NaN, see to_f32).
        if (!every_row_sees(lo, hi, R, base + t0, base + t1 - 1) &&
            rows_have_nonfinite(vb, p.v_stride_tok, t0, t1, D)) {
          // Rows see different keys and V holds NaN/inf: the shared P.V would give a key a
          // row cannot see weight 0, and 0 * NaN = NaN. Each row sums its own keys (rare).
          for (int r = 0; r < R; ++r) {
            const int a = static_cast<int>(std::max<int64_t>(t0, lo[r] - base));
            const int b = static_cast<int>(std::min<int64_t>(t1, hi[r] + 1 - base));
            for (int t = a; t < b; ++t)
              for (int d = 0; d < D; ++d)
                ot[d * Rp + r] += st[t * Rp + r] * VecScalar::cvt_load(vb + t * p.v_stride_tok + d);
          }
        } else if constexpr (kConvert) {
          to_f32(vb, p.v_stride_tok, t0, t1, t0, t1, D, kv);
          pv_groups(st, kv, D, t0, t1, Rp, NG, D, ot);
        } else {
          pv_groups(st, vb + t0 * p.v_stride_tok, p.v_stride_tok, t0, t1, Rp, NG, D, ot);
        }
      }
    }

    float* acc = qp;  // Q^T is spent: the output rows [R][D] go in its place
    for (int r = 0; r < R; ++r)
      for (int d = 0; d < D; ++d) acc[r * D + d] = ot[d * Rp + r];
    Kern::finish(p, it, acc, rows.m, rows.l);
    return true;
  }
};
