// Torch-free interface between the binding layer (torch headers, baseline ISA) and the
// ISA-specific kernel translation units (kernels_<isa>.cpp, compiled with #pragma GCC target).
// Keeping torch out of the ISA TUs matters: an inline torch function compiled there with
// AVX-512 could be the copy the linker keeps for every caller (ODR), crashing older CPUs.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace pagedattn {

enum class DType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2, kFp8E4m3 = 3, kFp8E5m2 = 4 };

// The gate of a gated MLP (act(gate) * up): SiLU (Llama family) or tanh-approximated GELU
// (Gemma).
enum class GatedActivation : int32_t { kSilu = 0, kGeluTanh = 1 };

// Element tags for 16-bit and 8-bit storage types (raw bits). fp8 is a KV-cache format
// only (fp8.h): queries and outputs stay fp32/bf16/fp16.
struct bf16_t { uint16_t bits; };
struct fp16_t { uint16_t bits; };
struct fp8_e4m3_t { uint8_t bits; };
struct fp8_e5m2_t { uint8_t bits; };

struct MatrixEngine;
struct MatrixPack;

// Everything a work item needs, already validated by the binding layer. Strides are in
// elements; the last (head_size) dimension of every tensor is contiguous.
struct AttnParams {
  DType dtype;             // query and output
  DType cache_dtype;       // key/value cache: dtype, or an fp8 format
  const void* q;           // [num_tokens, num_heads, head_size]
  int64_t q_stride_tok, q_stride_head;
  void* out;               // [num_tokens, num_heads, head_size]
  int64_t o_stride_tok, o_stride_head;
  const void* k_cache;     // [num_blocks, num_kv_heads, block_size, head_size]
  const void* v_cache;
  int64_t k_stride_block, k_stride_head, k_stride_tok;
  int64_t v_stride_block, v_stride_head, v_stride_tok;
  const int32_t* block_table;  // [num_reqs, bt_stride] (row stride in elements)
  int64_t bt_stride;
  const int32_t* query_start_loc;  // [num_reqs + 1]
  const int32_t* seq_lens;         // [num_reqs]
  int32_t head_size, block_size, num_heads, num_kv_heads;
  float scale;          // fp8 caches: times k_scale (q.k is computed on the stored values)
  float v_scale = 1.f;  // 1, or an fp8 cache's v_scale (applied to the normalized output)
  float softcap;        // 0: off
  const float* alibi;   // [num_heads] fp32 or nullptr
  const float* sink;    // [num_heads] fp32 or nullptr (raw logits)
  int64_t window_left, window_right;  // -1: unbounded
  bool causal;
  // Set: prefill items of at least kMatrixMinRows rows of one kv head run on it.
  const MatrixEngine* matrix = nullptr;
  // Set with matrix: the K/V tiles the call packed once for its matrix items (requests
  // without packed tiles pack each tile as their items read it).
  const MatrixPack* packed = nullptr;
  // Set (a batch-invariant plan): every item takes the generic path, whose arithmetic for
  // a row does not depend on the item's other rows, so a row's result is the same in any
  // batch, chunking or thread count (the lanes and matrix prefill paths are tile-shaped).
  bool row_invariant = false;
};

