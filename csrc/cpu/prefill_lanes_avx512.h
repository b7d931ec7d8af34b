// Prefill items (>= 16 query rows of one kv head) with query rows in vector lanes: bf16 with
// AVX512-BF16 dot products, fp32 with FMA. Included by kernels_avx512*.cpp after
// attn_kernel_impl.h; each TU specializes the PrefillItem hook for the dtypes its target
// supports (LanesPrefill<bf16_t> needs AVX512-BF16, LanesPrefill<float> only AVX512F).
//
// Why rows in lanes: the generic path puts keys in lanes, so every q.k ends in a horizontal
// lane reduction and softmax is per-row scalar bookkeeping. With S^T[key][row] tiles:
// - q.k is an outer product: Q^T is packed once per item ([D][rows] fp32, or bf16 pairs
//   [D/2][rows]) and each key's element (pair) is broadcast straight from the cache
//   ({1to16} operand); a KT keys x 2 row-groups register tile, no reductions.
// - online softmax is elementwise over 16 rows at once (max/sum across keys are plain
//   vmax/vadd); the mask is two integer compares per key (lanes_softmax_block,
//   online_softmax.h, shared with the AVX2 kernel).
// - P.V accumulates O^T[d][row] += P^T[t][row] * V[t][d] with V[t][d] broadcast. bf16 rounds
//   P^T to bf16 pairs over consecutive keys and repacks V per block as (V[t][d], V[t+1][d])
//   pairs so one vdpbf16ps covers two keys.
// O^T is transposed once at the end and AttnKernel::finish writes the rows.
template <class T>
struct LanesPrefill {
  static constexpr bool kBf16 = std::is_same<T, bf16_t>::value;
  static constexpr int KT = 8;  // keys per q.k tile (x 2 row groups = 16 accumulators)
  static constexpr int DT = 8;  // d rows per P.V tile
  static constexpr int QS = kBf16 ? 2 : 1;  // d per packed Q^T / V element
  using Kern = AttnKernel<VecAvx512, T>;

