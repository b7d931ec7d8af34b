// Prefill items (>= 16 query rows of one kv head) with query rows in vector lanes, bf16 with
// AVX512-BF16. Included by kernels_avx512bf16.cpp after attn_kernel_impl.h.
//
// Why rows in lanes: the generic path puts keys in lanes, so every q.k ends in a horizontal
// lane reduction and softmax is per-row scalar bookkeeping. With S^T[key][row] tiles:
// - q.k is an outer product: Q^T is packed once per item as bf16 pairs [D/2][rows] and each
//   key's (d, d+1) pair is broadcast straight from the cache (vdpbf16ps {1to16}); no
//   reductions, a KT keys x NG row-groups register tile.
// - online softmax is elementwise over 16 rows at once (max/sum across keys are plain
//   vmax/vadd), masks are two integer compares per key.
// - P.V accumulates O^T[d][row]: P^T is rounded to bf16 and paired over consecutive keys,
//   V is repacked per block as (V[t][d], V[t+1][d]) pairs whose dword is broadcast.
// O^T is transposed once at the end and the generic finish writes the rows.
template <>
struct PrefillItem<VecAvx512, bf16_t> {
  using Kern = AttnKernel<VecAvx512, bf16_t>;
  static constexpr int KT = 8;  // keys per q.k tile (x2 row groups = 16 accumulators)
  static constexpr int DT = 8;  // d rows per P.V tile

  static int32_t pair_at(const bf16_t* p) {
    int32_t x;
    std::memcpy(&x, p, 4);
    return x;
  }

  // st[t][rows] (t in [ta, ta + nk)) = Q.K^T for row groups [g0, g0 + NG)
  template <int NG>
  static void qk(const int32_t* qp, int Rp, int g0, const bf16_t* kb, int64_t kst, int ta, int nk,
                 int D, float* st) {
    for (int t = ta; t < ta + nk; t += KT) {
      __m512 a[KT][NG];
      for (int k = 0; k < KT; ++k)
        for (int g = 0; g < NG; ++g) a[k][g] = _mm512_setzero_ps();
      const bf16_t* kr = kb + t * kst;
      for (int i = 0; i < D / 2; ++i) {
        __m512bh q[NG];
        for (int g = 0; g < NG; ++g)
          q[g] = (__m512bh)_mm512_loadu_si512(qp + i * Rp + (g0 + g) * 16);
#pragma GCC unroll 8
        for (int k = 0; k < KT; ++k) {
          const __m512bh kv = (__m512bh)_mm512_set1_epi32(pair_at(kr + k * kst + 2 * i));
          for (int g = 0; g < NG; ++g) a[k][g] = _mm512_dpbf16_ps(a[k][g], q[g], kv);
        }
      }
      for (int k = 0; k < KT; ++k)
        for (int g = 0; g < NG; ++g) _mm512_storeu_ps(st + (t + k) * Rp + (g0 + g) * 16, a[k][g]);
    }
  }

  // ot[d][rows] += P^T pairs pp[j][rows] . vp[j][d] over np key pairs, row groups [g0, g0+NG)
  template <int NG>
  static void pv(const int32_t* pp, const int32_t* vp, int np, int Rp, int g0, int D, float* ot) {
    for (int d0 = 0; d0 < D; d0 += DT) {
      __m512 a[DT][NG];
      for (int k = 0; k < DT; ++k)
        for (int g = 0; g < NG; ++g) a[k][g] = _mm512_loadu_ps(ot + (d0 + k) * Rp + (g0 + g) * 16);
      for (int j = 0; j < np; ++j) {
        __m512bh pr[NG];
        for (int g = 0; g < NG; ++g)
          pr[g] = (__m512bh)_mm512_loadu_si512(pp + j * Rp + (g0 + g) * 16);
#pragma GCC unroll 8
        for (int k = 0; k < DT; ++k) {
          const __m512bh vv = (__m512bh)_mm512_set1_epi32(vp[j * D + d0 + k]);
          for (int g = 0; g < NG; ++g) a[k][g] = _mm512_dpbf16_ps(a[k][g], pr[g], vv);
        }
      }
      for (int k = 0; k < DT; ++k)
        for (int g = 0; g < NG; ++g) _mm512_storeu_ps(ot + (d0 + k) * Rp + (g0 + g) * 16, a[k][g]);
    }
  }