// One unit of parallel work: query tokens [q_begin, q_end) (offsets inside the request)
// of every query head mapped to kv head `kv_head`, against key positions [kv_begin, kv_end).
// With part_out == nullptr the item covers the whole key range and writes the output;
// otherwise it writes a normalized partial result and its log-sum-exp for a later merge:
//   part_out [rows, head_size] fp32, part_lse [rows] fp32 (-inf: no visible key),
// where row = (token - q_begin) * group + (head - kv_head * group).
//
// An item may cover kv heads [kv_head, kv_head + kv_heads) (kv_heads <= 1: just kv_head):
// decode items take every head of a request, so each paged block is read as one contiguous
// K run and one V run of num_kv_heads * block_size rows (hardware prefetchers and DRAM
// pages like long runs; 8 KiB per-head pieces at random addresses stream ~30% slower).
// Rows are then head-major: row = head_offset * (tokens * group) + token * group + g.
// Keys [first, last] inside [kv_begin, kv_end) that a query at absolute position `pos`
// may see (docs/semantics.md visibility rule: causal, then the (left, right) window; -1 = unbounded).
// first > last when it sees none. The one C++ statement of the rule: every kernel uses it.
// Included before any `#pragma GCC target`, so every TU compiles it for the baseline ISA.
struct KeyRange {
  int64_t first, last;
};
inline KeyRange visible_key_range(const AttnParams& p, int64_t pos, int64_t kv_begin,
                                  int64_t kv_end) {
  KeyRange r{kv_begin, kv_end - 1};
  if (p.causal) r.last = std::min(r.last, pos);
  if (p.window_left >= 0) r.first = std::max(r.first, pos - p.window_left);
  if (p.window_right >= 0) r.last = std::min(r.last, pos + p.window_right);
  return r;
}

// Keys [first, last] that some query of a request sees, its q_len queries at positions
// kv_len - q_len .. kv_len - 1 (first > last: none). Every query sees its own position and
// both ends of its range grow with it, so the union runs from the first query's first key
// to the last query's last key.
inline KeyRange request_key_range(const AttnParams& p, int64_t q_len, int64_t kv_len) {
  if (q_len <= 0) return KeyRange{0, -1};
  return KeyRange{visible_key_range(p, kv_len - q_len, 0, kv_len).first,
                  visible_key_range(p, kv_len - 1, 0, kv_len).last};
}

// Most key splits of one query tile: the merge keeps a weight per split on the stack.
constexpr int64_t kMaxSplits = 64;

// One query token of a shared-prefix item: its row in the query tensor and its absolute
// position in its own request.
struct PrefixToken {
  int32_t token, pos;
};

// A shared-prefix item (tokens != nullptr) runs the query tokens of several requests
// whose block tables begin with the same blocks against those keys, [kv_begin, kv_end):
// token t of the item is tokens[t] (q_begin = 0), and req is the group's representative,
// whose block table the item reads. It always writes a partial result (part_out), which
// each member's merge folds with its own keys' partials (prefix_out / prefix_lse: the
// member rows' shared-prefix partials, prefix_parts of them (the group's key chunks)
// prefix_part_rows rows apart; read by merges only).
struct WorkItem {
  int32_t req, kv_head;
  int32_t q_begin, q_end;
  int32_t kv_begin, kv_end;
  float* part_out;
  float* part_lse;
  int32_t kv_heads = 1;
  const PrefixToken* tokens = nullptr;
  const float* prefix_out = nullptr;
  const float* prefix_lse = nullptr;
  int32_t prefix_parts = 0;
  int64_t prefix_part_rows = 0;
  int heads() const { return kv_heads > 1 ? kv_heads : 1; }
};

// Token t (0 <= t < q_end - q_begin) of an item: its query-tensor row and its absolute
// position (docs/semantics.md: a request's new tokens are its last ones).
inline PrefixToken item_token(const AttnParams& p, const WorkItem& it, int64_t t) {
  if (it.tokens != nullptr) return it.tokens[t];
  const int64_t qs = p.query_start_loc[it.req];
  const int64_t q_len = p.query_start_loc[it.req + 1] - qs;
  return PrefixToken{static_cast<int32_t>(qs + it.q_begin + t),
                     static_cast<int32_t>(p.seq_lens[it.req] - q_len + it.q_begin + t)};
}

// Linear layers (linear_kernel_impl.h): weights packed in panels of 16 output columns,
// [ceil(n / 16), k, 16] (pagedattn.ops.pack_linear_weight); x, out and bias fp32.
constexpr int kLinearPanel = 16;

struct LinearParams {
  const float* x;          // [m, k], row stride x_stride, contiguous rows
  int64_t x_stride;
  const void* weight;      // [ceil(n / 16), k, 16] of weight_dtype (padding columns zero)
  DType weight_dtype;      // kF32, kBF16 or kF16
  const float* bias;       // [n] or nullptr
  float* out;              // [m, n], row stride out_stride
  int64_t out_stride;
  int64_t m, n, k;
};

