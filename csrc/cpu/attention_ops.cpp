// cpu_attn_get_scheduler_metadata + cpu_attention_with_kv_cache: validation, work
// partition and threading. The math lives in the ISA kernel tables (kernels_<isa>.cpp).
//
// Metadata (int32, opaque to callers) = header (isa_generated.h MetaHeaderField) + per
// request {num_kv_splits, reserved}. Its length depends only on num_reqs, so the fake
// implementation knows the shape. It stores decisions, never positions: the attention op
// derives every key range from the live seq_lens/query_start_loc, so stale metadata can at
// worst be slower, never wrong -- except a changed thread count, which is rejected.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <vector>

#include "binding_utils.h"

namespace pagedattn {

namespace {
constexpr int64_t kMaxSplits = 64;       // attn_kernel_impl.h merge keeps weights on the stack
constexpr int64_t kMinSplitKeys = 256;   // below this a split costs more than it balances
constexpr int64_t kRowsPerTile = 32;     // query rows (tokens x GQA heads) per prefill work item;
                                         // 16 -> 32 rows: bf16 prefill +5% (K/V block reuse)

int64_t q_tile_tokens_for(int64_t group) { return std::max<int64_t>(1, kRowsPerTile / group); }
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void check_heads(int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK_VALUE(num_heads > 0 && num_kv_heads > 0, "num_heads (", num_heads,
                    ") and num_kv_heads (", num_kv_heads, ") must be positive");
  TORCH_CHECK_VALUE(num_heads <= INT32_MAX && num_kv_heads <= INT32_MAX, "num_heads (",
                    num_heads, ") and num_kv_heads (", num_kv_heads, ") must be at most ",
                    INT32_MAX, " (int32)");
  TORCH_CHECK_VALUE(num_heads % num_kv_heads == 0, "num_heads (", num_heads,
                    ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
}

// query_start_loc must be int32 [num_reqs + 1], start at 0, be non-decreasing, end at
// at most num_tokens; seq_lens int32 [num_reqs] with seq_lens[r] >= q_len(r).
void check_lengths(const int32_t* qsl, const int32_t* sl, int64_t num_reqs, int64_t num_tokens) {
  TORCH_CHECK_VALUE(qsl[0] == 0, "query_start_loc[0] must be 0, got ", qsl[0]);
  for (int64_t r = 0; r < num_reqs; ++r)
    TORCH_CHECK_VALUE(qsl[r + 1] >= qsl[r], "query_start_loc must be non-decreasing, got ",
                      "query_start_loc[", r, "] = ", qsl[r], " > query_start_loc[", r + 1,
                      "] = ", qsl[r + 1]);
  // Rows past query_start_loc[-1] (padding) are allowed and left untouched.
  if (num_tokens >= 0)
    TORCH_CHECK_VALUE(qsl[num_reqs] <= num_tokens, "query_start_loc[-1] (", qsl[num_reqs],
                      ") exceeds the number of query tokens (", num_tokens, ")");
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t q_len = static_cast<int64_t>(qsl[r + 1]) - qsl[r];
    TORCH_CHECK_VALUE(sl[r] >= q_len, "seq_lens[", r, "] (", sl[r],
                      ") must be >= query length (", q_len, ")");
  }
}
}  // namespace

at::Tensor cpu_attn_get_scheduler_metadata(int64_t num_reqs, int64_t num_heads,
                                           int64_t num_kv_heads, int64_t head_dim,
                                           const at::Tensor& seq_lens, at::ScalarType dtype,
                                           const at::Tensor& query_start_loc, bool causal,
                                           int64_t sliding_window_size, int64_t isa,
                                           bool enable_kv_split) {
  const char* op = "cpu_attn_get_scheduler_metadata";
  const IsaHint hint = check_isa_hint(isa, op);
  TORCH_CHECK_VALUE(num_reqs >= 0, op, ": num_reqs must be >= 0, got ", num_reqs);
  check_heads(num_heads, num_kv_heads);
  check_head_size(head_dim, op);
  to_dtype(dtype, "dtype");
  TORCH_CHECK_VALUE(sliding_window_size == -1 || sliding_window_size > 0, op,
                    ": sliding_window_size must be -1 (none) or positive, got ",
                    sliding_window_size);
  check_index_tensor(seq_lens, "seq_lens", at::kInt, 1);
  check_index_tensor(query_start_loc, "query_start_loc", at::kInt, 1);
  TORCH_CHECK_VALUE(seq_lens.numel() == num_reqs, "seq_lens must have num_reqs (", num_reqs,
                    ") entries, got ", seq_lens.numel());
  TORCH_CHECK_VALUE(query_start_loc.numel() == num_reqs + 1,
                    "query_start_loc must have num_reqs + 1 (", num_reqs + 1, ") entries, got ",
                    query_start_loc.numel());
  const at::Tensor sl_c = seq_lens.contiguous(), qsl_c = query_start_loc.contiguous();
  const int32_t* sl = sl_c.data_ptr<int32_t>();
  const int32_t* qsl = qsl_c.data_ptr<int32_t>();
  check_lengths(qsl, sl, num_reqs, -1);

  const int64_t threads = at::get_num_threads();
  const int64_t group = num_heads / num_kv_heads;
  const int64_t tile = q_tile_tokens_for(group);
  at::Tensor meta = at::zeros({kMetaHeaderSize + kMetaFieldsPerReq * num_reqs}, at::kInt);
  int32_t* md = meta.data_ptr<int32_t>();
  md[kMetaMagic] = kMetaMagicValue;
  md[kMetaVersion] = kMetaVersionValue;
  md[kMetaNumReqs] = static_cast<int32_t>(num_reqs);
  md[kMetaNumHeads] = static_cast<int32_t>(num_heads);
  md[kMetaNumKvHeads] = static_cast<int32_t>(num_kv_heads);
  md[kMetaHeadDim] = static_cast<int32_t>(head_dim);
  md[kMetaNumThreads] = static_cast<int32_t>(threads);
  md[kMetaHint] = static_cast<int32_t>(hint);
  md[kMetaCausal] = causal ? 1 : 0;
  md[kMetaEnableKvSplit] = enable_kv_split ? 1 : 0;
  md[kMetaQTileTokens] = static_cast<int32_t>(tile);

  // Split the key range of single-tile (decode-like) requests only when there are too few
  // items to keep every thread busy; the window hint is not used so that results never
  // depend on it (the op clamps splits to the visible range anyway).
  const int64_t target = 4 * threads;
  int64_t base_items = 0;  // counted up to target only (no overflow for huge batches)
  for (int64_t r = 0; r < num_reqs && base_items < target; ++r) {
    const int64_t q_len = qsl[r + 1] - qsl[r];  // decode-like requests: one item, all heads
    base_items += q_len <= tile ? 1 : std::min(target, num_kv_heads * ceil_div(q_len, tile));
  }
  for (int64_t r = 0; r < num_reqs; ++r) {
    int64_t splits = 1;
    const int64_t q_len = qsl[r + 1] - qsl[r];
    if (enable_kv_split && q_len <= tile && base_items > 0 && base_items < target) {
      splits = std::min({ceil_div(target, base_items), kMaxSplits,
                         std::max<int64_t>(1, sl[r] / kMinSplitKeys)});
    }
    md[kMetaHeaderSize + r * kMetaFieldsPerReq + kReqNumKvSplits] = static_cast<int32_t>(splits);
  }
  return meta;
}

namespace {
// The op's scratch (per-worker item state, split partials), kept per calling thread and
// reused across calls. Allocated per call, it came back as fresh pages whenever other code
// had allocated in between -- an engine's other layers, or vLLM in the side-by-side bench --
// and each call paid 20-60 page faults: a B1 ctx2048 decode ran 400-650 us instead of
// ~350. Grows to the largest call seen on the thread; the contents are undefined.
class Workspace {
 public:
  float* floats(size_t n) {
    if (n > capacity_) {
      const size_t bytes = (n * sizeof(float) + 63) / 64 * 64;
      buf_.reset();  // free the old buffer first: never hold both
      capacity_ = 0;  // if the allocation below fails, the next call must allocate again
      buf_.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
      TORCH_CHECK(buf_ != nullptr, "pagedattn: could not allocate ", bytes,
                  " bytes of attention scratch");
      capacity_ = bytes / sizeof(float);
    }
    return buf_.get();
  }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> buf_;
  size_t capacity_ = 0;
};

// Floats from `offset` rounded up to a 64-byte boundary.
int64_t align_floats(int64_t offset) { return (offset + 15) / 16 * 16; }

// Key positions [lo, hi] any query of request r can see (hi < lo: none).
void visible_range(int64_t q_len, int64_t kv_len, bool causal, int64_t wl, int64_t wr,
                   int64_t* lo, int64_t* hi) {
  const int64_t p_first = kv_len - q_len, p_last = kv_len - 1;
  int64_t a = 0, b = kv_len - 1;
  if (q_len == 0) {
    *lo = 0;
    *hi = -1;
    return;
  }
  if (causal) b = std::min(b, p_last);
  if (wl >= 0) a = std::max(a, p_first - wl);
  if (wr >= 0) b = std::min(b, p_last + wr);
  *lo = a;
  *hi = b;
}
}  // namespace

void cpu_attention_with_kv_cache(const at::Tensor& query, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache, at::Tensor& output,
                                 const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                                 double scale, bool causal,
                                 const std::optional<at::Tensor>& alibi_slopes,
                                 int64_t sliding_window_left, int64_t sliding_window_right,
                                 const at::Tensor& block_table, double softcap,
                                 const at::Tensor& scheduler_metadata,
                                 const std::optional<at::Tensor>& s_aux) {
  // ---- tensors: device, dtype, rank, strides, shapes
  check_cpu(query, "query");
  check_cpu(output, "output");
  check_cpu(key_cache, "key_cache");
  check_cpu(value_cache, "value_cache");
  const DType dt = to_dtype(query.scalar_type(), "query");
  TORCH_CHECK_VALUE(query.dim() == 3, "query must be 3-D [num_tokens, num_heads, head_size], got shape ",
                    query.sizes());
  TORCH_CHECK_VALUE(output.sizes() == query.sizes(), "output shape ", output.sizes(),
                    " must equal query shape ", query.sizes());
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&key_cache, &value_cache, &output})
    TORCH_CHECK_TYPE(t->scalar_type() == query.scalar_type(),
                     "query, key_cache, value_cache and output must share one dtype; query is ",
                     query.scalar_type(), ", got ", t->scalar_type());
  check_cache_pair(key_cache, value_cache);
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), hs = query.size(2);
  const int64_t num_blocks = key_cache.size(0), num_kv_heads = key_cache.size(1);
  const int64_t bs = key_cache.size(2);
  TORCH_CHECK_VALUE(key_cache.size(3) == hs, "key_cache head_size (", key_cache.size(3),
                    ") must equal query head_size (", hs, ")");
  check_head_size(hs, "query");
  check_heads(num_heads, num_kv_heads);
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&query, &output, &key_cache, &value_cache})
    TORCH_CHECK_VALUE(t->stride(t->dim() - 1) == 1, "the head_size dim of query, output and the ",
                      "kv caches must be contiguous, got strides ", t->strides());
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&query, &output})
    TORCH_CHECK_VALUE(t->stride(1) == hs, "query/output heads must be packed per token ",
                      "(stride(1) == head_size ", hs, "; any token stride is fine), got strides ",
                      t->strides());
  for (const auto* t : {&key_cache, &value_cache})
    TORCH_CHECK_VALUE(t->stride(2) == hs, "kv cache blocks must store token rows contiguously ",
                      "(stride(2) == head_size ", hs, "), got strides ", t->strides());
  // Rows written through one address (an expand()ed output) would race and be garbage.
  TORCH_CHECK_VALUE(num_tokens <= 1 || output.stride(0) >= num_heads * hs,
                    "output rows overlap: token stride ", output.stride(0),
                    " < num_heads * head_size (", num_heads * hs,
                    "); output needs its own storage per token (not an expand()ed tensor)");

  check_index_tensor(query_start_loc, "query_start_loc", at::kInt, 1);
  check_index_tensor(seq_lens, "seq_lens", at::kInt, 1);
  check_index_tensor(block_table, "block_table", at::kInt, 2);
  const int64_t num_reqs = seq_lens.numel();
  TORCH_CHECK_VALUE(query_start_loc.numel() == num_reqs + 1, "query_start_loc must have ",
                    "len(seq_lens) + 1 (", num_reqs + 1, ") entries, got ", query_start_loc.numel());
  TORCH_CHECK_VALUE(block_table.size(0) >= num_reqs, "block_table has ", block_table.size(0),
                    " rows, need one per request (", num_reqs, ")");
  TORCH_CHECK_VALUE(block_table.size(1) <= 1 || block_table.stride(1) == 1,
                    "block_table rows must be contiguous, got strides ", block_table.strides());
  TORCH_CHECK_VALUE(sliding_window_left >= -1 && sliding_window_right >= -1,
                    "sliding window must be -1 (unbounded) or >= 0, got (", sliding_window_left,
                    ", ", sliding_window_right, ")");
  // The kernels compute in fp32: scale and softcap must survive the conversion (a cap
  // of 1e-46 became 0.0f, i.e. capping silently off), and scale / softcap too.
  constexpr double kFltMax = std::numeric_limits<float>::max();
  constexpr double kFltMin = std::numeric_limits<float>::min();
  TORCH_CHECK_VALUE(std::isfinite(scale) && std::abs(scale) <= kFltMax,
                    "scale must be finite in float32 (|scale| <= ", kFltMax, "), got ", scale);
  TORCH_CHECK_VALUE(softcap == 0 || (softcap >= kFltMin && softcap <= kFltMax &&
                                     std::isfinite(static_cast<float>(scale) /
                                                   static_cast<float>(softcap))),
                    "softcap must be 0 (off) or a normal float32 in [", kFltMin, ", ", kFltMax,
                    "] with scale / softcap finite in float32, got softcap ", softcap,
                    " (scale ", scale, ")");
  // Positions are < 2^31, so any window of 2^32 or more hides nothing: clamping keeps
  // pos +- window far from int64 overflow without changing the result.
  constexpr int64_t kUnboundedWindow = int64_t{1} << 32;
  sliding_window_left = std::min(sliding_window_left, kUnboundedWindow);
  sliding_window_right = std::min(sliding_window_right, kUnboundedWindow);

  at::Tensor alibi_f, sink_f;
  if (alibi_slopes.has_value()) {
    const at::Tensor& a = *alibi_slopes;
    check_cpu(a, "alibi_slopes");
    TORCH_CHECK_TYPE(a.scalar_type() == at::kFloat, "alibi_slopes must be float32, got ",
                     a.scalar_type());
    TORCH_CHECK_VALUE(a.dim() == 1 && a.numel() == num_heads, "alibi_slopes must have shape [",
                      num_heads, "] (num_heads), got ", a.sizes());
    alibi_f = a.contiguous();
  }
  if (s_aux.has_value()) {
    const at::Tensor& s = *s_aux;
    check_cpu(s, "s_aux");
    TORCH_CHECK_TYPE(s.scalar_type() == at::kFloat || s.scalar_type() == at::kBFloat16,
                     "s_aux must be float32 or bfloat16, got ", s.scalar_type());
    TORCH_CHECK_VALUE(s.dim() == 1 && s.numel() == num_heads, "s_aux must have shape [",
                      num_heads, "] (num_heads), got ", s.sizes());
    sink_f = s.to(at::kFloat).contiguous();
  }

  // ---- metadata matches this call
  check_index_tensor(scheduler_metadata, "scheduler_metadata", at::kInt, 1);
  const at::Tensor meta_c = scheduler_metadata.contiguous();
  const int32_t* md = meta_c.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(meta_c.numel() >= kMetaHeaderSize && md[kMetaMagic] == kMetaMagicValue &&
                        md[kMetaVersion] == kMetaVersionValue,
                    "scheduler_metadata was not produced by cpu_attn_get_scheduler_metadata");
  TORCH_CHECK_VALUE(md[kMetaNumReqs] == num_reqs, "scheduler_metadata was built for ",
                    md[kMetaNumReqs], " requests, this call has ", num_reqs);
  TORCH_CHECK_VALUE(meta_c.numel() == kMetaHeaderSize + kMetaFieldsPerReq * num_reqs,
                    "scheduler_metadata has ", meta_c.numel(), " elements; metadata for ",
                    num_reqs, " requests has ", kMetaHeaderSize + kMetaFieldsPerReq * num_reqs,
                    " (truncated or corrupt)");
  TORCH_CHECK_VALUE(md[kMetaNumHeads] == num_heads && md[kMetaNumKvHeads] == num_kv_heads &&
                        md[kMetaHeadDim] == hs,
                    "scheduler_metadata was built for (num_heads, num_kv_heads, head_dim) = (",
                    md[kMetaNumHeads], ", ", md[kMetaNumKvHeads], ", ", md[kMetaHeadDim],
                    "), this call has (", num_heads, ", ", num_kv_heads, ", ", hs, ")");
  const int64_t threads = at::get_num_threads();
  TORCH_CHECK_VALUE(md[kMetaNumThreads] == threads, "scheduler_metadata was built for ",
                    md[kMetaNumThreads], " threads but torch.get_num_threads() is now ", threads,
                    "; rebuild it with cpu_attn_get_scheduler_metadata after changing threads");
  const IsaHint hint = check_isa_hint(md[kMetaHint], "cpu_attention_with_kv_cache");
  check_block_size(bs, hint, "kv cache");
  const int64_t tile = md[kMetaQTileTokens];
  TORCH_CHECK_VALUE(tile == q_tile_tokens_for(num_heads / num_kv_heads),
                    "scheduler_metadata is corrupt: q_tile_tokens ", tile, ", expected ",
                    q_tile_tokens_for(num_heads / num_kv_heads));

  // ---- lengths and block ids (only the blocks each request actually reads)
  const at::Tensor qsl_c = query_start_loc.contiguous(), sl_c = seq_lens.contiguous();
  const int32_t* qsl = qsl_c.data_ptr<int32_t>();
  const int32_t* sl = sl_c.data_ptr<int32_t>();
  check_lengths(qsl, sl, num_reqs, num_tokens);
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int64_t bt_stride = block_table.stride(0);
  std::vector<int64_t> vis_lo(num_reqs), vis_hi(num_reqs);
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t q_len = qsl[r + 1] - qsl[r];
    visible_range(q_len, sl[r], causal, sliding_window_left, sliding_window_right, &vis_lo[r],
                  &vis_hi[r]);
    if (vis_hi[r] < vis_lo[r]) continue;
    TORCH_CHECK_VALUE(vis_hi[r] / bs < block_table.size(1), "seq_lens[", r, "] (", sl[r],
                      ") needs ", vis_hi[r] / bs + 1, " blocks of ", bs,
                      " but block_table has only ", block_table.size(1), " columns");
    const int32_t* row = bt + r * block_table.stride(0);
    for (int64_t b = vis_lo[r] / bs; b <= vis_hi[r] / bs; ++b)
      TORCH_CHECK_VALUE(row[b] >= 0 && row[b] < num_blocks, "block_table[", r, ", ", b, "] (",
                        row[b], ") is out of range for a cache of ", num_blocks, " blocks");
  }
  const KernelTable* kt = current_kernels();
  if (num_tokens == 0) return;

  AttnParams p{};
  p.dtype = dt;
  p.q = query.data_ptr();
  p.q_stride_tok = query.stride(0);
  p.q_stride_head = query.stride(1);
  p.out = output.data_ptr();
  p.o_stride_tok = output.stride(0);
  p.o_stride_head = output.stride(1);
  p.k_cache = key_cache.data_ptr();
  p.v_cache = value_cache.data_ptr();
  p.k_stride_block = key_cache.stride(0);
  p.k_stride_head = key_cache.stride(1);
  p.k_stride_tok = key_cache.stride(2);
  p.v_stride_block = value_cache.stride(0);
  p.v_stride_head = value_cache.stride(1);
  p.v_stride_tok = value_cache.stride(2);
  p.block_table = bt;
  p.bt_stride = bt_stride;
  p.query_start_loc = qsl;
  p.seq_lens = sl;
  p.head_size = static_cast<int32_t>(hs);
  p.block_size = static_cast<int32_t>(bs);
  p.num_heads = static_cast<int32_t>(num_heads);
  p.num_kv_heads = static_cast<int32_t>(num_kv_heads);
  p.scale = static_cast<float>(scale);
  p.softcap = static_cast<float>(softcap);
  p.alibi = alibi_f.defined() ? alibi_f.data_ptr<float>() : nullptr;
  p.sink = sink_f.defined() ? sink_f.data_ptr<float>() : nullptr;
  p.window_left = sliding_window_left;
  p.window_right = sliding_window_right;
  p.causal = causal;

  // ---- work items: (request, kv head, query tile, key split)
  const int64_t group = num_heads / num_kv_heads;
  // Decode-like requests (one query tile) get items spanning every kv head (see WorkItem).
  bool any_grouped = false;
  for (int64_t r = 0; r < num_reqs; ++r)
    any_grouped |= qsl[r + 1] - qsl[r] > 0 && qsl[r + 1] - qsl[r] <= tile;
  const int64_t max_rows = tile * group * (any_grouped ? num_kv_heads : 1);
  struct Job {
    WorkItem item;
    int64_t cost;
    int64_t slot;  // partial-result slot, -1: writes the output directly
  };
  struct Merge {
    WorkItem item;
    int64_t slot;  // slot of split 0; the tile's splits are consecutive
    int32_t nsplit;
    int64_t row0;  // the item's first row within the slots
  };
  std::vector<Job> jobs;
  std::vector<Merge> merges;
  int64_t num_slots = 0;
  int64_t slot_rows = 0;  // rows of the largest split item (decodes: a fraction of max_rows)
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t q_len = qsl[r + 1] - qsl[r];
    if (q_len == 0) continue;
    const int64_t vis = std::max<int64_t>(0, vis_hi[r] - vis_lo[r] + 1);
    int64_t splits = md[kMetaHeaderSize + r * kMetaFieldsPerReq + kReqNumKvSplits];
    splits = q_len > tile ? 1 : std::clamp<int64_t>(splits, 1, kMaxSplits);
    splits = std::min(splits, std::max<int64_t>(1, vis / kMinSplitKeys));
    // Block-aligned chunk boundaries over the visible range.
    const int64_t chunk = splits > 1 ? ceil_div(ceil_div(vis, splits), bs) * bs : 0;
    if (splits > 1) splits = ceil_div(vis, chunk);
    const auto r32 = static_cast<int32_t>(r);
    const int64_t heads_per_item = q_len <= tile ? num_kv_heads : 1;
    const auto nh32 = static_cast<int32_t>(heads_per_item);
    for (int64_t h = 0; h < num_kv_heads; h += heads_per_item) {
      const auto h32 = static_cast<int32_t>(h);
      for (int64_t t = 0; t < q_len; t += tile) {
        const auto t32 = static_cast<int32_t>(t);
        const auto qe = static_cast<int32_t>(std::min(q_len, t + tile));
        const int64_t rows = (qe - t) * group * heads_per_item;
        if (splits == 1) {
          jobs.push_back({WorkItem{r32, h32, t32, qe, 0, sl[r], nullptr, nullptr, nh32},
                          rows * std::max<int64_t>(vis, 1), -1});
          continue;
        }
        // One merge per kv head: the partials were written by every thread, and per-head
        // merges spread those (mostly cross-core) reads over the threads too.
        const int64_t head_rows = (qe - t) * group;
        for (int64_t k = 0; k < heads_per_item; ++k)
          merges.push_back({WorkItem{r32, static_cast<int32_t>(h + k), t32, qe, 0, sl[r], nullptr,
                                     nullptr, 1},
                            num_slots, static_cast<int32_t>(splits), k * head_rows});
        for (int64_t s = 0; s < splits; ++s) {
          const int64_t a = vis_lo[r] + s * chunk, b = std::min(vis_hi[r] + 1, a + chunk);
          jobs.push_back({WorkItem{r32, h32, t32, qe, static_cast<int32_t>(a),
                                   static_cast<int32_t>(b), nullptr, nullptr, nh32},
                          rows * (b - a), num_slots + s});
        }
        num_slots += splits;
        slot_rows = std::max(slot_rows, rows);
      }
    }
  }
  // Workspace: per-worker scratch, then the split partials (outputs, log-sum-exps).
  const int64_t scratch_floats =
      align_floats(static_cast<int64_t>(attn_scratch_floats(max_rows, hs, bs)));
  const int64_t nworkers = std::max<int64_t>(1, std::min<int64_t>(threads, jobs.size()));
  const int64_t part_out_floats = num_slots * slot_rows * hs;
  const int64_t part_out_at = nworkers * scratch_floats;
  const int64_t part_lse_at = align_floats(part_out_at + part_out_floats);
  thread_local Workspace workspace;
  float* scr = workspace.floats(static_cast<size_t>(part_lse_at + num_slots * slot_rows));
  if (num_slots > 0) {
    float* po = scr + part_out_at;
    float* pl = scr + part_lse_at;
    for (Job& j : jobs) {
      if (j.slot < 0) continue;
      j.item.part_out = po + j.slot * slot_rows * hs;
      j.item.part_lse = pl + j.slot * slot_rows;
    }
    for (Merge& m : merges) {
      m.item.part_out = po + (m.slot * slot_rows + m.row0) * hs;
      m.item.part_lse = pl + m.slot * slot_rows + m.row0;
    }
  }
  // Longest first, handed out dynamically: balances mixed prefill/decode batches.
  std::stable_sort(jobs.begin(), jobs.end(),
                   [](const Job& a, const Job& b) { return a.cost > b.cost; });

  std::atomic<int64_t> next{0};
  const int64_t njobs = static_cast<int64_t>(jobs.size());
  at::parallel_for(0, nworkers, 1, [&](int64_t b, int64_t e) {
    for (int64_t w = b; w < e; ++w) {
      float* mine = scr + w * scratch_floats;
      for (int64_t i = next.fetch_add(1); i < njobs; i = next.fetch_add(1))
        kt->attn_item(p, jobs[i].item, mine);
    }
  });
  if (!merges.empty()) {
    at::parallel_for(0, static_cast<int64_t>(merges.size()), 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i)
        kt->merge(p, merges[i].item, merges[i].nsplit, slot_rows * hs, slot_rows);
    });
  }
}

}  // namespace pagedattn

TORCH_LIBRARY_FRAGMENT(pagedattn, m) {
  m.def(
      "cpu_attn_get_scheduler_metadata(int num_reqs, int num_heads, int num_kv_heads, "
      "int head_dim, Tensor seq_lens, ScalarType dtype, Tensor query_start_loc, bool causal, "
      "int sliding_window_size, int isa, bool enable_kv_split) -> Tensor");
  m.def(
      "cpu_attention_with_kv_cache(Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor(a!) output, Tensor query_start_loc, Tensor seq_lens, float scale, bool causal, "
      "Tensor? alibi_slopes, int sliding_window_left, int sliding_window_right, "
      "Tensor block_table, float softcap, Tensor scheduler_metadata, Tensor? s_aux) -> ()");
}

TORCH_LIBRARY_IMPL(pagedattn, CPU, m) {
  m.impl("cpu_attn_get_scheduler_metadata", &pagedattn::cpu_attn_get_scheduler_metadata);
  m.impl("cpu_attention_with_kv_cache", &pagedattn::cpu_attention_with_kv_cache);
}