  static bool run(const AttnParams& p, const WorkItem& it, float* scratch) {
    const int D = p.head_size, BS = p.block_size;
    const int G = p.num_heads / p.num_kv_heads;
    const int ntok = it.q_end - it.q_begin;
    const int R = ntok * G;
    if (it.heads() != 1 || R < 16 || BS % KT != 0) return false;
    const int Rp = (R + 15) / 16 * 16, NGt = Rp / 16;
    const int NP = BS / 2;
    // scratch layout (floats / int32s)
    const size_t need = static_cast<size_t>(D / 2) * Rp + static_cast<size_t>(D) * Rp +
                        static_cast<size_t>(BS) * Rp + static_cast<size_t>(NP) * Rp +
                        static_cast<size_t>(NP) * D + 8 * Rp + static_cast<size_t>(R) * D + 64;
    if (need > attn_scratch_floats(R, D, BS)) return false;
    int32_t* qp = reinterpret_cast<int32_t*>(scratch);  // [D/2][Rp] bf16 pairs of Q^T
    float* ot = scratch + (D / 2) * Rp;                   // [D][Rp] O^T accumulators
    float* st = ot + D * Rp;                              // [BS][Rp] scores / probabilities
    int32_t* pp = reinterpret_cast<int32_t*>(st + BS * Rp);  // [NP][Rp] bf16 pairs of P^T
    int32_t* vp = pp + NP * Rp;                           // [NP][D] bf16 pairs of V
    float* m = reinterpret_cast<float*>(vp + NP * D);     // [Rp] running max
    float* l = m + Rp;                                    // [Rp] running sum
    int32_t* lo = reinterpret_cast<int32_t*>(l + Rp);     // [Rp] first visible key
    int32_t* hi = lo + Rp;                                // [Rp] last visible key
    float* apos = reinterpret_cast<float*>(hi + Rp);      // [Rp] -position (ALiBi)
    float* slope = apos + Rp;                             // [Rp] ALiBi slope
    float* acc = slope + Rp;                              // [R][D] final rows

    const int64_t qs = p.query_start_loc[it.req];
    const int64_t q_len = p.query_start_loc[it.req + 1] - qs;
    const int64_t kv_len = p.seq_lens[it.req];
    int64_t ulo = INT64_MAX, uhi = -1;
    for (int r = 0; r < Rp; ++r) {
      lo[r] = 1, hi[r] = 0, apos[r] = 0.f, slope[r] = 0.f;  // padding rows: nothing visible
      m[r] = kNegInf, l[r] = 0.f;
    }
    for (int t = 0; t < ntok; ++t) {
      const int64_t ps = kv_len - q_len + it.q_begin + t;
      int64_t a = it.kv_begin, b = static_cast<int64_t>(it.kv_end) - 1;
      if (p.causal) b = std::min(b, ps);
      if (p.window_left >= 0) a = std::max(a, ps - p.window_left);
      if (p.window_right >= 0) b = std::min(b, ps + p.window_right);
      if (a <= b) {
        ulo = std::min(ulo, a);
        uhi = std::max(uhi, b);
      } else {
        a = 1, b = 0;
      }
      for (int g = 0; g < G; ++g) {
        const int r = t * G + g;
        lo[r] = static_cast<int32_t>(a);
        hi[r] = static_cast<int32_t>(b);
        apos[r] = -static_cast<float>(ps);
        if (p.alibi != nullptr) slope[r] = p.alibi[it.kv_head * G + g];
      }
    }
    // Q^T pairs; padding rows are zero.
    for (int i = 0; i < D / 2; ++i)
      for (int r = R; r < Rp; ++r) qp[i * Rp + r] = 0;
    for (int r = 0; r < R; ++r) {
      const bf16_t* q = Kern::q_row(p, qs + it.q_begin + r / G, it.kv_head * G + r % G);
      for (int i = 0; i < D / 2; ++i) qp[i * Rp + r] = pair_at(q + 2 * i);
    }
    for (int i = 0; i < D * Rp; i += 16) _mm512_storeu_ps(ot + i, _mm512_setzero_ps());

    if (ulo <= uhi) {
      const int32_t* bt = p.block_table + it.req * p.bt_stride;
      const bf16_t* kbase = static_cast<const bf16_t*>(p.k_cache) + it.kv_head * p.k_stride_head;
      const bf16_t* vbase = static_cast<const bf16_t*>(p.v_cache) + it.kv_head * p.v_stride_head;
      const __m512 ninf = _mm512_set1_ps(kNegInf), zero = _mm512_setzero_ps();
      const __m512 scale = _mm512_set1_ps(p.scale);
      const __m512i ilv = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                           1, 16, 0);
      for (int64_t blk = ulo / BS; blk <= uhi / BS; ++blk) {
        const int64_t base = blk * BS;
        const int t0 = static_cast<int>(std::max<int64_t>(ulo - base, 0));
        const int t1 = static_cast<int>(std::min<int64_t>(uhi + 1 - base, BS));
        const int ta = t0 / KT * KT, tb = (t1 + KT - 1) / KT * KT;  // tb <= BS
        const int64_t phys = bt[blk];
        const bf16_t* kb = kbase + phys * p.k_stride_block;
        const bf16_t* vb = vbase + phys * p.v_stride_block;
        // S^T = Q.K^T over keys [ta, tb) (rows of keys past t1 exist in the block; whatever
        // they hold is masked to -inf below).
        int g0 = 0;
        for (; g0 + 2 <= NGt; g0 += 2) qk<2>(qp, Rp, g0, kb, p.k_stride_tok, ta, tb - ta, D, st);
        if (g0 < NGt) qk<1>(qp, Rp, g0, kb, p.k_stride_tok, ta, tb - ta, D, st);

        // Online softmax, 16 rows per vector.
        for (int g = 0; g < NGt; ++g) {
          const int o = g * 16;
          const __m512i lov = _mm512_loadu_si512(lo + o), hiv = _mm512_loadu_si512(hi + o);
          const __m512 sl = _mm512_loadu_ps(slope + o);
          const __m512 ap = _mm512_add_ps(_mm512_loadu_ps(apos + o),
                                          _mm512_set1_ps(static_cast<float>(base)));
          const __m512 m_old = _mm512_loadu_ps(m + o);
          __m512 mx = m_old;
          for (int t = ta; t < tb; ++t) {
            __m512 s = _mm512_loadu_ps(st + t * Rp + o);
            if (p.softcap > 0.f) {
              const __m512 e = VecAvx512::exp(_mm512_mul_ps(s, _mm512_set1_ps(2.f * p.scale / p.softcap)));
              const __m512 one = _mm512_set1_ps(1.f);
              s = _mm512_mul_ps(_mm512_set1_ps(p.softcap),
                                _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one))));
            } else {
              s = _mm512_mul_ps(s, scale);
            }
            if (p.alibi != nullptr)
              s = _mm512_fmadd_ps(sl, _mm512_add_ps(ap, _mm512_set1_ps(static_cast<float>(t))), s);
            const __m512i kp = _mm512_set1_epi32(static_cast<int32_t>(base + t));
            const __mmask16 vis = _mm512_cmple_epi32_mask(lov, kp) & _mm512_cmple_epi32_mask(kp, hiv);
            s = _mm512_mask_mov_ps(ninf, vis, s);
            _mm512_storeu_ps(st + t * Rp + o, s);
            mx = _mm512_max_ps(mx, s);
          }
          // A row with nothing visible yet keeps m = -inf; subtract 0 there (exp(-inf) = 0).
          const __mmask16 live = _mm512_cmp_ps_mask(mx, ninf, _CMP_NEQ_OQ);
          const __m512 mu = _mm512_maskz_mov_ps(live, mx);
          const __mmask16 moved = _mm512_cmp_ps_mask(m_old, mx, _CMP_NEQ_OQ);
          const __m512 corr = _mm512_mask_mov_ps(_mm512_set1_ps(1.f), moved,
                                                 VecAvx512::exp(_mm512_sub_ps(m_old, mu)));
          __m512 sum = zero;
          for (int t = ta; t < tb; t += 2) {
            const __m512 e0 = VecAvx512::exp(_mm512_sub_ps(_mm512_loadu_ps(st + t * Rp + o), mu));
            const __m512 e1 = VecAvx512::exp(_mm512_sub_ps(_mm512_loadu_ps(st + (t + 1) * Rp + o), mu));
            sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
            const __m512i b = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);
            _mm512_storeu_si512(pp + (t - ta) / 2 * Rp + o, _mm512_permutexvar_epi16(ilv, b));
          }
          _mm512_storeu_ps(l + o, _mm512_fmadd_ps(_mm512_loadu_ps(l + o), corr, sum));
          _mm512_storeu_ps(m + o, mx);
          if (moved != 0)
            for (int d = 0; d < D; ++d)
              _mm512_storeu_ps(ot + d * Rp + o, _mm512_mul_ps(_mm512_loadu_ps(ot + d * Rp + o), corr));
        }

        // V pairs over keys [ta, tb); keys outside [t0, t1) are zero (never read them:
        // unwritten cache rows may hold NaN, and 0 * NaN would poison the sums).
        const int np = (tb - ta) / 2;
        for (int j = 0; j < np; ++j) {
          const int t = ta + 2 * j;
          const bool in0 = t >= t0 && t < t1, in1 = t + 1 >= t0 && t + 1 < t1;
          for (int d = 0; d < D; d += 16) {
            const __m512i x = in0 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                        reinterpret_cast<const __m256i*>(vb + t * p.v_stride_tok + d)))
                                  : _mm512_setzero_si512();
            const __m512i y = in1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                        reinterpret_cast<const __m256i*>(vb + (t + 1) * p.v_stride_tok + d)))
                                  : _mm512_setzero_si512();
            _mm512_storeu_si512(vp + j * D + d, _mm512_or_si512(x, _mm512_slli_epi32(y, 16)));
          }
        }
        g0 = 0;
        for (; g0 + 2 <= NGt; g0 += 2) pv<2>(pp, vp, np, Rp, g0, D, ot);
        if (g0 < NGt) pv<1>(pp, vp, np, Rp, g0, D, ot);
      }
    }

    for (int r = 0; r < R; ++r)
      for (int d = 0; d < D; ++d) acc[r * D + d] = ot[d * Rp + r];
    Kern::finish(p, it, acc, m, l);
    return true;
  }
};