// Linear layers on vdpbf16ps (linear_dpbf16_impl.h, AVX512-BF16 only): x rounded to bf16
// (nearest even) by the kernel, bf16 weights, fp32 accumulation and output. The weight is
// packed with pairs of k interleaved, [ceil(n / 16), ceil(k / 2), 16, 2]
// (pagedattn.ops.pack_linear_weight_dpbf16): one 64-byte row per k pair holds
// (W[c, 2i], W[c, 2i + 1]) for the panel's 16 columns c, the operand layout of vdpbf16ps.
// An odd k is padded with a zero weight and a zero activation.
struct LinearDpParams {
  const void* x;           // [m, k] of x_dtype, row stride x_stride, contiguous rows
  int64_t x_stride;
  const bf16_t* weight;    // [ceil(n / 16), k_pairs, 32] (padding columns zero)
  const float* bias;       // [n] or nullptr
  void* out;               // [m, n] of out_dtype, row stride out_stride
  int64_t out_stride;
  int64_t m, n, k, k_pairs;
  DType x_dtype = DType::kF32;    // kF32 (rounded by the kernel) or kBF16 (taken as is)
  DType out_dtype = DType::kF32;  // kF32, or kBF16 (the fp32 sums rounded, nearest even)
};

// RMSNorm rows (layer_kernel_impl.h), last dims contiguous, computed in fp32; x and out
// are fp32 or bf16 each. With residual != nullptr (fp32) each row first does
// residual += x and normalises the sum.
struct NormParams {
  const void* x;
  int64_t x_stride;
  float* residual;  // nullptr or [rows, d] updated in place
  int64_t residual_stride;
  const float* weight;  // [d]
  float eps;
  void* out;
  int64_t out_stride;
  int64_t d;
  DType x_dtype = DType::kF32;    // kF32 or kBF16
  DType out_dtype = DType::kF32;  // kF32 or kBF16
};


// The cost probe's phases of a matrix item outside its GEMMs (benchmarks/profile_prefill.py):
// its query rows in (row state, Q copied as the GEMMs' A), the softmax between the GEMMs
// (masks included), K/V tiles it packs for itself alone (requests past the call's buffer
// budget), its output rows out (normalization, stores), and the tiles of the call's
// shared buffer it packs or waits for as their first reader (kCallPack).
enum class MatrixPhase : int { kQueries = 0, kSoftmax, kTilePack, kFinish, kCallPack, kCount };

// The matrix engine: oneDNN's brgemm microkernels (AMX tiles where the CPU has them, else
// AVX-512 or AVX2 code), which the binding layer reaches through ATen
// (matrix_engine.cpp) and hands to the kernels as function pointers, so kernel TUs stay
// torch-free. C[M, N] (row stride ldc) = A[M, K] (lda) . B[K, N] (ldb), plus C when add;
// fp32 throughout.
struct MatrixEngine {
  void (*gemm_f32)(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc,
                   bool add, const float* A, const float* B, float* C);
  // bf16 A; B in the VNNI layout: B[k][n] at B[(k / 2) * 2 * ldb + 2 * n + k % 2] (K even).
  // nullptr where no bf16 microkernel runs (oneDNN needs AVX512-BF16 or AMX for it).
  void (*gemm_bf16_vnni)(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb,
                         int64_t ldc, bool add, const bf16_t* A, const bf16_t* B,
                         float* C) = nullptr;
  // Decode scores on the AMX tiles: S[r * lds + i] = q_r . k_i (fp32 sums of exact bf16
  // products) for rows r < R <= kDecodeTileRows and keys i < 16 * groups, key i's row at
  // k + i * kst (every row of each group is read). qt: the rows as pack_decode_queries
  // lays them out. D a multiple of 32. nullptr where our tile loop does not run.
  void (*decode_scores_bf16)(const bf16_t* qt, int R, const bf16_t* k, int64_t kst, int groups,
                             int D, float* S, int lds) = nullptr;
  // Set on the cost probe's engines only (nullptr otherwise): the clock the kernels time
  // their MatrixPhase spans with, and where they add them.
  int64_t (*clock_ns)() = nullptr;
  void (*add_phase_ns)(int phase, int64_t ns) = nullptr;
};

