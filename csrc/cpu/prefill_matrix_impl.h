// The matrix-engine prefill kernel: one work item (a tile of query rows of one kv head)
// as two GEMMs of one shape per K/V tile of NK = matrix_tile_keys(D) keys, on oneDNN's
// brgemm microkernels (reached through MatrixEngine, so this TU stays torch-free), with
// the online-softmax step of online_softmax.h between them:
//
//   S[M, NK]  = Q[M, D] . K^T[D, NK]        (Q rows as A, K^T packed as B: no transpose)
//   S -> P    : scale/softcap, ALiBi, masks (tiles a row sees only in part), lazy running
//               max, vector exp, one max, sum and rescale per row and tile (softmax_tile)
//   O[M, D]  += P[M, NK] . V[NK, D]         (V packed as B)
//
// K/V tiles are packed once per call for every (request, kv head) that has matrix items
// (pack_tiles, run by the op before the items: kernel_api.h MatrixPack), and every query
// tile of that head reads them; requests the call did not pack (a size cap) pack each tile
// as their items read it, with the same routine. Packing converts to the GEMMs' element
// type (fp8 decoded, fp16 widened), so one cache layout serves every ISA and variant; keys
// the request cannot see are zeros. Rows are padded to M = matrix_gemm_rows(R) (zero
// queries), so the GEMMs keep one shape per head size and oneDNN JIT-compiles few kernels.
// Included by attn_kernel_impl.h inside each ISA TU's anonymous namespace.

inline bool runs_on_matrix(const AttnParams& p, const WorkItem& it) {
  return item_runs_on_matrix(p, it.q_end - it.q_begin, it.kv_heads);
}

template <class VO, class T, class C>
struct MatrixPrefill {
  using V = typename VO::V;
  static constexpr int W = VO::W;
  using Base = AttnKernel<VO, T, C>;
  using Pack = TilePack<VO>;

  // bf16 queries over bf16 or fp8 caches may take the bf16 microkernel (matrix_uses_bf16).
  static constexpr bool kBf16Inputs =
      std::is_same<T, bf16_t>::value && !std::is_same<C, fp16_t>::value;

  // ---- packing ----

  // Row of key `key` of one cache (K or V) of kv head h as E: the cache row itself where
  // it is stored as E, else converted into `conv` (exact: fp8 -> bf16, anything -> fp32).
  template <class E>
  static const E* key_row(const AttnParams& p, const int32_t* bt, const C* base,
                          int64_t stride_block, int64_t stride_tok, int64_t key, E* conv) {
    const int64_t BS = p.block_size;
    const C* src = base + bt[key / BS] * stride_block + (key % BS) * stride_tok;
    if constexpr (std::is_same<C, E>::value) {
      return src;
    } else {
      for (int d = 0; d < p.head_size; d += W) VO::cvt_store(conv + d, VO::cvt_load(src + d));
      return conv;
    }
  }

  // Packs key tile t (keys [t * NK, (t + 1) * NK)) of request req, kv head h into
  // dst (K^T then V, MatrixPack's layout); keys outside vis are zeros. conv: 2 * NK * D
  // elements. Returns whether the tile's V holds a NaN or inf.
  template <class E>
  static bool pack_tile(const AttnParams& p, int req, int h, int64_t t, int NK, KeyRange vis,
                        E* dst, E* conv) {
    const int D = p.head_size;
    const int32_t* bt = p.block_table + req * p.bt_stride;
    const C* kbase = static_cast<const C*>(p.k_cache) + h * p.k_stride_head;
    const C* vbase = static_cast<const C*>(p.v_cache) + h * p.v_stride_head;
    const E* krows[256];
    const E* vrows[256];
    const int64_t key0 = t * NK;
    for (int j = 0; j < NK; ++j) {
      const int64_t key = key0 + j;
      const bool seen = key >= vis.first && key <= vis.last;
      krows[j] = seen ? key_row<E>(p, bt, kbase, p.k_stride_block, p.k_stride_tok, key,
                                   conv + j * D) : nullptr;
      vrows[j] = seen ? key_row<E>(p, bt, vbase, p.v_stride_block, p.v_stride_tok, key,
                                   conv + (NK + j) * D) : nullptr;
    }
    E* kt = dst;
    E* vt = dst + static_cast<int64_t>(NK) * D;
    const int words = static_cast<int>(D * sizeof(E) / 4);
    Pack::transpose32(reinterpret_cast<const uint32_t* const*>(krows), NK, words,
                      reinterpret_cast<uint32_t*>(kt));
    if constexpr (std::is_same<E, bf16_t>::value) {
      Pack::interleave16(reinterpret_cast<const uint16_t* const*>(vrows), NK, D,
                         reinterpret_cast<uint32_t*>(vt));
      return Pack::nonfinite_bf16(reinterpret_cast<const uint16_t*>(vt), int64_t{NK} * D);
    } else {
      for (int j = 0; j < NK; ++j) {
        if (vrows[j]) std::memcpy(vt + j * D, vrows[j], sizeof(float) * D);
        else std::memset(static_cast<void*>(vt + j * D), 0, sizeof(float) * D);
      }
      return Pack::nonfinite_f32(reinterpret_cast<const uint32_t*>(vt), int64_t{NK} * D);
    }
  }