  static int32_t pair_at(const bf16_t* p) {
    int32_t x;
    std::memcpy(&x, p, 4);
    return x;
  }
  // acc + q * {1to16} broadcast of *x, as one instruction: left to itself GCC emits a
  // separate vbroadcastss per key element, and those broadcasts took ~30% of fp32 prefill's
  // cycles (perf) while the FMA units waited.
  static __m512 fma_bcast(__m512 acc, __m512 q, const float* x) {
    asm("vfmadd231ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(q), "m"(*x));
    return acc;
  }
  // Same with the address as base[i] in one base + index operand (GCC would add an lea per
  // FMA for "m"(base[i])). The cache is read-only here, so no memory operand is declared.
  static __m512 fma_bcast(__m512 acc, __m512 q, const float* base, int64_t i) {
    asm("vfmadd231ps (%2,%3,4)%{1to16%}, %1, %0" : "+v"(acc) : "v"(q), "r"(base), "r"(i));
    return acc;
  }
  // acc += q * broadcast(k element at kp): one d pair (bf16) or one d (fp32).
  static __m512 mac(__m512 acc, __m512 q, const T* kp) {
    if constexpr (kBf16)
      return _mm512_dpbf16_ps(acc, (__m512bh)q, (__m512bh)_mm512_set1_epi32(pair_at(kp)));
    else
      return fma_bcast(acc, q, kp);
  }

  // In-register transpose of a 16 x 16 matrix of 32-bit elements (r[i] = row i).
  static void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // r[4i + j], 128-bit lane k: column 4k + j, rows 4i..4i+3
      r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
      r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
      r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
      r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int j = 0; j < 4; ++j) {
      const __m512 v0 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
      const __m512 v1 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xDD);
      const __m512 w0 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
      const __m512 w1 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xDD);
      t[j] = _mm512_shuffle_f32x4(v0, w0, 0x88);
      t[8 + j] = _mm512_shuffle_f32x4(v0, w0, 0xDD);
      t[4 + j] = _mm512_shuffle_f32x4(v1, w1, 0x88);
      t[12 + j] = _mm512_shuffle_f32x4(v1, w1, 0xDD);
    }
    for (int i = 0; i < 16; ++i) r[i] = t[i];
  }

  // st[t][rows] (t in [ta, tb)) = Q.K^T for row groups [g0, g0 + NG)
  template <int NG>
  static void qk(const float* qp, int Rp, int g0, const T* kb, int64_t kst, int ta, int tb, int D,
                 float* st) {
    for (int t = ta; t < tb; t += KT) {
      __m512 a[KT][NG];
      for (int k = 0; k < KT; ++k)
        for (int g = 0; g < NG; ++g) a[k][g] = _mm512_setzero_ps();
      // One pointer per key row, indexed by the d loop counter: keeps every operand
      // address a single base + index form (no per-FMA address arithmetic).
      const T* kr[KT];
      for (int k = 0; k < KT; ++k) kr[k] = kb + (t + k) * kst;
      const float* qi = qp + g0 * 16;
      for (int i = 0; i < D / QS; ++i, qi += Rp) {
        __m512 q[NG];
        for (int g = 0; g < NG; ++g) q[g] = _mm512_loadu_ps(qi + g * 16);
#pragma GCC unroll 8
        for (int k = 0; k < KT; ++k)
          for (int g = 0; g < NG; ++g) {
            if constexpr (kBf16)
              a[k][g] = mac(a[k][g], q[g], kr[k] + QS * i);
            else
              a[k][g] = fma_bcast(a[k][g], q[g], kr[k], i);
          }
      }
      for (int k = 0; k < KT; ++k)
        for (int g = 0; g < NG; ++g) _mm512_storeu_ps(st + (t + k) * Rp + (g0 + g) * 16, a[k][g]);
    }
  }

  // ot[d][rows] += sum_j P[j][rows] * Vb[j][d] for j in [j0, j1), row groups [g0, g0 + NG):
  // bf16: P = pairs of P^T, Vb = V pairs (vst = D); fp32: P = P^T, Vb = the cache block.
  template <int NG>
  static void pv(const float* P, const T* vb, int64_t vst, int j0, int j1, int Rp, int g0, int D,
                 float* ot) {
    for (int d0 = 0; d0 < D; d0 += DT) {
      __m512 a[DT][NG];
      for (int k = 0; k < DT; ++k)
        for (int g = 0; g < NG; ++g) a[k][g] = _mm512_loadu_ps(ot + (d0 + k) * Rp + (g0 + g) * 16);
      const float* pj = P + j0 * Rp + g0 * 16;
      const T* vj = vb + j0 * vst + QS * d0;
      for (int j = j0; j < j1; ++j, pj += Rp, vj += vst) {
        __m512 pr[NG];
        for (int g = 0; g < NG; ++g) pr[g] = _mm512_loadu_ps(pj + g * 16);
#pragma GCC unroll 8
        for (int k = 0; k < DT; ++k)
          for (int g = 0; g < NG; ++g) a[k][g] = mac(a[k][g], pr[g], vj + QS * k);
      }
      for (int k = 0; k < DT; ++k)
        for (int g = 0; g < NG; ++g) _mm512_storeu_ps(ot + (d0 + k) * Rp + (g0 + g) * 16, a[k][g]);
    }
  }

  // The shared P.V of one block for a block whose V holds NaN/inf and whose rows see
  // different keys: each row sums only the keys it sees (rare; scalar).
  static void pv_each_row_own_keys(const float* st, const float* pp, const T* vb, int64_t vst,
                                   int64_t base, int ta, int t0, int t1, const int32_t* lo,
                                   const int32_t* hi, int R, int Rp, int D, float* ot) {
    for (int r = 0; r < R; ++r) {
      const int a = static_cast<int>(std::max<int64_t>(t0, lo[r] - base));
      const int b = static_cast<int>(std::min<int64_t>(t1, hi[r] + 1 - base));
      for (int t = a; t < b; ++t) {
        float pr;
        if constexpr (kBf16) {  // the bf16-rounded probability the pairs path uses
          uint32_t pair;
          std::memcpy(&pair, pp + (t - ta) / 2 * Rp + r, 4);
          pr = bf16_to_float(static_cast<uint16_t>((t - ta) % 2 ? pair >> 16 : pair & 0xFFFF));
        } else {
          pr = st[t * Rp + r];
        }
        for (int d = 0; d < D; ++d) ot[d * Rp + r] += pr * VecScalar::cvt_load(vb + t * vst + d);
      }
    }
  }

  // qk / pv over all NG row groups, two at a time.
  static void qk_groups(const float* qp, int Rp, int NG, const T* kb, int64_t kst, int ta, int tb,
                        int D, float* st) {
    int g0 = 0;
    for (; g0 + 2 <= NG; g0 += 2) qk<2>(qp, Rp, g0, kb, kst, ta, tb, D, st);
    if (g0 < NG) qk<1>(qp, Rp, g0, kb, kst, ta, tb, D, st);
  }
  static void pv_groups(const float* P, const T* vb, int64_t vst, int j0, int j1, int Rp, int NG,
                        int D, float* ot) {
    int g0 = 0;
    for (; g0 + 2 <= NG; g0 += 2) pv<2>(P, vb, vst, j0, j1, Rp, g0, D, ot);
    if (g0 < NG) pv<1>(P, vb, vst, j0, j1, Rp, g0, D, ot);
  }

  // qp [D/QS][Rp] = Q^T of the item's R rows, 16 rows x 16 words (fp32 elements or bf16
  // pairs) at a time; padding rows are 0.
  static void pack_qt(const AttnParams& p, const WorkItem& it, int R, int Rp, float* qp) {
    const int D = p.head_size;
    const int G = p.num_heads / p.num_kv_heads;
    const int64_t qs = p.query_start_loc[it.req];
    const int U = D / QS;
    for (int r0 = 0; r0 < Rp; r0 += 16)
      for (int u0 = 0; u0 < U; u0 += 16) {
        const __mmask16 mk = U - u0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (U - u0)) - 1);
        __m512 x[16];
        for (int i = 0; i < 16; ++i) {
          const int r = r0 + i;
          x[i] = r < R ? _mm512_maskz_loadu_ps(mk, Kern::q_row(p, qs + it.q_begin + r / G,
                                                               it.kv_head * G + r % G) + QS * u0)
                       : _mm512_setzero_ps();
        }
        transpose16(x);
        for (int j = 0; j < 16 && u0 + j < U; ++j) _mm512_storeu_ps(qp + (u0 + j) * Rp + r0, x[j]);
      }
  }

  // vp [np][2D] = (V[t][d], V[t+1][d]) bf16 pairs over keys [ta, tb), np = (tb - ta) / 2;
  // keys outside [t0, t1) are zero (never read them: unwritten cache rows may hold NaN,
  // and 0 * NaN would poison the sums).
  static int pack_v_pairs(const T* vb, int64_t vst, int ta, int tb, int t0, int t1, int D, T* vp) {
    const int np = (tb - ta) / 2;
    for (int j = 0; j < np; ++j) {
      const int t = ta + 2 * j;
      const bool in0 = t >= t0 && t < t1, in1 = t + 1 >= t0 && t + 1 < t1;
      for (int d = 0; d < D; d += 16) {
        const auto row = [&](int tt) {
          return _mm512_cvtepu16_epi32(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vb + tt * vst + d)));
        };
        const __m512i x = in0 ? row(t) : _mm512_setzero_si512();
        const __m512i y = in1 ? row(t + 1) : _mm512_setzero_si512();
        _mm512_storeu_si512(vp + j * 2 * D + 2 * d, _mm512_or_si512(x, _mm512_slli_epi32(y, 16)));
      }
    }
    return np;
  }

  // acc [R][D] = the first R rows of (O^T [D][Rp])^T.
  static void store_rows(const float* ot, int R, int Rp, int D, float* acc) {
    for (int r0 = 0; r0 < Rp; r0 += 16)
      for (int d0 = 0; d0 < D; d0 += 16) {
        __m512 x[16];
        for (int i = 0; i < 16; ++i) x[i] = _mm512_loadu_ps(ot + (d0 + i) * Rp + r0);
        transpose16(x);
        for (int j = 0; j < 16 && r0 + j < R; ++j) _mm512_storeu_ps(acc + (r0 + j) * D + d0, x[j]);
      }
  }

  static bool run(const AttnParams& p, const WorkItem& it, float* scratch) {
    const int D = p.head_size, BS = p.block_size;
    const int G = p.num_heads / p.num_kv_heads;
    const int ntok = it.q_end - it.q_begin;
    const int R = ntok * G;
    if (it.heads() != 1 || R < 16 || BS % KT != 0) return false;
    const int Rp = (R + 15) / 16 * 16, NG = Rp / 16;
    const int NP = BS / 2;
    const size_t need = static_cast<size_t>(D / QS) * Rp + static_cast<size_t>(D) * Rp +
                        static_cast<size_t>(BS) * Rp + (kBf16 ? static_cast<size_t>(NP) * (Rp + D) : 0) +
                        LaneRows::kFloatsPerRow * static_cast<size_t>(Rp) + static_cast<size_t>(R) * D;
    if (need > attn_scratch_floats(R, D, BS)) return false;
    float* qp = scratch;                 // [D/QS][Rp] Q^T (bf16: pairs as 32-bit words)
    float* ot = qp + (D / QS) * Rp;      // [D][Rp] O^T accumulators
    float* st = ot + D * Rp;             // [BS][Rp] scores, then probabilities
    float* pp = st + BS * Rp;            // bf16: [NP][Rp] pairs of P^T
    T* vp = reinterpret_cast<T*>(pp + (kBf16 ? NP * Rp : 0));  // bf16: [NP][D] V pairs
    const LaneRows rows =  // softmax state
        LaneRows::at(reinterpret_cast<float*>(vp) + (kBf16 ? NP * D : 0), Rp);
    const int32_t *lo = rows.lo, *hi = rows.hi;
    float* acc = rows.slope + Rp;  // [R][D] rows for finish

    int64_t ulo, uhi;
    init_lane_rows(p, it, Rp, rows, &ulo, &uhi);
    pack_qt(p, it, R, Rp, qp);
    for (int i = 0; i < D * Rp; i += 16) _mm512_storeu_ps(ot + i, _mm512_setzero_ps());

    if (ulo <= uhi) {
      const int32_t* bt = p.block_table + it.req * p.bt_stride;
      const T* kbase = static_cast<const T*>(p.k_cache) + it.kv_head * p.k_stride_head;
      const T* vbase = static_cast<const T*>(p.v_cache) + it.kv_head * p.v_stride_head;
      for (int64_t blk = ulo / BS; blk <= uhi / BS; ++blk) {
        const int64_t base = blk * BS;
        const int t0 = static_cast<int>(std::max<int64_t>(ulo - base, 0));
        const int t1 = static_cast<int>(std::min<int64_t>(uhi + 1 - base, BS));
        const int ta = t0 / KT * KT, tb = (t1 + KT - 1) / KT * KT;  // tb <= BS
        const int64_t phys = bt[blk];
        const T* kb = kbase + phys * p.k_stride_block;
        const T* vb = vbase + phys * p.v_stride_block;
        // Keys [ta, tb) exist in the block; what those past t1 hold is masked to -inf below.
        qk_groups(qp, Rp, NG, kb, p.k_stride_tok, ta, tb, D, st);

        // Online softmax, 16 rows per vector, 2 keys a step.
        lanes_softmax_block<VecAvx512, 2>(p, rows, Rp, base, ta, tb, st, ot, D,
                                          [&](int o, int t, const __m512* e) {
          if constexpr (kBf16) {  // (p_t, p_t+1) bf16 pairs per row, round to nearest even
            const __m512i ilv = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                                 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                                                 18, 2, 17, 1, 16, 0);
            const __m512i b = (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]);
            _mm512_storeu_si512(pp + (t - ta) / 2 * Rp + o, _mm512_permutexvar_epi16(ilv, b));
          } else {
            _mm512_storeu_ps(st + t * Rp + o, e[0]);
            _mm512_storeu_ps(st + (t + 1) * Rp + o, e[1]);
          }
        });

        if (!every_row_sees(lo, hi, R, base + t0, base + t1 - 1) &&
            rows_have_nonfinite(vb, p.v_stride_tok, t0, t1, D)) {
          pv_each_row_own_keys(st, pp, vb, p.v_stride_tok, base, ta, t0, t1, lo, hi, R, Rp, D, ot);
          continue;
        }
        if constexpr (kBf16) {
          const int np = pack_v_pairs(vb, p.v_stride_tok, ta, tb, t0, t1, D, vp);
          pv_groups(pp, vp, 2 * D, 0, np, Rp, NG, D, ot);
        } else {  // only keys [t0, t1): the others may be NaN (see pack_v_pairs)
          pv_groups(st, vb, p.v_stride_tok, t0, t1, Rp, NG, D, ot);
        }
      }
    }

    store_rows(ot, R, Rp, D, acc);
    Kern::finish(p, it, acc, rows.m, rows.l);
    return true;
  }
};