// Times one MatrixPhase span on a profiling engine; a load and a branch otherwise.
class MatrixPhaseTimer {
 public:
  MatrixPhaseTimer(const MatrixEngine* e, MatrixPhase phase)
      : e_(e->clock_ns != nullptr ? e : nullptr), phase_(static_cast<int>(phase)),
        t0_(e_ != nullptr ? e_->clock_ns() : 0) {}
  ~MatrixPhaseTimer() {
    if (e_ != nullptr) e_->add_phase_ns(phase_, e_->clock_ns() - t0_);
  }
  MatrixPhaseTimer(const MatrixPhaseTimer&) = delete;
  MatrixPhaseTimer& operator=(const MatrixPhaseTimer&) = delete;

 private:
  const MatrixEngine* e_;
  int phase_;
  int64_t t0_;
};

// Query rows per decode_scores_bf16 call, and the columns of its score tiles for R rows.
constexpr int kDecodeTileRows = 8;
inline int decode_tile_cols(int R) { return R <= 4 ? 4 : 8; }
// decode_scores_bf16's qt for rows q[r * D, (r + 1) * D), r < R: the tiles' B operand, one
// [16, N] tile of 32-bit words per 32 dims (N = decode_tile_cols(R)), whose word (p, n) is
// dims 2p and 2p + 1 of the chunk in row n (zero for n >= R). D / 2 * N words.
inline void pack_decode_queries(const bf16_t* q, int R, int D, uint32_t* qt) {
  const int N = decode_tile_cols(R);
  for (int w = 0; w < D / 2; ++w)
    for (int n = 0; n < N; ++n) {
      uint32_t word = 0;
      if (n < R) __builtin_memcpy(&word, q + n * D + 2 * w, sizeof(word));
      qt[w * N + n] = word;
    }
}

// The matrix-engine prefill kernel (prefill_matrix_impl.h). The fewest rows an item needs
// to take it (decode items and short tails stay on the vector kernels, which the GEMMs'
// fixed costs would not beat), and the rows its GEMMs are padded to (a multiple of 16).
constexpr int kMatrixMinRows = 16;
inline int matrix_gemm_rows(int rows) { return (rows + 15) / 16 * 16; }
inline bool item_runs_on_matrix(const AttnParams& p, int64_t q_tokens, int32_t kv_heads) {
  const int64_t rows = q_tokens * (p.num_heads / p.num_kv_heads);
  return p.matrix != nullptr && kv_heads <= 1 && rows >= kMatrixMinRows;
}

// Keys per K/V tile of the matrix kernel. From head size 128 up, the head size (rounded
// up to 16, capped at 256), so that S = Q . K^T (reduction: head size, output: tile keys)
// and O += P . V (reduction: tile keys, output: head size) are GEMMs of one shape, whose
// AMX microkernels share one tile configuration; below it, 256 keys, so that each GEMM
// call does enough work to amortize its fixed cost. Measured on AMX at head sizes 64, 128
// and 256 against 64-256 keys (docs/performance.md, "Matrix prefill on AMX").
inline int matrix_tile_keys(int head_size) {
  return head_size >= 128 ? std::min(256, (head_size + 15) / 16 * 16) : 256;
}

// Whether the matrix kernel's GEMMs take bf16 inputs (bf16 queries over bf16 or fp8
// caches, where a bf16 microkernel runs: fp8 values are exact in bf16) or fp32 ones.
inline bool matrix_uses_bf16(const AttnParams& p) {
  return p.matrix != nullptr && p.matrix->gemm_bf16_vnni != nullptr &&
         p.dtype == DType::kBF16 && p.cache_dtype != DType::kF16;
}