  static KeyRange request_keys(const AttnParams& p, int req) {
    return request_key_range(p, p.query_start_loc[req + 1] - int64_t{p.query_start_loc[req]},
                             p.seq_lens[req]);
  }

  template <class E>
  static void pack_tiles_as(const AttnParams& p, int req, int h, int64_t t_begin, int64_t t_end,
                            float* scratch) {
    const MatrixPack& pk = *p.packed;
    const int64_t* rq = pk.req + 3 * req;
    const KeyRange vis = request_keys(p, req);
    for (int64_t t = t_begin; t < t_end; ++t) {
      const int64_t idx = rq[0] + h * rq[2] + (t - rq[1]);
      E* dst = static_cast<E*>(pk.tiles) + idx * pk.tile_elems();
      pk.v_nonfinite[idx] =
          pack_tile<E>(p, req, h, t, pk.tile_keys, vis, dst, reinterpret_cast<E*>(scratch));
    }
  }

  // KernelTable::matrix_pack for this (T, C).
  static void pack_tiles(const AttnParams& p, int req, int h, int64_t t_begin, int64_t t_end,
                         float* scratch) {
    if constexpr (kBf16Inputs)
      if (p.packed->bf16) return pack_tiles_as<bf16_t>(p, req, h, t_begin, t_end, scratch);
    pack_tiles_as<float>(p, req, h, t_begin, t_end, scratch);
  }

  // ---- the item ----

  static void run(const AttnParams& p, const WorkItem& it, float* scratch) {
    if constexpr (kBf16Inputs)
      if (matrix_uses_bf16(p)) return run_tiles<bf16_t>(p, it, scratch);
    run_tiles<float>(p, it, scratch);
  }

