// The matrix-engine prefill kernel: one work item (a tile of query rows of one kv head)
// as two GEMMs of one shape per K/V tile of NK = matrix_tile_keys(D) keys, on oneDNN's
// brgemm microkernels (reached through MatrixEngine, so this TU stays torch-free), with
// the online-softmax step of online_softmax.h between them:
//
//   S[M, NK]  = Q[M, D] . K^T[D, NK]        (Q rows as A, K^T packed as B: no transpose)
//   S -> P    : scale/softcap, ALiBi, masks (tiles a row sees only in part), lazy running
//               max, vector exp, one max, sum and rescale per row and tile (softmax_tile);
//               one pass over the scores where the rows already have a max
//   O[M, D]  += P[M, NK] . V[NK, D]         (V packed as B)
//
// K/V tiles are packed once per call for every (request, kv head) that has matrix items,
// into the call's buffer (kernel_api.h MatrixPack), each by the first item that reads it
// (ensure_packed), and every query tile of that head reads them; requests past the
// buffer's budget pack each tile as their items read it, with the same routine. Packing
// converts to the GEMMs' element type (fp8 decoded, fp16 widened), so one cache layout
// serves every ISA and variant; keys the request cannot see are zeros. Rows are padded to
// M = matrix_gemm_rows(R) (zero queries), so the GEMMs keep one shape per head size and
// oneDNN JIT-compiles few kernels.
// Included by attn_kernel_impl.h inside each ISA TU's anonymous namespace.

inline bool runs_on_matrix(const AttnParams& p, const WorkItem& it) {
  return item_runs_on_matrix(p, it.q_end - it.q_begin, it.kv_heads);
}

// The probabilities of the bf16 GEMMs: 2^x and the rounding to bf16 (nearest even). ISA
// TUs may specialize both (matrix_avx512.h): the result is rounded to 8 bits, so 2^x
// needs far less than VO::exp's precision.
// exp2 for rows with hidden keys (-inf: exactly 0), exp2_seen where every key is seen.
template <class VO>
struct ProbVec {
  using V = typename VO::V;
  static V exp2(V x) { return VO::exp(VO::mul(x, VO::set1(0.69314718f))); }
  static V exp2_seen(V x) { return exp2(x); }
  static void store_bf16(bf16_t* dst, V v) { VO::cvt_store(dst, v); }
  static void store_bf16_pair(bf16_t* dst, V lo, V hi) {
    VO::cvt_store(dst, lo);
    VO::cvt_store(dst + VO::W, hi);
  }
};

// A line requested for a store: on x86, prefetchw, which fetches it owned, so the store
// that follows needs no second request. GCC turns __builtin_prefetch(p, 1, ...) into a
// plain prefetcht0 unless the TU enables prfchw, which no ISA TU's target does; every
// x86-64 CPU of these TUs runs prefetchw (older Intel ones as a no-op). At 4 x 512 the
// matrix kernel ran about 4% faster with it than with prefetcht0 (docs/performance.md).
inline void prefetch_line_for_write(const char* c) {
#if defined(__x86_64__)
  asm volatile("prefetchw %0" : : "m"(*c));
#else
  __builtin_prefetch(c, 1, 3);
#endif
}

// The pause of a spin-wait loop.
inline void cpu_relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Software prefetch of `bytes` from p into the caches (write: for a store).
inline void prefetch_bytes(const void* p, int64_t bytes, bool write) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) {
    if (write) prefetch_line_for_write(c + o);
    else __builtin_prefetch(c + o, 0, 3);
  }
}