// K/V tiles of the matrix kernel, packed once per call for every (request, kv head) with
// matrix items and read by all of that head's query tiles: each by the first item that
// reads it, which claims it (state 0 -> 1), packs it and publishes it (1 -> 2, release);
// an item that finds it claimed waits for it (prefill_matrix_impl.h, ensure_packed). So a
// tile is packed just before its first GEMMs, on the core that runs them. Tile t of a
// request covers keys [t * tile_keys, (t + 1) * tile_keys) (keys the request cannot see
// are zeros); each tile is K^T then V, tile_keys * head_size elements each, as the GEMMs
// read them:
//   bf16: K^T [D / 2][NK][2] and V [NK / 2][D][2] (the VNNI pair layouts of MatrixEngine)
//   fp32: K^T [D][NK] and V [NK][D]
// Request r's tiles: kv head h, tile t at index() (req[3r] < 0: not packed).
struct MatrixPack {
  void* tiles;
  uint8_t* v_nonfinite;     // per tile: whether its V holds a NaN or inf (set when packed)
  uint8_t* state;           // per tile: 0 not packed, 1 being packed, 2 ready (atomic)
  const int64_t* req;       // per request: first tile index, first tile, tiles per kv head
  int32_t tile_keys, head_size;
  bool bf16;
  int64_t tile_elems() const { return 2 * static_cast<int64_t>(tile_keys) * head_size; }
  bool holds(int32_t r) const { return req[3 * r] >= 0; }
  // Tile t of request r (holds(r)), kv head h.
  int64_t index(int32_t r, int32_t h, int64_t t) const {
    return req[3 * r] + h * req[3 * r + 2] + (t - req[3 * r + 1]);
  }
  template <class E>
  E* tile(int64_t idx) const { return static_cast<E*>(tiles) + idx * tile_elems(); }
};
// The layouts' element-level description, for tests of the packing routines: dst of
// transpose32 (K^T) is [ncols][nrows] 32-bit words, dst of interleave16 (V, bf16) is
// [nrows / 2][ncols] words of (row 2j, row 2j + 1).
enum class PackKind : int32_t { kTranspose32 = 0, kInterleave16 = 1 };

