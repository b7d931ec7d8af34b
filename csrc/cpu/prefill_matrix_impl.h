// The matrix-engine prefill kernel: one work item (a tile of query rows of one kv head)
// as two GEMMs per tile of kMatrixKeys keys on oneDNN's brgemm microkernels (reached
// through MatrixEngine, so this TU stays torch-free), with the online-softmax step of
// online_softmax.h between them:
//
//   S[R, NK]  = Q[R, D] . K^T[D, NK]        (gemm 1: K packed on read, transposed)
//   S -> P    : scale/softcap, ALiBi, visibility mask, running max, exp (softmax_row)
//   O[R, D]  += P[R, NK] . V[NK, D]         (gemm 2: O rescaled first where a max moved)
//
// K and V tiles are gathered from the paged blocks and converted to the GEMM's element
// type while packed, so one cache layout serves every ISA and variant; fp8 caches are
// decoded there. Keys past the tile's last visible key are zero-padded, and their scores
// masked, so every GEMM of an item has the same shape (oneDNN JIT-compiles per shape).
// Included by attn_kernel_impl.h inside each ISA TU's anonymous namespace.

inline bool runs_on_matrix(const AttnParams& p, const WorkItem& it) {
  const int rows = (it.q_end - it.q_begin) * (p.num_heads / p.num_kv_heads);
  return p.matrix != nullptr && it.heads() == 1 && rows >= kMatrixMinRows;
}

template <class VO, class T, class C>
struct MatrixPrefill {
  using V = typename VO::V;
  static constexpr int W = VO::W;
  static constexpr int NK = kMatrixKeys;
  using Base = AttnKernel<VO, T, C>;

  // Rows [key0, key0 + NK) of one cache (K or V) of the item's kv head as fp32 rows: the
  // cache itself where those keys are fp32 rows of one block (*ld = its row stride), else
  // converted into buf [NK, D] (*ld = D), keys past key0 + n zeroed. *nonfinite: whether a
  // returned value is NaN or inf (checked only when asked: it costs a pass).
  static const float* fp32_rows(const AttnParams& p, const int32_t* bt, const C* base,
                                int64_t stride_block, int64_t stride_tok, int64_t key0, int n,
                                float* buf, int D, int64_t* ld, bool check, bool* nonfinite) {
    const int64_t BS = p.block_size;
    const auto row = [&](int64_t key) {
      return base + bt[key / BS] * stride_block + (key % BS) * stride_tok;
    };
    V bad = VO::zero();
    const float* out = buf;
    if (std::is_same<C, float>::value && n == NK && key0 % BS + NK <= BS) {
      out = reinterpret_cast<const float*>(row(key0));
      *ld = stride_tok;
      if (check)
        for (int j = 0; j < n; ++j)
          for (int d = 0; d < D; d += W)
            bad = VO::add(bad, VO::mul(VO::load(out + j * stride_tok + d), VO::zero()));
    } else {
      *ld = D;
      for (int j = 0; j < n; ++j) {
        const C* src = row(key0 + j);
        for (int d = 0; d < D; d += W) {
          const V x = VO::cvt_load(src + d);
          if (check) bad = VO::add(bad, VO::mul(x, VO::zero()));  // NaN iff x is NaN or inf
          VO::store(buf + j * D + d, x);
        }
      }
      for (int j = n; j < NK; ++j)
        for (int d = 0; d < D; d += W) VO::store(buf + j * D + d, VO::zero());
    }
    *nonfinite = check && VO::hsum(bad) != 0.f;
    return out;
  }

  // bf16 queries over bf16 or fp8 caches take the bf16 microkernel where one runs (AMX,
  // AVX512-BF16): fp8 values are exact in bf16, fp16 ones are not.
  static constexpr bool kBf16Inputs =
      std::is_same<T, bf16_t>::value && !std::is_same<C, fp16_t>::value;

  static void run(const AttnParams& p, const WorkItem& it, float* scratch) {
    if constexpr (kBf16Inputs)
      if (p.matrix->gemm_bf16_vnni != nullptr) return run_bf16(p, it, scratch);
    run_f32(p, it, scratch);
  }