// softmax_tile's callbacks: rescore(r0) and each_row() (prefill_matrix_impl.h).
template <class Rescore, class EachRow>
struct SoftmaxHooks {
  const Rescore& rescore;
  const EachRow& each_row;
};

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

  // The cache rows (K and V) of one tile's keys within vis, requested into L2 a few keys
  // at a time: an item that packs its own tiles asks for the next tile's rows while it
  // works on this one (the rows of a shared prefix are cold: every step reads them once).
  // Requested all at once they stall the core as soon as its miss buffers fill (a tile is
  // a thousand lines); spread over the tile's softmax rows they arrive behind its work.
  struct RowPrefetch {
    const AttnParams* p = nullptr;
    const int32_t* bt = nullptr;
    const C *kbase = nullptr, *vbase = nullptr;
    int64_t next = 0, last = -1;  // keys still to request
    int64_t per_tick = 0;

    RowPrefetch() = default;
    RowPrefetch(const AttnParams& params, int req, int h, int64_t t, int NK, KeyRange vis)
        : p(&params), bt(params.block_table + req * params.bt_stride),
          kbase(static_cast<const C*>(params.k_cache) + h * params.k_stride_head),
          vbase(static_cast<const C*>(params.v_cache) + h * params.v_stride_head),
          next(std::max(t * NK, vis.first)), last(std::min((t + 1) * NK - 1, vis.last)) {}
    // Spreads the keys left over `ticks` ticks.
    void pace(int ticks) { per_tick = ticks > 0 ? (last - next + ticks) / ticks : last - next + 1; }
    void issue(int64_t keys) {
      if (next > last) return;  // nothing (left) to request, or none set up
      const int64_t BS = p->block_size, row_bytes = int64_t{p->head_size} * sizeof(C);
      for (const int64_t end = std::min(last + 1, next + keys); next < end; ++next) {
        const int64_t blk = bt[next / BS], tok = next % BS;
        const char* k = reinterpret_cast<const char*>(kbase + blk * p->k_stride_block +
                                                      tok * p->k_stride_tok);
        const char* v = reinterpret_cast<const char*>(vbase + blk * p->v_stride_block +
                                                      tok * p->v_stride_tok);
        for (int64_t b = 0; b < row_bytes; b += 64) {
          prefetch_l2(k + b);
          prefetch_l2(v + b);
        }
      }
    }
    void tick() { issue(per_tick); }
    void all() { issue(last - next + 1); }
  };

  static KeyRange request_keys(const AttnParams& p, int req) {
    return request_key_range(p, p.query_start_loc[req + 1] - int64_t{p.query_start_loc[req]},
                             p.seq_lens[req]);
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
  // m and l have M entries (a multiple of every vector width): rows past R keep m = -inf
  // and l = 0, so the softmax treats rows a vector at a time.
  static Rows init_rows(const AttnParams& p, const WorkItem& it, int R, int M, float* at) {
    const int G = p.num_heads / p.num_kv_heads;
    Rows rows;
    rows.m = at;
    rows.l = at + M;
    rows.lo = reinterpret_cast<int64_t*>((reinterpret_cast<uintptr_t>(at + 2 * M) + 7) / 8 * 8);
    rows.hi = rows.lo + R;
    rows.pos = rows.hi + R;
    for (int r = R; r < M; ++r) {
      rows.m[r] = kNegInf;
      rows.l[r] = 0.f;
    }
    for (int r = 0; r < R; ++r) {
      rows.pos[r] = item_token(p, it, r / G).pos;
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
    float* S;    // [M, lds]: scores, then the probabilities: fp32 in place, or bf16 over
                 // the first half of each row (the bf16 GEMM's A, row stride 2 * lds)
    E* q;        // [M, D]
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
    b.tile = reinterpret_cast<E*>(at), at += floats_of(2 * int64_t{NK} * D);
    b.conv = reinterpret_cast<E*>(at), at += floats_of(2 * int64_t{NK} * D);
    b.state = at;
    return b;
  }

  // The item's query rows as E, rows R..M zeros. A token's G rows are one run of the
  // query tensor, tokens num_heads * D apart: all of them are requested before the first
  // copy (one row at a time, each a miss, cost more than the copies).
  template <class E>
  static void load_queries(const AttnParams& p, const WorkItem& it, int R, int M, E* q) {
    const int D = p.head_size;
    const int G = p.num_heads / p.num_kv_heads;
    for (int t = 0; t < it.q_end - it.q_begin; ++t) {
      prefetch_bytes(Base::q_row(p, item_token(p, it, t).token, it.kv_head * G),
                     int64_t{G} * D * sizeof(T), false);
    }
    for (int r = 0; r < R; ++r) {
      const T* src = Base::q_row(p, item_token(p, it, r / G).token, it.kv_head * G + r % G);
      if constexpr (std::is_same<T, E>::value)
        std::memcpy(static_cast<void*>(q + r * D), src, sizeof(E) * D);
      else
        for (int d = 0; d < D; d += W) VO::cvt_store(q + r * D + d, VO::cvt_load(src + d));
    }
    std::memset(static_cast<void*>(q + int64_t{R} * D), 0, sizeof(E) * (M - R) * D);
  }

  // The output rows finish() writes, requested a share per K/V tile, so that their
  // read-for-ownership misses overlap the tiles' GEMMs instead of stalling the stores.
  // Items that write partials (split or shared-prefix items) request nothing.
  struct OutputPrefetch {
    const AttnParams& p;
    const WorkItem& it;
    int per_step, next;
    OutputPrefetch(const AttnParams& p_, const WorkItem& it_, int64_t steps)
        : p(p_), it(it_), next(0) {
      const int64_t tokens = it.part_out == nullptr ? it.q_end - it.q_begin : 0;
      per_step = static_cast<int>(steps > 0 ? (tokens + steps - 1) / steps : tokens);
    }
    void step() {
      const int G = p.num_heads / p.num_kv_heads;
      for (int k = 0; k < per_step && next < it.q_end - it.q_begin; ++k, ++next)
        prefetch_bytes(Base::out_row(p, item_token(p, it, next).token, it.kv_head * G),
                       int64_t{G} * p.head_size * sizeof(T), true);
    }
  };

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
    Rows rows;
    {
      MatrixPhaseTimer timer(p.matrix, MatrixPhase::kQueries);
      rows = init_rows(p, it, R, M, b.state);
      load_queries<E>(p, it, R, M, b.q);
    }
    // softmax_tile's per-row-block scratch, after the row state (2M + 6R floats + padding)
    float* block = reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(b.state + 8 * M + 16) + 63) / 64 * 64);
    // Rows past R: zero queries (load_queries), so zero scores, which read as bf16 are
    // zero probabilities too; acc is written by the first PV GEMM (add off) or zeroed
    // before the first per-row sum.
    bool acc_ready = false;

    const ScoreTransform<VO> tr(p);
    // A shared-prefix item packs its own tiles, zero outside its rows' keys: the call's
    // tiles of its representative hold that request's visible keys only.
    const bool shared = it.tokens != nullptr;
    const bool packed = !shared && p.packed != nullptr && p.packed->holds(it.req);
    const KeyRange vis = shared ? KeyRange{rows.ulo, rows.uhi} : request_keys(p, it.req);
    const int64_t ntiles = rows.ulo <= rows.uhi ? rows.uhi / NK - rows.ulo / NK + 1 : 0;
    OutputPrefetch out_prefetch(p, it, ntiles);
    RowPrefetch ahead;  // the next tile's rows, where this item packs its own
    for (int64_t t = rows.ulo / NK; rows.ulo <= rows.uhi && t <= rows.uhi / NK; ++t) {
      const int64_t key0 = t * NK;
      const E* kt;
      bool v_nonfinite;
      if (packed) {
        const int64_t idx = p.packed->index(it.req, it.kv_head, t);
        kt = p.packed->tile<E>(idx);
        if (__atomic_load_n(p.packed->state + idx, __ATOMIC_ACQUIRE) != kTileReady) {
          MatrixPhaseTimer timer(p.matrix, MatrixPhase::kCallPack);
          ensure_packed<E>(p, it, t, rows.uhi / NK, vis, b.conv);
        }
        v_nonfinite = p.packed->v_nonfinite[idx] != 0;
      } else {
        MatrixPhaseTimer timer(p.matrix, MatrixPhase::kTilePack);
        if (t == rows.ulo / NK) RowPrefetch(p, it.req, it.kv_head, t, NK, vis).all();
        v_nonfinite = pack_tile<E>(p, it.req, it.kv_head, t, NK, vis, b.tile, b.conv);
        kt = b.tile;
        if (t < rows.uhi / NK) {
          ahead = RowPrefetch(p, it.req, it.kv_head, t + 1, NK, vis);
          ahead.pace(R);
        }
      }
      const E* vt = kt + int64_t{NK} * D;
      // The item's last tile (the diagonal of a causal prefill) runs only the keys up to
      // its last visible one, in steps of 32: a few more GEMM shapes, for ~15% less GEMM
      // work at 4 x 512 (docs/performance.md).
      const int nk = static_cast<int>(std::min<int64_t>(NK, (rows.uhi - key0 + 32) / 32 * 32));
      // Scores of query rows [r0, r0 + m) over the tile's first nk keys.
      const auto scores = [&](int r0, int m) {
        if constexpr (kBf16)
          p.matrix->gemm_bf16_vnni(m, nk, D, D, NK, lds, false, b.q + r0 * D, kt, b.S + r0 * lds);
        else p.matrix->gemm_f32(m, nk, D, D, NK, lds, false, b.q + r0 * D, kt, b.S + r0 * lds);
      };
      scores(0, M);
      const bool full = rows.max_lo <= key0 && rows.min_hi >= key0 + NK - 1;
      // A key a row cannot see must add nothing to it, not 0 * V (NaN for a non-finite
      // value): tiles that some rows see in part and whose V holds one sum each row's own.
      const bool by_row = v_nonfinite && !full;
      // bf16 probabilities overwrite their own scores (row_exp): no second buffer to miss
      // in; the per-row V path reads them as fp32 instead.
      bf16_t* P = kBf16 && !by_row ? reinterpret_cast<bf16_t*>(b.S) : nullptr;
      {
        MatrixPhaseTimer timer(p.matrix, MatrixPhase::kSoftmax);
        // A block whose one pass found a row's max moved gets its scores again: its
        // probabilities overwrote them. Each row requests a share of the next tile's.
        const auto rescore = [&](int r0) { scores(r0, W); };
        const auto each_row = [&] { ahead.tick(); };
        // nk columns: the PV GEMM reads no probability past them
        softmax_tile(p, tr, it.kv_head * G, G, b.S, lds, P, key0, nk, full,
                     rows, R, b.acc, acc_ready, D, !kBf16 || by_row, block,
                     SoftmaxHooks<decltype(rescore), decltype(each_row)>{rescore, each_row});
        ahead.all();  // rows the softmax skipped, if any
      }
      out_prefetch.step();
      if (by_row) {
        if (!acc_ready) std::memset(static_cast<void*>(b.acc), 0, sizeof(float) * M * D);
        acc_ready = true;
        int64_t ldv;
        const int n = static_cast<int>(std::min<int64_t>(NK, vis.last + 1 - key0));
        const float* v = fp32_rows(p, p.block_table + it.req * p.bt_stride,
                                   static_cast<const C*>(p.v_cache) + it.kv_head * p.v_stride_head,
                                   p.v_stride_block, p.v_stride_tok, key0, vis.first, n, NK,
                                   reinterpret_cast<float*>(b.conv), D, &ldv);
        accumulate_visible(b.S, lds, R, v, ldv, key0, n, rows.lo, rows.hi, b.acc, D);
        continue;
      }
      if constexpr (kBf16)
        p.matrix->gemm_bf16_vnni(M, D, nk, 2 * lds, D, D, acc_ready, P, vt, b.acc);
      else p.matrix->gemm_f32(M, D, nk, lds, D, D, acc_ready, b.S, vt, b.acc);
      acc_ready = true;
    }
    MatrixPhaseTimer timer(p.matrix, MatrixPhase::kFinish);
    if (!acc_ready) std::memset(static_cast<void*>(b.acc), 0, sizeof(float) * M * D);
    Base::finish(p, it, b.acc, rows.m, rows.l);
  }

  // MatrixPack::state of a tile.
  static constexpr uint8_t kTileUnpacked = 0, kTileClaimed = 1, kTileReady = 2;

  // Tile t of the item's request and kv head in the call's buffer, packed by the first
  // item that reads it, just before its GEMMs: claimed, packed, published. While another
  // worker packs it, this one packs the item's later tiles (to t_last) that nobody has
  // claimed, then waits; a long wait (that worker descheduled) yields the core.
  template <class E>
  static void ensure_packed(const AttnParams& p, const WorkItem& it, int64_t t, int64_t t_last,
                            KeyRange vis, E* conv) {
    const MatrixPack& pk = *p.packed;
    const auto try_pack = [&](int64_t u) {
      const int64_t idx = pk.index(it.req, it.kv_head, u);
      uint8_t expected = kTileUnpacked;
      if (!__atomic_compare_exchange_n(pk.state + idx, &expected, kTileClaimed, false,
                                       __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
        return;
      pk.v_nonfinite[idx] =
          pack_tile<E>(p, it.req, it.kv_head, u, pk.tile_keys, vis, pk.tile<E>(idx), conv);
      __atomic_store_n(pk.state + idx, kTileReady, __ATOMIC_RELEASE);
    };
    const uint8_t* state = pk.state + pk.index(it.req, it.kv_head, t);
    const auto ready = [state] { return __atomic_load_n(state, __ATOMIC_ACQUIRE) == kTileReady; };
    try_pack(t);
    for (int64_t u = t + 1; u <= t_last && !ready(); ++u) try_pack(u);
    for (int spins = 0; !ready(); ++spins) {
      if (spins < 4096) cpu_relax();
      else std::this_thread::yield();
    }
  }

  // Rows [0, R) of one tile's scores S (row stride lds) at key0 -> probabilities against
  // each row's (lazy) running max: into P [R, NK] as bf16 (P non-null) and, with keep_f32,
  // in place as fp32 (the fp32 GEMM and the per-row V path read them). Rows go a vector
  // of W at a time: each row's scores are transformed and masked and its max taken
  // (row_max), then the running-max step, the sums (one lane-transposing reduction for W
  // rows) and l run with rows in lanes, and only rows whose max moved rescale their
  // accumulators. Vectors past a row's visible keys are zeros without an exp; lanes are
  // masked only where the tile is not `full` (seen whole by every row of the item).
  // Blocks of W rows that all have a running max, under the plain scale, take one pass:
  // their probabilities against the max the rows already have (row_exp<true>: masks
  // inline, the logits only checked against that max). Where a row's would move it
  // (rare after a row's first tile), hooks.rescore(r0) computes the block's scores again
  // (its probabilities overwrote them) and the block takes the two passes.
  // hooks.each_row() runs after each row's probabilities (the next tile's prefetch).
  // block: 64 + W * W floats, 64-byte aligned.
  template <class Hooks>
  static void softmax_tile(const AttnParams& p, const ScoreTransform<VO>& tr, int head0, int G,
                           float* S, int lds, bf16_t* P, int64_t key0, int NK, bool full,
                           const Rows& rows, int R, float* acc, bool acc_ready, int D,
                           bool keep_f32, float* block, const Hooks& hooks) {
    float* mx = block;             // [W] each row's tile max (scaled)
    float* mu = block + W;         // [W]
    float* corr = block + 2 * W;   // [W]
    V* sums = reinterpret_cast<V*>(block + 64);  // [W], 64-byte aligned (block is)
    for (int r0 = 0; r0 < R; r0 += W) {
      const int n = std::min(W, R - r0);
      if (tr.plain_scale && n == W && !VO::any(VO::eq(VO::load(rows.m + r0), VO::set1(kNegInf)))) {
        bool kept = true;
        for (int i = 0; i < W && kept; ++i) {
          const int r = r0 + i;
          int tl, th;
          keys_in_tile(rows.lo[r], rows.hi[r], key0, NK, &tl, &th);
          sums[i] = row_exp<true>(p, tr, S + r * lds, P != nullptr ? P + 2 * r * lds : nullptr,
                                  NK, tl, th, rows.m[r], keep_f32, full, &kept);
          hooks.each_row();
        }
        if (kept) {
          VO::store(rows.l + r0, VO::add(VO::load(rows.l + r0), VO::reduce_lanes(sums)));
          continue;
        }
        hooks.rescore(r0);
      }
      int vis_lo[W], vis_hi[W];
      for (int i = 0; i < W; ++i) {
        mx[i] = kNegInf;
        vis_lo[i] = 1, vis_hi[i] = 0;
      }
      for (int i = 0; i < n; ++i) {
        const int r = r0 + i;
        mx[i] = row_max(p, tr, head0 + r % G, S + r * lds, key0, NK, full, rows.lo[r], rows.hi[r],
                        rows.pos[r], &vis_lo[i], &vis_hi[i]);
      }
      const V m_old = VO::load(rows.m + r0);
      const MaxStep<VO> ms = max_step<VO>(m_old, VO::load(mx), kLazyMax);
      VO::store(mu, ms.mu);
      VO::store(corr, ms.corr);
      for (int i = 0; i < W; ++i) {
        const int r = r0 + i;
        sums[i] = i < n ? row_exp<false>(p, tr, S + r * lds, P != nullptr ? P + 2 * r * lds : nullptr,
                                         NK, vis_lo[i], vis_hi[i], mu[i], keep_f32, full)
                        : VO::zero();
        if (i < n) hooks.each_row();
      }
      VO::store(rows.l + r0, VO::fma(VO::load(rows.l + r0), ms.corr, VO::reduce_lanes(sums)));
      VO::store(rows.m + r0, ms.m);
      if (acc_ready && VO::any(ms.moved))
        for (int i = 0; i < n; ++i)
          if (corr[i] != 1.f) rescale<VO>(acc + (r0 + i) * D, W, D / W, VO::set1(corr[i]));
    }
  }

  // A row's visible keys [lo, hi] as columns [*tl, *th] of the tile at key0 (*tl > *th: none).
  static void keys_in_tile(int64_t lo, int64_t hi, int64_t key0, int NK, int* tl, int* th) {
    *tl = static_cast<int>(std::max<int64_t>(0, lo - key0));
    *th = static_cast<int>(std::min<int64_t>(NK - 1, hi - key0));
  }

  // One row's scores s[0, NK) -> logits (scale or softcap, ALiBi; the plain scale is left
  // for row_exp's FMA), masked outside the row's visible keys where the tile is not full;
  // returns their max (-inf: nothing visible) and the row's visible keys [*tl, *th]
  // within the tile (*tl > *th: none).
  static float row_max(const AttnParams& p, const ScoreTransform<VO>& tr, int qhead, float* s,
                       int64_t key0, int NK, bool full, int64_t lo, int64_t hi, int64_t ps,
                       int* tl_out, int* th_out) {
    using VI = typename VO::VI;
    int tl, th;
    keys_in_tile(lo, hi, key0, NK, &tl, &th);
    *tl_out = tl, *th_out = th;
    if (tl > th) return kNegInf;
    const int va = tl / W * W, vb = th / W * W;  // first and last vector with a visible key
    const bool fold_scale = tr.plain_scale;
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
    return fold_scale ? VO::hmax(mxv) * p.scale : VO::hmax(mxv);
  }

  // p = exp(logit - mu) over the row's visible vectors [tl, th] (zeros elsewhere, no exp),
  // into P (bf16) and/or s (keep_f32); returns the vector of their sums. seen: the tile is
  // seen whole (no hidden lane). P may be s itself: bf16 value t then lands on bytes of
  // fp32 value t / 2, which every step has read before it stores (the compiler barrier
  // keeps the stores after the loads for any element type).
  // kOnePass: s holds raw scores under the plain scale, mu is the row's running max, and
  // the lanes outside [tl, th] are hidden here (row_max does it for the two passes);
  // *kept turns false where a logit passes mu by more than kLazyMax (the two passes would
  // move the max), and the row's outputs are then not to be used.
  template <bool kOnePass>
  static V row_exp(const AttnParams& p, const ScoreTransform<VO>& tr, float* s, bf16_t* P,
                   int NK, int tl, int th, float mu, bool keep_f32, bool seen,
                   bool* kept = nullptr) {
    using VI = typename VO::VI;
    const auto zero_vec = [&](int t) {
      if (P != nullptr) VO::cvt_store(P + t, VO::zero());
      if (keep_f32) VO::store(s + t, VO::zero());
    };
    V sum = VO::zero();
    if (tl > th) {
      for (int t = 0; t < NK; t += W) zero_vec(t);
      return sum;
    }
    const int va = tl / W * W, vb = th / W * W;
    const bool fold_scale = kOnePass || tr.plain_scale;
    const bool natural = std::is_same<T, float>::value && !(P != nullptr && !keep_f32);
    // exp(x * scale - mu) = 2^(x * scale * log2 e - mu * log2 e) outside the fp32 path
    constexpr float kLog2e = 1.44269504f;
    const float unit = natural ? 1.f : kLog2e;
    const V sv = VO::set1((fold_scale ? p.scale : 1.f) * unit);
    const V neg_mu = VO::set1(-mu * unit);
    V top = VO::set1(kNegInf);
    const VI iota = VO::iotai(), tlv = VO::set1i(tl), thv = VO::set1i(th);
    const auto logit = [&](int t) {
      V x = VO::load(s + t);
      if (kOnePass && !seen && (t < tl || t + W - 1 > th))
        x = tr.hide(x, tlv, VO::addi(iota, VO::set1i(t)), thv);
      const V y = VO::fma(x, sv, neg_mu);
      if (kOnePass) top = VO::max(top, y);
      return y;
    };
    const auto exp2 = [seen](V x) {
      return seen ? ProbVec<VO>::exp2_seen(x) : ProbVec<VO>::exp2(x);
    };
    for (int t = 0; t < va; t += W) zero_vec(t);
    if (P != nullptr && !keep_f32) {
      int t = va;
      for (; t + W <= vb; t += 2 * W) {  // two vectors a step: one bf16 conversion
        const V e0 = exp2(logit(t));
        const V e1 = exp2(logit(t + W));
        sum = VO::add(sum, VO::add(e0, e1));
        asm volatile("" ::: "memory");
        ProbVec<VO>::store_bf16_pair(P + t, e0, e1);
      }
      if (t <= vb) {
        const V e = exp2(logit(t));
        sum = VO::add(sum, e);
        asm volatile("" ::: "memory");
        ProbVec<VO>::store_bf16(P + t, e);
      }
    } else if (!natural) {
      // fp32 probabilities for bf16 / fp16 outputs (the fp32 GEMMs of CPUs without a bf16
      // one): ProbVec's 2^x is far more precise than those outputs' rounding.
      for (int t = va; t <= vb; t += W) {
        const V e = exp2(logit(t));
        sum = VO::add(sum, e);
        VO::store(s + t, e);
      }
    } else {
      for (int t = va; t <= vb; t += W) {
        const V e = VO::exp(logit(t));
        sum = VO::add(sum, e);
        VO::store(s + t, e);
      }
    }
    for (int t = vb + W; t < NK; t += W) zero_vec(t);
    if (kOnePass && VO::any(VO::lt(VO::set1(kLazyMax * unit), top))) *kept = false;
    return sum;
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