struct KernelTable {
  const char* name;
  // Runs one item; scratch holds at least attn_scratch_floats(rows, head_size, block_size).
  void (*attn_item)(const AttnParams& p, const WorkItem& item, float* scratch);
  // Merges `nsplit` partials of one query tile (item.part_out/part_lse point at split 0,
  // consecutive splits `split_stride` floats / `rows_stride` floats apart) into the output.
  void (*merge)(const AttnParams& p, const WorkItem& item, int32_t nsplit,
                int64_t split_stride, int64_t lse_split_stride);
  // The packing routines alone (tests): nrows rows of ncols words (32-bit for kTranspose32,
  // 16-bit for kInterleave16; a null row reads as zeros) into dst.
  void (*pack_rows)(PackKind kind, const void* const* rows, int nrows, int ncols,
                    void* dst) = nullptr;
  // Rows [m_begin, m_end) x panels [p_begin, p_end) of a linear layer.
  void (*linear_block)(const LinearParams& p, int64_t m_begin, int64_t m_end,
                       int64_t p_begin, int64_t p_end) = nullptr;
  // Rows [m_begin, m_end) x output panels [p_begin, p_end) of a gated MLP projection,
  // act(gate) * up (layer_kernel_impl.h): p.n is the packed weight's 2d columns.
  void (*gated_linear_block)(const LinearParams& p, GatedActivation act, int64_t m_begin,
                             int64_t m_end, int64_t p_begin, int64_t p_end) = nullptr;
  // x's rows [m_begin, m_end) rounded to bf16 into dst ((m_end - m_begin) * 2 * k_pairs
  // elements, zero-padded), the operand of linear_dpbf16_block.
  void (*linear_dpbf16_round)(const LinearDpParams& p, int64_t m_begin, int64_t m_end,
                              bf16_t* dst) = nullptr;
  // Rows [m_begin, m_end) x panels [p_begin, p_end) on vdpbf16ps; x_rows: those rows as
  // linear_dpbf16_round wrote them. Both nullptr where the ISA has no bf16 dot product.
  void (*linear_dpbf16_block)(const LinearDpParams& p, int64_t m_begin, int64_t m_end,
                              int64_t p_begin, int64_t p_end, const bf16_t* x_rows) = nullptr;
  void (*rms_norm_rows)(const NormParams& p, int64_t row_begin, int64_t row_end) = nullptr;
  // out[r, i] = act(x[r, i]) * x[r, d + i] for rows [row_begin, row_end); x and out
  // both of `dtype` (kF32 or kBF16), computed in fp32.
  void (*act_mul_rows)(GatedActivation act, const void* x, int64_t x_stride, void* out,
                       int64_t out_stride, int64_t row_begin, int64_t row_end, int64_t d,
                       DType dtype) = nullptr;
  // out[r, i] = act(gate[r, i]) * up[r, i] for rows [0, rows), i < n: gate and up fp32 with
  // row stride `stride`, out of out_dtype (kF32 or kBF16) with row stride out_stride
  // (packed_gated_linear_amx's epilogue, on its accumulators).
  void (*act_mul_f32_rows)(GatedActivation act, const float* gate, const float* up,
                           int64_t stride, int64_t rows, int64_t n, void* out,
                           int64_t out_stride, DType out_dtype) = nullptr;
  // Rotate-half RoPE at one position, in place, of `heads` heads of x (`dtype`: kF32 or
  // kBF16; heads head_stride elements apart, 2 * half each): x[i], x[i + half] <- x[i]
  // cos[i] - x[i + half] sin[i], x[i + half] cos[i] + x[i] sin[i], each product rounded
  // before the sum (no FMA), in fp32.
  void (*rotate_heads)(void* x, DType dtype, int64_t heads, int64_t head_stride,
                       const float* cos, const float* sin, int64_t half) = nullptr;
  // out[r] = the index of the first maximal entry of row r (the first NaN where a row has
  // one) of x (`dtype`: kF32 or kBF16; rows `stride` elements apart, n >= 1 entries each)
  // for rows [row_begin, row_end): greedy sampling's argmax.
  void (*argmax_rows)(const void* x, int64_t stride, int64_t row_begin, int64_t row_end,
                      int64_t n, DType dtype, int64_t* out) = nullptr;
  // Sum of the bytes p[0, n) mod 2^64, read with the ISA's widest loads (stream_read_impl.h):
  // the stream_read op, the bench's DRAM roof.
  uint64_t (*sum_bytes)(const uint8_t* p, int64_t n) = nullptr;
};

// Scratch each thread needs for items of up to `max_rows` rows (same formula in every ISA).
// Scratch of packing one tile: its rows, converted (fp8, fp16), and the tile itself.
inline size_t matrix_pack_scratch_floats(int64_t head_size) {
  return static_cast<size_t>(4 * matrix_tile_keys(static_cast<int>(head_size)) * head_size + 64);
}

inline size_t attn_scratch_floats(int64_t max_rows, int64_t head_size, int64_t block_size) {
  const int64_t pad = 64;  // vector-width padding of every row (covers 16-lane vectors)
  const int64_t rows = max_rows + 16;  // rounded up to a vector
  const int64_t nk = matrix_tile_keys(static_cast<int>(head_size));
  // acc and Q [rows, D], S and P [rows, NK + 16], row state, an unpacked tile and its rows.
  const int64_t matrix = 2 * rows * head_size + 2 * rows * (nk + 16) + 8 * rows + 512 +
                         static_cast<int64_t>(matrix_pack_scratch_floats(head_size));
  return static_cast<size_t>(matrix + max_rows * (head_size + pad) * 2 +   // packed q + accumulators
                             max_rows * (block_size + pad) +      // scores / probabilities
                             max_rows * 8 + 1024 +                // per-row softmax state
                             16 * head_size + 16 +                // one padded key group
                             2 * block_size * head_size + 16 +    // a decoded fp8 K/V block
                             4 * max_rows * head_size + 16);      // q as decode tiles
}

}  // namespace pagedattn