  static void run_f32(const AttnParams& p, const WorkItem& it, float* scratch) {
    const int D = p.head_size;
    const int G = p.num_heads / p.num_kv_heads;
    const int64_t qs = p.query_start_loc[it.req];
    const int64_t q_len = p.query_start_loc[it.req + 1] - qs;
    const int64_t kv_len = p.seq_lens[it.req];
    const int R = (it.q_end - it.q_begin) * G;  // one kv head: rows = tokens x group
    const int Rp = (R + W - 1) / W * W;
    const int lds = NK + W;

    // Scores come out of the first GEMM transposed (S^T = K . Q^T: K rows feed it straight
    // from the cache, and only Q, once per item, is transposed); the NK x R tile is then
    // transposed for the row-wise softmax, which costs far less than transposing K.
    float* acc = scratch;                                     // [R, D]
    float* qt = acc + R * D;                                  // [D, Rp]
    float* kbuf = qt + D * Rp;                                // [NK, D]
    float* vbuf = kbuf + NK * D;                              // [NK, D]
    float* st = vbuf + NK * D;                                // [NK, Rp]
    float* S = st + NK * Rp;                                  // [R, lds]
    float* m = S + R * lds;                                   // [R]
    float* l = m + R;                                         // [R]
    int64_t* lo = reinterpret_cast<int64_t*>(                 // [R] visible keys [lo, hi]
        (reinterpret_cast<uintptr_t>(l + R) + 7) / 8 * 8);
    int64_t* hi = lo + R;
    int64_t* pos = hi + R;                                    // [R] query positions

    int64_t ulo = INT64_MAX, uhi = -1;  // union of the rows' visible ranges
    for (int d = 0; d < D; ++d)
      for (int r = R; r < Rp; ++r) qt[d * Rp + r] = 0.f;
    for (int r = 0; r < R; ++r) {
      const int t = r / G;
      pos[r] = kv_len - q_len + it.q_begin + t;
      const KeyRange keys = visible_key_range(p, pos[r], it.kv_begin, it.kv_end);
      lo[r] = keys.first;
      hi[r] = keys.last;
      if (keys.first <= keys.last) {
        ulo = std::min(ulo, keys.first);
        uhi = std::max(uhi, keys.last);
      }
      const T* q = Base::q_row(p, qs + it.q_begin + t, it.kv_head * G + r % G);
      for (int d = 0; d < D; d += W) VO::store(acc + r * D + d, VO::cvt_load(q + d));
      for (int d = 0; d < D; ++d) qt[d * Rp + r] = acc[r * D + d];
      for (int d = 0; d < D; d += W) VO::store(acc + r * D + d, VO::zero());
      m[r] = kNegInf;
      l[r] = 0.f;
    }

    const ScoreTransform<VO> tr(p);
    const int32_t* bt = p.block_table + it.req * p.bt_stride;
    const C* kbase = static_cast<const C*>(p.k_cache) + it.kv_head * p.k_stride_head;
    const C* vbase = static_cast<const C*>(p.v_cache) + it.kv_head * p.v_stride_head;
    for (int64_t key0 = ulo; key0 <= uhi; key0 += NK) {
      const int n = static_cast<int>(std::min<int64_t>(NK, uhi + 1 - key0));
      int64_t ldk, ldv;
      bool unused, nonfinite;
      const float* k = fp32_rows(p, bt, kbase, p.k_stride_block, p.k_stride_tok, key0, n, kbuf,
                                 D, &ldk, false, &unused);
      p.matrix->gemm_f32(NK, Rp, D, ldk, Rp, Rp, false, k, qt, st);
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < NK; ++j) S[r * lds + j] = st[j * Rp + r];
      for (int r = 0; r < R; ++r)
        Base::softmax_row(p, tr, it.kv_head * G + r % G, S + r * lds, key0, 0, NK, lo[r],
                          hi[r], pos[r], m + r, l + r, acc + r * D, D);
      // A key a row cannot see must add nothing to it, not 0 * V (NaN for a non-finite
      // value): where rows see different keys of a tile holding one, sum each row's own.
      const bool partial = !every_row_sees(lo, hi, R, key0, key0 + n - 1);
      const float* v = fp32_rows(p, bt, vbase, p.v_stride_block, p.v_stride_tok, key0, n, vbuf,
                                 D, &ldv, partial, &nonfinite);
      if (nonfinite)
        accumulate_visible(S, lds, R, v, ldv, key0, n, lo, hi, acc, D);
      else
        p.matrix->gemm_f32(R, D, NK, lds, ldv, D, true, S, v, acc);
    }
    Base::finish(p, it, acc, m, l);
  }

  // The item's rows: visible ranges, positions, running state; [ulo, uhi] their union.
  struct Rows {
    float *m, *l;
    int64_t *lo, *hi, *pos;
    int64_t ulo = INT64_MAX, uhi = -1;
  };
  static Rows init_rows(const AttnParams& p, const WorkItem& it, int R, float* at) {
    const int G = p.num_heads / p.num_kv_heads;
    const int64_t q_len = p.query_start_loc[it.req + 1] - p.query_start_loc[it.req];
    const int64_t kv_len = p.seq_lens[it.req];
    Rows rows;
    rows.m = at;
    rows.l = at + R;
    rows.lo = reinterpret_cast<int64_t*>((reinterpret_cast<uintptr_t>(at + 2 * R) + 7) / 8 * 8);
    rows.hi = rows.lo + R;
    rows.pos = rows.hi + R;
    for (int r = 0; r < R; ++r) {
      rows.pos[r] = kv_len - q_len + it.q_begin + r / G;
      const KeyRange keys = visible_key_range(p, rows.pos[r], it.kv_begin, it.kv_end);
      rows.lo[r] = keys.first;
      rows.hi[r] = keys.last;
      if (keys.first <= keys.last) {
        rows.ulo = std::min(rows.ulo, keys.first);
        rows.uhi = std::max(rows.uhi, keys.last);
      }
      rows.m[r] = kNegInf;
      rows.l[r] = 0.f;
    }
    return rows;
  }

  // bf16 row of `src` (D values of C), rounded to nearest even (exact for bf16 and fp8).
  static void bf16_row(const C* src, bf16_t* dst, int D) {
    if constexpr (std::is_same<C, bf16_t>::value) std::memcpy(dst, src, sizeof(bf16_t) * D);
    else for (int d = 0; d < D; d += W) VO::cvt_store(dst + d, VO::cvt_load(src + d));
  }

  // The same two GEMMs on bf16 inputs: K rows as A (bf16 caches of one block in place),
  // Q^T packed once in the VNNI layout [D / 2][Rp][2], V tiles packed as [NK / 2][D][2],
  // and the probabilities rounded to bf16 for the second GEMM, as every AMX flash kernel
  // does (their fp32 sums are exact; the rounding is below bf16 outputs' own).
  static void run_bf16(const AttnParams& p, const WorkItem& it, float* scratch) {
    const int D = p.head_size;
    const int G = p.num_heads / p.num_kv_heads;
    const int64_t qs = p.query_start_loc[it.req];
    const int R = (it.q_end - it.q_begin) * G;
    const int Rp = (R + W - 1) / W * W;
    const int lds = NK + W;
    const int64_t BS = p.block_size;

    float* acc = scratch;                                           // [R, D]
    float* st = acc + R * D;                                        // [NK, Rp]
    float* S = st + NK * Rp;                                        // [R, lds]
    float* vrows = S + R * lds;                                     // [NK, D] (rare path)
    bf16_t* qv = reinterpret_cast<bf16_t*>(vrows + NK * D);         // [D / 2][Rp][2]
    bf16_t* kb = qv + D * Rp;                                       // [NK, D]
    bf16_t* vv = kb + NK * D;                                       // [NK / 2][D][2]
    bf16_t* P = vv + NK * D;                                        // [R, NK]
    bf16_t* row = P + R * NK;                                       // [2, D]
    Rows rows = init_rows(p, it, R, reinterpret_cast<float*>(row + 2 * D + 32));

    std::memset(static_cast<void*>(qv), 0, sizeof(bf16_t) * D * Rp);
    for (int r = 0; r < R; ++r) {
      const T* q = Base::q_row(p, qs + it.q_begin + r / G, it.kv_head * G + r % G);
      const bf16_t* qb = reinterpret_cast<const bf16_t*>(q);  // T is bf16 here
      for (int d = 0; d < D; ++d) qv[(d / 2) * 2 * Rp + 2 * r + d % 2] = qb[d];
      for (int d = 0; d < D; d += W) VO::store(acc + r * D + d, VO::zero());
    }

    const ScoreTransform<VO> tr(p);
    const int32_t* bt = p.block_table + it.req * p.bt_stride;
    const C* kbase = static_cast<const C*>(p.k_cache) + it.kv_head * p.k_stride_head;
    const C* vbase = static_cast<const C*>(p.v_cache) + it.kv_head * p.v_stride_head;
    const auto cache_row = [&](const C* base, int64_t stride_block, int64_t stride_tok,
                               int64_t key) {
      return base + bt[key / BS] * stride_block + (key % BS) * stride_tok;
    };
    for (int64_t key0 = rows.ulo; key0 <= rows.uhi; key0 += NK) {
      const int n = static_cast<int>(std::min<int64_t>(NK, rows.uhi + 1 - key0));
      const bf16_t* k = kb;
      int64_t ldk = D;
      if (std::is_same<C, bf16_t>::value && n == NK && key0 % BS + NK <= BS) {
        k = reinterpret_cast<const bf16_t*>(
            cache_row(kbase, p.k_stride_block, p.k_stride_tok, key0));
        ldk = p.k_stride_tok;
      } else {
        for (int j = 0; j < n; ++j)
          bf16_row(cache_row(kbase, p.k_stride_block, p.k_stride_tok, key0 + j), kb + j * D, D);
        std::memset(static_cast<void*>(kb + n * D), 0, sizeof(bf16_t) * (NK - n) * D);
      }
      p.matrix->gemm_bf16_vnni(NK, Rp, D, ldk, Rp, Rp, false, k, qv, st);
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < NK; ++j) S[r * lds + j] = st[j * Rp + r];
      for (int r = 0; r < R; ++r)
        Base::softmax_row(p, tr, it.kv_head * G + r % G, S + r * lds, key0, 0, NK,
                          rows.lo[r], rows.hi[r], rows.pos[r], rows.m + r, rows.l + r,
                          acc + r * D, D);
      bool nonfinite = false;
      if (!every_row_sees(rows.lo, rows.hi, R, key0, key0 + n - 1)) {
        int64_t ldv;
        const float* v = fp32_rows(p, bt, vbase, p.v_stride_block, p.v_stride_tok, key0, n,
                                   vrows, D, &ldv, true, &nonfinite);
        if (nonfinite) accumulate_visible(S, lds, R, v, ldv, key0, n, rows.lo, rows.hi, acc, D);
      }
      if (nonfinite) continue;
      for (int j = 0; j < NK; j += 2) {
        bf16_t* pair = vv + (j / 2) * 2 * D;
        for (int h = 0; h < 2; ++h) {
          if (j + h < n)
            bf16_row(cache_row(vbase, p.v_stride_block, p.v_stride_tok, key0 + j + h), row, D);
          else
            std::memset(static_cast<void*>(row), 0, sizeof(bf16_t) * D);
          for (int d = 0; d < D; ++d) pair[2 * d + h] = row[d];
        }
      }
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < NK; j += W) VO::cvt_store(P + r * NK + j, VO::load(S + r * lds + j));
      p.matrix->gemm_bf16_vnni(R, D, NK, NK, D, D, true, P, vv, acc);
    }
    Base::finish(p, it, acc, rows.m, rows.l);
  }

  static void accumulate_visible(const float* P, int lds, int R, const float* v, int64_t ldv,
                                 int64_t key0, int n, const int64_t* lo, const int64_t* hi,
                                 float* acc, int D) {
    for (int r = 0; r < R; ++r) {
      const int a = static_cast<int>(std::max<int64_t>(0, lo[r] - key0));
      const int b = static_cast<int>(std::min<int64_t>(n - 1, hi[r] - key0));
      for (int t = a; t <= b; ++t) {
        const V pt = VO::set1(P[r * lds + t]);
        for (int d = 0; d < D; d += W)
          VO::store(acc + r * D + d,
                    VO::fma(pt, VO::load(v + t * ldv + d), VO::load(acc + r * D + d)));
      }
    }
  }
};