  // The item's rows: visible ranges, positions, running state; [ulo, uhi] their union,
  // [max_lo, min_hi] the keys every row sees (empty unless all rows see some).
  struct Rows {
    float *m, *l;
    int64_t *lo, *hi, *pos;
    int64_t ulo = INT64_MAX, uhi = -1, max_lo = INT64_MIN, min_hi = INT64_MAX;
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
      rows.max_lo = std::max(rows.max_lo, keys.first);
      rows.min_hi = std::min(rows.min_hi, keys.last);
      rows.m[r] = kNegInf;
      rows.l[r] = 0.f;
    }
    return rows;
  }

  // Scratch of an item (floats; attn_scratch_floats covers it).
  template <class E>
  struct Buffers {
    float* acc;  // [M, D]
    float* S;    // [M, lds]: scores, then fp32 probabilities where the PV GEMM reads them
    E* q;        // [M, D]
    bf16_t* P;   // [M, NK]: probabilities as bf16 (bf16 GEMMs)
    E* tile;     // [2, NK, D]: a tile packed for this item (requests the call did not pack)
    E* conv;     // [2, NK, D]: converted rows while packing
    float* state;
  };

  template <class E>
  static Buffers<E> carve(float* scratch, int M, int D, int NK, int lds) {
    Buffers<E> b;
    const auto floats_of = [](int64_t elems) { return (elems * int64_t{sizeof(E)} + 63) / 64 * 16; };
    float* at = scratch;
    b.acc = at, at += int64_t{M} * D;
    b.S = at, at += int64_t{M} * lds;
    b.q = reinterpret_cast<E*>(at), at += floats_of(int64_t{M} * D);
    b.P = reinterpret_cast<bf16_t*>(at), at += (int64_t{M} * NK + 31) / 32 * 16;
    b.tile = reinterpret_cast<E*>(at), at += floats_of(2 * int64_t{NK} * D);
    b.conv = reinterpret_cast<E*>(at), at += floats_of(2 * int64_t{NK} * D);
    b.state = at;
    return b;
  }

  template <class E>
  static void load_queries(const AttnParams& p, const WorkItem& it, int R, int M, E* q) {
    const int D = p.head_size;
    const int G = p.num_heads / p.num_kv_heads;
    const int64_t qs = p.query_start_loc[it.req];
    for (int r = 0; r < R; ++r) {
      const T* src = Base::q_row(p, qs + it.q_begin + r / G, it.kv_head * G + r % G);
      if constexpr (std::is_same<T, E>::value)
        std::memcpy(static_cast<void*>(q + r * D), src, sizeof(E) * D);
      else
        for (int d = 0; d < D; d += W) VO::cvt_store(q + r * D + d, VO::cvt_load(src + d));
    }
    std::memset(static_cast<void*>(q + int64_t{R} * D), 0, sizeof(E) * (M - R) * D);
  }

  template <class E>
  static void run_tiles(const AttnParams& p, const WorkItem& it, float* scratch) {
    constexpr bool kBf16 = std::is_same<E, bf16_t>::value;
    const int D = p.head_size;
    const int G = p.num_heads / p.num_kv_heads;
    const int NK = matrix_tile_keys(D);
    const int R = (it.q_end - it.q_begin) * G;
    const int M = matrix_gemm_rows(R);
    const int lds = NK + 16;
    const Buffers<E> b = carve<E>(scratch, M, D, NK, lds);
    Rows rows = init_rows(p, it, R, b.state);
    load_queries<E>(p, it, R, M, b.q);
    std::memset(static_cast<void*>(b.acc), 0, sizeof(float) * M * D);
    if (kBf16) std::memset(static_cast<void*>(b.P), 0, sizeof(bf16_t) * M * NK);

    const ScoreTransform<VO> tr(p);
    const int64_t* packed_req = p.packed != nullptr ? p.packed->req + 3 * it.req : nullptr;
    const bool packed = packed_req != nullptr && packed_req[0] >= 0;
    const KeyRange vis = request_keys(p, it.req);
    for (int64_t t = rows.ulo / NK; rows.ulo <= rows.uhi && t <= rows.uhi / NK; ++t) {
      const int64_t key0 = t * NK;
      const E* kt;
      bool v_nonfinite;
      if (packed) {
        const int64_t idx = packed_req[0] + it.kv_head * packed_req[2] + (t - packed_req[1]);
        kt = static_cast<const E*>(p.packed->tiles) + idx * p.packed->tile_elems();
        v_nonfinite = p.packed->v_nonfinite[idx] != 0;
      } else {
        v_nonfinite = pack_tile<E>(p, it.req, it.kv_head, t, NK, vis, b.tile, b.conv);
        kt = b.tile;
      }
      const E* vt = kt + int64_t{NK} * D;
      if constexpr (kBf16) p.matrix->gemm_bf16_vnni(M, NK, D, D, NK, lds, false, b.q, kt, b.S);
      else p.matrix->gemm_f32(M, NK, D, D, NK, lds, false, b.q, kt, b.S);
      const bool full = rows.max_lo <= key0 && rows.min_hi >= key0 + NK - 1;
      // A key a row cannot see must add nothing to it, not 0 * V (NaN for a non-finite
      // value): tiles that some rows see in part and whose V holds one sum each row's own.
      const bool by_row = v_nonfinite && !full;
      for (int r = 0; r < R; ++r)
        softmax_tile(p, tr, it.kv_head * G + r % G, b.S + r * lds, kBf16 ? b.P + r * NK : nullptr,
                     key0, NK, full, rows.lo[r], rows.hi[r], rows.pos[r], rows.m + r, rows.l + r,
                     b.acc + r * D, D, !kBf16 || by_row);
      if (by_row) {
        int64_t ldv;
        const int n = static_cast<int>(std::min<int64_t>(NK, vis.last + 1 - key0));
        const float* v = fp32_rows(p, p.block_table + it.req * p.bt_stride,
                                   static_cast<const C*>(p.v_cache) + it.kv_head * p.v_stride_head,
                                   p.v_stride_block, p.v_stride_tok, key0, vis.first, n, NK,
                                   reinterpret_cast<float*>(b.conv), D, &ldv);
        accumulate_visible(b.S, lds, R, v, ldv, key0, n, rows.lo, rows.hi, b.acc, D);
        continue;
      }
      if constexpr (kBf16) p.matrix->gemm_bf16_vnni(M, D, NK, NK, D, D, true, b.P, vt, b.acc);
      else p.matrix->gemm_f32(M, D, NK, lds, D, D, true, b.S, vt, b.acc);
    }
    Base::finish(p, it, b.acc, rows.m, rows.l);
  }

  // One row's scores s[0, NK) of the tile at key0 -> probabilities against its (lazy)
  // running max: into P as bf16 (P non-null) and, with keep_f32, in place as fp32 (the
  // fp32 GEMM and the per-row V path read them). Vectors past the row's visible keys are
  // zeros without an exp; lanes are masked only where the tile is not `full` (seen whole by
  // every row of the item). The max, the sum and the accumulator rescale: once per row and
  // tile (the rescale only where the max moved past the lazy margin).
  static void softmax_tile(const AttnParams& p, const ScoreTransform<VO>& tr, int qhead, float* s,
                           bf16_t* P, int64_t key0, int NK, bool full, int64_t lo, int64_t hi,
                           int64_t ps, float* m, float* l, float* acc, int D, bool keep_f32) {
    using VI = typename VO::VI;
    const int tl = static_cast<int>(std::max<int64_t>(0, lo - key0));
    const int th = static_cast<int>(std::min<int64_t>(NK - 1, hi - key0));
    const auto zero_vec = [&](int t) {
      if (P != nullptr) VO::cvt_store(P + t, VO::zero());
      if (keep_f32) VO::store(s + t, VO::zero());
    };
    if (tl > th) {
      for (int t = 0; t < NK; t += W) zero_vec(t);
      return;
    }
    const int va = tl / W * W, vb = th / W * W;  // first and last vector with a visible key
    const bool fold_scale = !tr.softcap && !tr.alibi && p.scale > 0.f;
    if (!fold_scale) {
      const VI iota = VO::iotai();
      const V slope = VO::set1(tr.alibi ? p.alibi[qhead] : 0.f);
      for (int t = va; t <= vb; t += W) {
        V x = tr.scaled(VO::load(s + t));
        if (tr.alibi) {  // key - query position, exact in int32 (positions are int32)
          const VI dist = VO::addi(iota, VO::set1i(static_cast<int32_t>(key0 + t - ps)));
          x = tr.add_alibi(x, slope, dist);
        }
        VO::store(s + t, x);
      }
    }
    V mxv = VO::set1(kNegInf);
    if (full) {
      for (int t = va; t <= vb; t += W) mxv = VO::max(mxv, VO::load(s + t));
    } else {
      const VI iota = VO::iotai();
      const VI tlv = VO::set1i(tl), thv = VO::set1i(th);
      for (int t = va; t <= vb; t += W) {
        V x = VO::load(s + t);
        if (t < tl || t + W - 1 > th) {
          x = tr.hide(x, tlv, VO::addi(iota, VO::set1i(t)), thv);
          VO::store(s + t, x);
        }
        mxv = VO::max(mxv, x);
      }
    }
    const float mx = fold_scale ? VO::hmax(mxv) * p.scale : VO::hmax(mxv);
    const MaxStep<VecScalar> ms = max_step<VecScalar>(*m, mx, kLazyMax);
    const V sv = VO::set1(fold_scale ? p.scale : 1.f), neg_mu = VO::set1(-ms.mu);
    V sum = VO::zero();
    for (int t = 0; t < va; t += W) zero_vec(t);
    for (int t = va; t <= vb; t += W) {
      const V e = VO::exp(VO::fma(VO::load(s + t), sv, neg_mu));
      sum = VO::add(sum, e);
      if (P != nullptr) VO::cvt_store(P + t, e);
      if (keep_f32) VO::store(s + t, e);
    }
    for (int t = vb + W; t < NK; t += W) zero_vec(t);
    *l = VecScalar::fma(*l, ms.corr, VO::hsum(sum));
    *m = ms.m;
    if (ms.moved) rescale<VO>(acc, W, D / W, VO::set1(ms.corr));
  }

  // Keys [key0, key0 + n) of one cache (V) of the item's kv head as fp32 rows (the rare
  // per-row path): the cache itself where those keys are fp32 rows of one block (*ld = its
  // row stride), else converted into buf [NK, D] (*ld = D); keys before `first` (outside
  // the request's visible range, whose blocks need not exist) and past key0 + n are zeros.
  static const float* fp32_rows(const AttnParams& p, const int32_t* bt, const C* base,
                                int64_t stride_block, int64_t stride_tok, int64_t key0,
                                int64_t first, int n, int NK, float* buf, int D, int64_t* ld) {
    const int64_t BS = p.block_size;
    const auto row = [&](int64_t key) {
      return base + bt[key / BS] * stride_block + (key % BS) * stride_tok;
    };
    if (std::is_same<C, float>::value && n == NK && key0 >= first && key0 % BS + NK <= BS) {
      *ld = stride_tok;
      return reinterpret_cast<const float*>(row(key0));
    }
    *ld = D;
    for (int j = 0; j < NK; ++j) {
      const bool seen = j < n && key0 + j >= first;
      const C* src = seen ? row(key0 + j) : nullptr;
      for (int d = 0; d < D; d += W)
        VO::store(buf + j * D + d, seen ? VO::cvt_load(src + d) : VO::zero());
    }
    return buf;
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
