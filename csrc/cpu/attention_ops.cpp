// cpu_attn_get_scheduler_metadata plans a step; cpu_attention_with_kv_cache validates a
// call, checks the plan against it and executes it. The math lives in the ISA kernel tables
// (kernels_<isa>.cpp).
//
// Metadata (int32, opaque to callers) = header (isa_generated.h MetaHeaderField), per
// request {num_kv_splits, prefix_keys}, then the work partition, planned once per step for
// every layer: jobs (kJobFields ints each, longest first), merges (kMergeFields each),
// shared-prefix groups (kGroupFields each) and their member requests (one int each).
//
// Shared prefixes: requests whose block tables begin with the same physical blocks (a
// system prompt, the n samples of one prompt) form a group. One set of jobs runs every
// member's query rows against those keys, read once (GEMM-shaped: the matrix kernel where
// it pays), into partials; each member's own jobs run its keys past the prefix
// (prefix_keys) into split slots, and its merges fold both by log-sum-exp, the sink once.
// A job holds decisions, not key positions: a split job names its chunk (s of n) and the op
// cuts the chunks from the call's own visible range, so the window hint never changes a
// result. Before trusting the metadata the op checks the header against the call and
// torch.get_num_threads(), a checksum over the tensor and the call's query_start_loc and
// seq_lens (stale or corrupt metadata raises), and each job's fields against the call's
// bounds, so memory safety does not rest on the checksum.
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <vector>

#include "binding_utils.h"
#include "work_pool.h"

namespace pagedattn {

namespace {
constexpr int64_t kMinSplitKeys = 256;   // below this a split costs more than it balances
// Shared prefixes (the fewest keys a group shares: kSharedPrefixMinKeys, isa.py): the most
// query rows (tokens x GQA heads) of one kv head per shared-prefix job, and the fewest
// keys of a job where a group's keys are split over jobs (when the group alone has fewer
// jobs than twice the threads: 3 kv heads on 2 threads left one idle a third of the
// time). docs/performance.md, "Shared prefixes".
constexpr int64_t kSharedRowsPerJob = 128;
constexpr int64_t kMinSharedSplitKeys = 512;
// Rows per kv head from which a group's shared-prefix jobs run on the matrix engine
// rather than the vector kernels (same section).
constexpr int64_t kMatrixMinSharedRows = 16;
// Query rows (tokens x GQA heads) per prefill work item: the vector kernels reuse each K/V
// block for this many rows; the matrix kernel's GEMMs are this tall (docs/kernels.md).
constexpr int64_t kRowsPerTile = 32;
constexpr int64_t kMatrixRowsPerTile = 128;

int64_t q_tile_tokens_for(int64_t group, IsaHint hint) {
  const int64_t rows = hint == IsaHint::kAmx ? kMatrixRowsPerTile : kRowsPerTile;
  return std::max<int64_t>(1, rows / group);
}
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Plan entries after the per-request fields. A job: kv heads [kv_head, kv_head + kv_heads)
// of query tokens [q_begin, q_end) of request req, against the whole key range (split -1)
// or chunk `split` of `nsplit` of the keys past its prefix_keys into partial slot `slot`;
// or (group >= 0) a shared-prefix job: tokens [q_begin, q_end) of the group's token list
// (its members' tokens, member by member) against chunk `split` of the group's `nsplit`
// key chunks, read through the block table of req (the group's representative), into the
// group's prefix rows (slot -1). A merge: the nsplit partials of slots
// [slot, slot + nsplit), rows from row0, of one kv head, and the partials of its group
// (-1: none) from prefix row prefix_row, into the output. A group: its representative,
// the keys its members share, its members [member_begin, member_begin + num_members) of
// the member list, their tokens, its first prefix row (rows [key chunk][kv head][token]
// [GQA head]), whether its jobs run on the matrix engine, and its key chunks.
enum JobField : int64_t { kJobReq, kJobKvHead, kJobKvHeads, kJobQBegin, kJobQEnd, kJobSplit,
                          kJobNSplit, kJobSlot, kJobGroup, kJobFields };
enum MergeField : int64_t { kMergeReq, kMergeKvHead, kMergeQBegin, kMergeQEnd, kMergeSlot,
                            kMergeNSplit, kMergeRow0, kMergeGroup, kMergePrefixRow,
                            kMergeFields };
enum GroupField : int64_t { kGroupRep, kGroupKeys, kGroupMemberBegin, kGroupNumMembers,
                            kGroupTokens, kGroupRowBase, kGroupMatrix, kGroupSplits,
                            kGroupFields };
// Rows of one key chunk of a group's prefix partials: [kv head][token][GQA head].
int64_t group_chunk_rows(const int32_t* grp, int64_t num_kv_heads, int64_t group) {
  return num_kv_heads * grp[kGroupTokens] * group;
}

// Over the whole metadata tensor (its checksum field read as 0) and the lengths it was
// planned for: a plan is only valid for the step whose lengths it saw.
int32_t plan_checksum(const int32_t* md, int64_t n, const int32_t* qsl, const int32_t* sl,
                      int64_t num_reqs) {
  uint64_t h = 0x9E3779B97F4A7C15ull;
  const auto mix = [&h](int32_t w) {
    h = (h ^ static_cast<uint32_t>(w)) * 0x100000001B3ull;
    h ^= h >> 29;
  };
  for (int64_t i = 0; i < n; ++i) mix(i == kMetaChecksum ? 0 : md[i]);
  for (int64_t r = 0; r <= num_reqs; ++r) mix(qsl[r]);
  for (int64_t r = 0; r < num_reqs; ++r) mix(sl[r]);
  return static_cast<int32_t>(h ^ (h >> 32));
}

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

namespace {
// The work partition of one step, before it is written into the metadata tensor.
struct StepPlan {
  struct Job {
    int32_t f[kJobFields];
    int64_t cost;
  };
  std::vector<int32_t> splits_of;    // per request
  std::vector<int32_t> prefix_keys;  // per request: keys its group's jobs cover
  std::vector<Job> jobs;             // longest first
  std::vector<std::array<int32_t, kMergeFields>> merges;
  std::vector<std::array<int32_t, kGroupFields>> groups;
  std::vector<int32_t> members;
  int64_t num_slots = 0, slot_rows = 0, prefix_rows = 0, max_rows = 0;
};

struct PlanShape {
  int64_t num_reqs, num_kv_heads, group, tile, threads;
  bool enable_kv_split, batch_invariant;
  bool shared_matrix;  // the matrix engine runs here (shared-prefix jobs may take it)
};

// Requests whose leading keys live in the same physical blocks, and how many keys they
// share: every member's first `keys` keys are the representative's.
struct SharedGroup {
  int32_t rep;
  int64_t keys;
  std::vector<int32_t> members;
};

// A step's block tables, as the planner reads them.
struct BlockTableView {
  const int32_t* ids;
  int64_t stride, cols, block_size;
  const int32_t* row(int64_t r) const { return ids + r * stride; }
};

// Groups of requests with a common run of leading block ids: at most one group per
// request, each where sharing pays (shared_prefix_pays: isa_generated.h). Requests are
// sorted by their rows (each up to the blocks its keys fill), so requests with a common
// prefix are adjacent and a run's common prefix is the least common prefix of its
// neighbours. A run is kept whole where that saves at least as many key reads,
// (members - 1) x shared keys, as its best split at its weakest link does, and split
// there otherwise: 32 requests behind one system prompt stay one group even where they
// pair up further.
std::vector<SharedGroup> find_shared_groups(int64_t num_reqs, const int32_t* qsl,
                                            const int32_t* sl, const BlockTableView& bt) {
  const int64_t bs = bt.block_size;
  std::vector<int32_t> order;
  std::vector<int64_t> cap(num_reqs, 0);  // blocks of a request that may be shared
  for (int64_t r = 0; r < num_reqs; ++r) {
    cap[r] = std::min<int64_t>(sl[r] / bs, bt.cols);
    if (qsl[r + 1] > qsl[r] && cap[r] * bs >= kSharedPrefixMinKeys) order.push_back(static_cast<int32_t>(r));
  }
  std::vector<SharedGroup> groups;
  if (order.size() < 2) return groups;
  const auto common = [&](int32_t a, int32_t b) {
    const int64_t n = std::min(cap[a], cap[b]);
    const int32_t *x = bt.row(a), *y = bt.row(b);
    int64_t i = 0;
    while (i < n && x[i] == y[i]) ++i;
    return i;
  };
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    const int64_t i = common(a, b);
    const int64_t n = std::min(cap[a], cap[b]);
    if (i < n) return bt.row(a)[i] < bt.row(b)[i];
    return cap[a] != cap[b] ? cap[a] < cap[b] : a < b;
  });
  const int64_t n = static_cast<int64_t>(order.size());
  std::vector<int64_t> link(n - 1);  // common blocks of neighbours i and i + 1
  for (int64_t i = 0; i + 1 < n; ++i) link[i] = common(order[i], order[i + 1]);
  const auto links = [&](int64_t blocks) { return blocks * bs >= kSharedPrefixMinKeys; };
  // Best grouping of order[a..b]: key reads saved, and the runs (as [first, last] pairs).
  struct Best {
    int64_t saved;
    std::vector<std::pair<int64_t, int64_t>> runs;
  };
  const std::function<Best(int64_t, int64_t)> best = [&](int64_t a, int64_t b) -> Best {
    if (a >= b) return Best{0, {}};
    int64_t weakest = a;
    for (int64_t i = a; i < b; ++i)
      if (link[i] < link[weakest]) weakest = i;
    Best left = best(a, weakest), right = best(weakest + 1, b);
    const int64_t whole =
        shared_prefix_pays(b - a + 1, link[weakest] * bs) ? (b - a) * link[weakest] : 0;
    if (whole > 0 && whole >= left.saved + right.saved) return Best{whole, {{a, b}}};
    left.saved += right.saved;
    left.runs.insert(left.runs.end(), right.runs.begin(), right.runs.end());
    return left;
  };
  // Runs of neighbours that share at least one block, each solved apart (no recursion
  // across requests with nothing in common).
  for (int64_t a = 0; a < n;) {
    int64_t b = a;
    while (b + 1 < n && links(link[b])) ++b;
    for (const auto& run : best(a, b).runs) {
      SharedGroup g;
      g.rep = order[run.first];
      int64_t blocks = INT64_MAX;
      for (int64_t i = run.first; i <= run.second; ++i) {
        g.members.push_back(order[i]);
        if (i < run.second) blocks = std::min(blocks, link[i]);
      }
      std::sort(g.members.begin(), g.members.end());
      g.keys = blocks * bs;
      groups.push_back(std::move(g));
    }
    a = b + 1;
  }
  return groups;
}

// One group of every request with queries, sharing the caller's common_prefix_len keys
// (the cascade interface: the caller knows the prefix); their block tables must agree on
// the blocks holding them.
std::vector<SharedGroup> whole_batch_group(int64_t num_reqs, const int32_t* qsl,
                                           const int32_t* sl, const BlockTableView& bt,
                                           int64_t common_prefix_len, const char* op) {
  SharedGroup g{-1, common_prefix_len, {}};
  const int64_t blocks = ceil_div(common_prefix_len, bt.block_size);
  TORCH_CHECK_VALUE(blocks <= bt.cols, op, ": common_prefix_len (", common_prefix_len,
                    ") needs ", blocks, " blocks but block_table has ", bt.cols, " columns");
  for (int64_t r = 0; r < num_reqs; ++r) {
    if (qsl[r + 1] == qsl[r]) continue;
    TORCH_CHECK_VALUE(sl[r] >= common_prefix_len, op, ": common_prefix_len (",
                      common_prefix_len, ") exceeds seq_lens[", r, "] (", sl[r], ")");
    if (g.rep < 0) g.rep = static_cast<int32_t>(r);
    for (int64_t b = 0; b < blocks; ++b)
      TORCH_CHECK_VALUE(bt.row(r)[b] == bt.row(g.rep)[b], op, ": common_prefix_len (",
                        common_prefix_len, ") spans block ", b, ", but block_table[", r, ", ",
                        b, "] (", bt.row(r)[b], ") != block_table[", g.rep, ", ", b, "] (",
                        bt.row(g.rep)[b], ")");
    g.members.push_back(static_cast<int32_t>(r));
  }
  std::vector<SharedGroup> groups;
  if (g.members.size() >= 2) groups.push_back(std::move(g));
  return groups;
}

// Split the key range of single-tile (decode-like) requests only when there are too few
// items to keep every thread busy. The window hint is not used, so results never depend
// on it (the op cuts the chunks from each call's visible range). A batch-invariant plan
// never splits keys (a split row's sums would depend on its batch-mates); it spreads
// decode-like requests over groups of kv heads instead, which leaves each row's
// arithmetic as it was (the generic kernel's rows are independent of their item).
// Members of shared-prefix groups always write partials (their own keys' results are
// merged with the group's), so their own jobs take slots even unsplit.
StepPlan partition_step(const PlanShape& s, const int32_t* qsl, const int32_t* sl,
                        const std::vector<SharedGroup>& groups) {
  const int64_t target = 4 * s.threads, kvh = s.num_kv_heads;
  const auto i32 = [](int64_t v) { return static_cast<int32_t>(v); };
  StepPlan plan;
  plan.prefix_keys.assign(s.num_reqs, 0);
  // Per member: its group and its first token in the group's token list.
  std::vector<int64_t> group_of(s.num_reqs, -1), token_at(s.num_reqs, 0);
  int64_t shared_jobs = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    const SharedGroup& grp = groups[g];
    int64_t tokens = 0;
    for (const int32_t m : grp.members) {
      group_of[m] = static_cast<int64_t>(g);
      token_at[m] = tokens;
      plan.prefix_keys[m] = i32(grp.keys);
      tokens += qsl[m + 1] - qsl[m];
    }
    const int64_t rows = tokens * s.group;  // per kv head
    const bool matrix = s.shared_matrix && rows >= kMatrixMinSharedRows;
    // Token chunks of at most kSharedRowsPerJob rows; halved (to the matrix kernel's
    // floor) while the group has fewer jobs than threads; then key chunks of at least
    // kMinSharedSplitKeys keys while it has fewer than twice as many.
    int64_t chunk = std::max<int64_t>(1, kSharedRowsPerJob / s.group);
    const int64_t floor_rows = matrix ? kMatrixMinRows : 1;
    while (kvh * ceil_div(tokens, chunk) < s.threads && chunk > 1 &&
           (chunk / 2) * s.group >= floor_rows)
      chunk /= 2;
    const int64_t jobs_per_split = kvh * ceil_div(tokens, chunk);
    const int64_t splits =
        s.enable_kv_split && jobs_per_split < 2 * s.threads
            ? std::min({ceil_div(2 * s.threads, jobs_per_split), kMaxSplits,
                        std::max<int64_t>(1, grp.keys / kMinSharedSplitKeys)})
            : 1;
    plan.groups.push_back({grp.rep, i32(grp.keys), i32(plan.members.size()),
                           i32(grp.members.size()), i32(tokens), i32(plan.prefix_rows),
                           matrix ? 1 : 0, i32(splits)});
    plan.members.insert(plan.members.end(), grp.members.begin(), grp.members.end());
    for (int64_t sp = 0; sp < splits; ++sp)
      for (int64_t h = 0; h < kvh; ++h)
        for (int64_t t = 0; t < tokens; t += chunk) {
          const int64_t te = std::min(tokens, t + chunk);
          plan.jobs.push_back(
              {{grp.rep, i32(h), 1, i32(t), i32(te), i32(sp), i32(splits), -1, i32(g)},
               (te - t) * s.group * ceil_div(grp.keys, splits)});
          plan.max_rows = std::max(plan.max_rows, (te - t) * s.group);
          ++shared_jobs;
        }
    plan.prefix_rows += splits * kvh * rows;
  }

  int64_t base_items = std::min(shared_jobs, target);  // counted up to target only
  for (int64_t r = 0; r < s.num_reqs && base_items < target; ++r) {
    const int64_t q_len = qsl[r + 1] - qsl[r];  // decode-like requests: one item, all heads
    base_items += q_len <= s.tile ? 1 : std::min(target, kvh * ceil_div(q_len, s.tile));
  }
  const bool few = base_items > 0 && base_items < target;
  const int64_t head_groups =
      s.batch_invariant && few ? std::min(kvh, ceil_div(target, base_items)) : 1;
  const int64_t decode_heads_per_item = ceil_div(kvh, head_groups);
  plan.splits_of.resize(s.num_reqs);
  bool any_grouped = false;
  for (int64_t r = 0; r < s.num_reqs; ++r) {
    const int64_t q_len = qsl[r + 1] - qsl[r];
    const int64_t own_keys = sl[r] - plan.prefix_keys[r];
    const bool decode_like = q_len <= s.tile;
    const bool member = group_of[r] >= 0;
    int64_t splits = 1;
    if (s.enable_kv_split && !s.batch_invariant && decode_like && few)
      splits = std::min({ceil_div(target, base_items), kMaxSplits,
                         std::max<int64_t>(1, own_keys / kMinSplitKeys)});
    plan.splits_of[r] = i32(splits);
    if (q_len == 0) continue;
    // Decode-like requests (one query tile) get items spanning every kv head (WorkItem),
    // or a group of them (batch-invariant plans of small batches).
    const int64_t heads_per_item = decode_like ? decode_heads_per_item : 1;
    any_grouped |= decode_like;
    for (int64_t h = 0; h < kvh; h += heads_per_item) {
      const int64_t item_heads = std::min(heads_per_item, kvh - h);
      for (int64_t t = 0; t < q_len; t += s.tile) {
        const int64_t qe = std::min(q_len, t + s.tile);
        const int64_t rows = (qe - t) * s.group * item_heads;
        if (splits == 1 && !member) {
          plan.jobs.push_back(
              {{i32(r), i32(h), i32(item_heads), i32(t), i32(qe), -1, 1, -1, -1},
               rows * std::max<int64_t>(sl[r], 1)});
          continue;
        }
        // One merge per kv head: the partials were written by every thread, and per-head
        // merges spread those (mostly cross-core) reads over the threads too.
        for (int64_t k = 0; k < item_heads; ++k) {
          int64_t prefix_row = -1;
          if (member) {
            const auto& grp = plan.groups[group_of[r]];
            prefix_row = grp[kGroupRowBase] + (h + k) * grp[kGroupTokens] * s.group +
                         (token_at[r] + t) * s.group;
          }
          plan.merges.push_back({i32(r), i32(h + k), i32(t), i32(qe), i32(plan.num_slots),
                                 i32(splits), i32(k * (qe - t) * s.group),
                                 member ? i32(group_of[r]) : -1, i32(prefix_row)});
        }
        for (int64_t sp = 0; sp < splits; ++sp)
          plan.jobs.push_back({{i32(r), i32(h), i32(item_heads), i32(t), i32(qe), i32(sp),
                                i32(splits), i32(plan.num_slots + sp), -1},
                               rows * std::max<int64_t>(1, ceil_div(own_keys, splits))});
        plan.num_slots += splits;
        plan.slot_rows = std::max(plan.slot_rows, rows);
      }
    }
  }
  plan.max_rows = std::max(plan.max_rows, s.tile * s.group * (any_grouped ? kvh : 1));
  // Longest first, handed out dynamically: balances mixed prefill/decode batches.
  std::stable_sort(plan.jobs.begin(), plan.jobs.end(),
                   [](const StepPlan::Job& a, const StepPlan::Job& b) { return a.cost > b.cost; });
  return plan;
}
}  // namespace

at::Tensor cpu_attn_get_scheduler_metadata(int64_t num_reqs, int64_t num_heads,
                                           int64_t num_kv_heads, int64_t head_dim,
                                           const at::Tensor& seq_lens, at::ScalarType dtype,
                                           const at::Tensor& query_start_loc, bool causal,
                                           int64_t sliding_window_size, int64_t isa,
                                           bool enable_kv_split, bool batch_invariant,
                                           const std::optional<at::Tensor>& block_table,
                                           int64_t block_size, int64_t common_prefix_len) {
  const char* op = "cpu_attn_get_scheduler_metadata";
  const IsaHint hint = check_isa_hint(isa, op);
  TORCH_CHECK_VALUE(!(batch_invariant && hint == IsaHint::kAmx), op,
                    ": batch_invariant plans need a vector-kernel hint (vec, vec16, neon): the "
                    "'amx' kernel's arithmetic for a row depends on its query tile");
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
  TORCH_CHECK_VALUE(common_prefix_len >= 0, op, ": common_prefix_len must be >= 0, got ",
                    common_prefix_len);
  TORCH_CHECK_VALUE(common_prefix_len == 0 || block_table.has_value(), op,
                    ": common_prefix_len (", common_prefix_len, ") needs the block_table");
  TORCH_CHECK_VALUE(!(batch_invariant && common_prefix_len > 0), op,
                    ": batch_invariant plans do not share prefixes (a row's arithmetic would "
                    "depend on its batch-mates), got common_prefix_len ", common_prefix_len);
  // Shared prefixes, from the block table (batch-invariant plans never share).
  std::vector<SharedGroup> groups;
  at::Tensor bt_c;
  if (block_table.has_value()) {
    check_index_tensor(*block_table, "block_table", at::kInt, 2);
    check_block_size(block_size, "block_size");
    TORCH_CHECK_VALUE(block_table->size(0) >= num_reqs, op, ": block_table has ",
                      block_table->size(0), " rows, need one per request (", num_reqs, ")");
    bt_c = block_table->contiguous();
    const BlockTableView view{bt_c.data_ptr<int32_t>(), bt_c.size(1), bt_c.size(1), block_size};
    if (common_prefix_len > 0)
      groups = whole_batch_group(num_reqs, qsl, sl, view, common_prefix_len, op);
    else if (!batch_invariant)
      groups = find_shared_groups(num_reqs, qsl, sl, view);
  } else {
    TORCH_CHECK_VALUE(block_size == 0, op, ": block_size (", block_size,
                      ") is only read with a block_table");
  }

  const int64_t threads = at::get_num_threads();
  const int64_t group = num_heads / num_kv_heads;
  const int64_t tile = q_tile_tokens_for(group, hint);
  const bool shared_matrix = !groups.empty() && matrix_engine() != nullptr;
  const StepPlan plan = partition_step({num_reqs, num_kv_heads, group, tile, threads,
                                        enable_kv_split, batch_invariant, shared_matrix},
                                       qsl, sl, groups);

  const int64_t num_jobs = static_cast<int64_t>(plan.jobs.size());
  const int64_t num_merges = static_cast<int64_t>(plan.merges.size());
  const int64_t num_groups = static_cast<int64_t>(plan.groups.size());
  const int64_t num_members = static_cast<int64_t>(plan.members.size());
  const int64_t jobs_at = kMetaHeaderSize + kMetaFieldsPerReq * num_reqs;
  const int64_t numel = jobs_at + kJobFields * num_jobs + kMergeFields * num_merges +
                        kGroupFields * num_groups + num_members;
  TORCH_CHECK_VALUE(numel <= INT32_MAX && plan.num_slots <= INT32_MAX &&
                        plan.prefix_rows <= INT32_MAX,
                    op, ": the batch needs ", num_jobs, " work items; at most ",
                    INT32_MAX / kJobFields, " are supported");

  at::Tensor meta = at::zeros({numel}, at::kInt);
  int32_t* md = meta.data_ptr<int32_t>();
  const auto i32 = [](int64_t v) { return static_cast<int32_t>(v); };
  md[kMetaMagic] = kMetaMagicValue;
  md[kMetaVersion] = kMetaVersionValue;
  md[kMetaNumReqs] = i32(num_reqs);
  md[kMetaNumHeads] = i32(num_heads);
  md[kMetaNumKvHeads] = i32(num_kv_heads);
  md[kMetaHeadDim] = i32(head_dim);
  md[kMetaNumThreads] = i32(threads);
  md[kMetaHint] = i32(static_cast<int64_t>(hint));
  md[kMetaCausal] = causal ? 1 : 0;
  md[kMetaEnableKvSplit] = enable_kv_split ? 1 : 0;
  md[kMetaQTileTokens] = i32(tile);
  md[kMetaNumJobs] = i32(num_jobs);
  md[kMetaNumMerges] = i32(num_merges);
  md[kMetaNumSlots] = i32(plan.num_slots);
  md[kMetaSlotRows] = i32(plan.slot_rows);
  md[kMetaMaxRows] = i32(plan.max_rows);
  md[kMetaBatchInvariant] = batch_invariant ? 1 : 0;
  md[kMetaNumGroups] = i32(num_groups);
  md[kMetaNumMembers] = i32(num_members);
  md[kMetaPrefixRows] = i32(plan.prefix_rows);
  for (int64_t r = 0; r < num_reqs; ++r) {
    int32_t* fields = md + kMetaHeaderSize + r * kMetaFieldsPerReq;
    fields[kReqNumKvSplits] = plan.splits_of[r];
    fields[kReqPrefixKeys] = plan.prefix_keys[r];
  }
  int32_t* out = md + jobs_at;
  for (const auto& j : plan.jobs) out = std::copy(j.f, j.f + kJobFields, out);
  for (const auto& m : plan.merges) out = std::copy(m.begin(), m.end(), out);
  for (const auto& g : plan.groups) out = std::copy(g.begin(), g.end(), out);
  out = std::copy(plan.members.begin(), plan.members.end(), out);
  md[kMetaChecksum] = plan_checksum(md, numel, qsl, sl, num_reqs);
  return meta;
}

namespace {
// The op's scratch (per-worker item state, split partials), kept per calling thread and
// reused across calls: scratch allocated per call comes back as fresh pages whenever other
// code allocated in between, and small decodes then pay page faults (docs/performance.md,
// "Workspace"). Grows to the largest call seen on the thread; the contents are undefined.
class Workspace {
 public:
  size_t bytes() const { return capacity_ * sizeof(float); }
  void release() {
    buf_.reset();
    capacity_ = 0;
  }
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

// The plan of a call, checked against it (see the top of the file).
struct CheckedPlan {
  const int32_t* req_fields;  // kMetaFieldsPerReq per request
  const int32_t* jobs;
  const int32_t* merges;
  const int32_t* groups;
  const int32_t* members;
  int64_t num_reqs, num_jobs, num_merges, num_slots, slot_rows, max_rows, tile;
  int64_t num_groups, num_members, prefix_rows;
  IsaHint hint;
  bool batch_invariant;
  int64_t prefix_keys(int64_t r) const { return req_fields[r * kMetaFieldsPerReq + kReqPrefixKeys]; }
  const int32_t* group(int64_t g) const { return groups + g * kGroupFields; }
};

CheckedPlan check_plan(const at::Tensor& meta_c, int64_t num_reqs, int64_t num_heads,
                       int64_t num_kv_heads, int64_t hs, const int32_t* qsl, const int32_t* sl) {
  const int32_t* md = meta_c.data_ptr<int32_t>();
  const int64_t n = meta_c.numel();
  TORCH_CHECK_VALUE(n >= kMetaHeaderSize && md[kMetaMagic] == kMetaMagicValue &&
                        md[kMetaVersion] == kMetaVersionValue,
                    "scheduler_metadata was not produced by cpu_attn_get_scheduler_metadata");
  TORCH_CHECK_VALUE(md[kMetaNumReqs] == num_reqs, "scheduler_metadata was built for ",
                    md[kMetaNumReqs], " requests, this call has ", num_reqs);
  TORCH_CHECK_VALUE(md[kMetaNumHeads] == num_heads && md[kMetaNumKvHeads] == num_kv_heads &&
                        md[kMetaHeadDim] == hs,
                    "scheduler_metadata was built for (num_heads, num_kv_heads, head_dim) = (",
                    md[kMetaNumHeads], ", ", md[kMetaNumKvHeads], ", ", md[kMetaHeadDim],
                    "), this call has (", num_heads, ", ", num_kv_heads, ", ", hs, ")");
  const int64_t threads = at::get_num_threads();
  TORCH_CHECK_VALUE(md[kMetaNumThreads] == threads, "scheduler_metadata was built for ",
                    md[kMetaNumThreads], " threads but torch.get_num_threads() is now ", threads,
                    "; rebuild it with cpu_attn_get_scheduler_metadata after changing threads");
  CheckedPlan plan{};
  plan.num_reqs = num_reqs;
  plan.hint = check_isa_hint(md[kMetaHint], "cpu_attention_with_kv_cache");
  const int64_t group = num_heads / num_kv_heads;
  plan.tile = md[kMetaQTileTokens];
  TORCH_CHECK_VALUE(plan.tile == q_tile_tokens_for(group, plan.hint),
                    "scheduler_metadata is corrupt: q_tile_tokens ", plan.tile, ", expected ",
                    q_tile_tokens_for(group, plan.hint));
  plan.num_jobs = md[kMetaNumJobs];
  plan.num_merges = md[kMetaNumMerges];
  plan.num_slots = md[kMetaNumSlots];
  plan.slot_rows = md[kMetaSlotRows];
  plan.max_rows = md[kMetaMaxRows];
  plan.batch_invariant = md[kMetaBatchInvariant] != 0;
  plan.num_groups = md[kMetaNumGroups];
  plan.num_members = md[kMetaNumMembers];
  plan.prefix_rows = md[kMetaPrefixRows];
  const int64_t jobs_at = kMetaHeaderSize + kMetaFieldsPerReq * num_reqs;
  const int64_t want = jobs_at + kJobFields * std::max<int64_t>(plan.num_jobs, 0) +
                       kMergeFields * std::max<int64_t>(plan.num_merges, 0) +
                       kGroupFields * std::max<int64_t>(plan.num_groups, 0) +
                       std::max<int64_t>(plan.num_members, 0);
  TORCH_CHECK_VALUE(n == want, "scheduler_metadata has ", n, " elements; its header describes ",
                    num_reqs, " requests, ", plan.num_jobs, " jobs, ", plan.num_merges,
                    " merges, ", plan.num_groups, " shared-prefix groups and ", plan.num_members,
                    " members, i.e. ", want, " (truncated or corrupt)");
  TORCH_CHECK_VALUE(md[kMetaChecksum] == plan_checksum(md, n, qsl, sl, num_reqs),
                    "scheduler_metadata does not match this call's query_start_loc/seq_lens ",
                    "(planned for another step?) or is corrupt; rebuild it with ",
                    "cpu_attn_get_scheduler_metadata");
  // Bounds, so that no metadata at all can make the op read or write out of range.
  const int64_t max_rows = std::max(q_tile_tokens_for(group, plan.hint) * group * num_kv_heads,
                                    kSharedRowsPerJob);
  TORCH_CHECK_VALUE(plan.num_jobs >= 0 && plan.num_merges >= 0 && plan.num_slots >= 0 &&
                        plan.num_slots <= plan.num_jobs && plan.max_rows >= 1 &&
                        plan.max_rows <= max_rows && plan.slot_rows >= 0 &&
                        plan.slot_rows <= plan.max_rows && plan.num_groups >= 0 &&
                        plan.num_members >= 0 && plan.prefix_rows >= 0 &&
                        (plan.num_groups > 0 || plan.prefix_rows == 0),
                    "scheduler_metadata is corrupt (plan header out of range)");
  plan.req_fields = md + kMetaHeaderSize;
  plan.jobs = md + jobs_at;
  plan.merges = plan.jobs + kJobFields * plan.num_jobs;
  plan.groups = plan.merges + kMergeFields * plan.num_merges;
  plan.members = plan.groups + kGroupFields * plan.num_groups;
  for (int64_t r = 0; r < num_reqs; ++r)
    TORCH_CHECK_VALUE(plan.prefix_keys(r) >= 0 && plan.prefix_keys(r) <= sl[r],
                      "scheduler_metadata is corrupt (prefix_keys of request ", r,
                      " out of range)");
  // A group's keys are read through its representative's block table by every member's
  // rows: they must exist in every member's (check_block_ids checks the ids themselves).
  for (int64_t g = 0; g < plan.num_groups; ++g) {
    const int32_t* grp = plan.group(g);
    const int64_t rep = grp[kGroupRep], first = grp[kGroupMemberBegin];
    bool ok = rep >= 0 && rep < num_reqs && grp[kGroupKeys] >= 1 && grp[kGroupKeys] <= sl[rep] &&
              first >= 0 && grp[kGroupNumMembers] >= 1 &&
              first + grp[kGroupNumMembers] <= plan.num_members && grp[kGroupRowBase] >= 0 &&
              grp[kGroupTokens] >= 0 && grp[kGroupSplits] >= 1 &&
              grp[kGroupSplits] <= kMaxSplits &&
              grp[kGroupRowBase] + grp[kGroupSplits] * group_chunk_rows(grp, num_kv_heads, group) <=
                  plan.prefix_rows;
    int64_t tokens = 0;
    for (int64_t i = first; ok && i < first + grp[kGroupNumMembers]; ++i) {
      const int64_t m = plan.members[i];
      ok = m >= 0 && m < num_reqs && grp[kGroupKeys] <= sl[m];
      if (ok) tokens += qsl[m + 1] - qsl[m];
    }
    ok = ok && tokens == grp[kGroupTokens];
    TORCH_CHECK_VALUE(ok, "scheduler_metadata is corrupt (shared-prefix group ", g,
                      " out of range)");
  }
  for (int64_t i = 0; i < plan.num_jobs; ++i) {
    const int32_t* j = plan.jobs + i * kJobFields;
    const int64_t r = j[kJobReq], g = j[kJobGroup];
    bool ok = r >= 0 && r < num_reqs && j[kJobKvHead] >= 0 && j[kJobKvHeads] >= 1 &&
              j[kJobKvHead] + int64_t{j[kJobKvHeads]} <= num_kv_heads && j[kJobQBegin] >= 0 &&
              j[kJobQBegin] < j[kJobQEnd] && g >= -1 && g < plan.num_groups;
    const int64_t rows = ok ? int64_t{j[kJobQEnd] - j[kJobQBegin]} * group * j[kJobKvHeads] : 0;
    if (ok && g >= 0) {  // tokens of the group's list; several heads only over all of them
      const int32_t* grp = plan.group(g);
      ok = r == grp[kGroupRep] && j[kJobQEnd] <= grp[kGroupTokens] &&
           j[kJobNSplit] == grp[kGroupSplits] && j[kJobSplit] >= 0 &&
           j[kJobSplit] < j[kJobNSplit] && j[kJobSlot] == -1 && rows <= plan.max_rows &&
           (j[kJobKvHeads] == 1 || (j[kJobQBegin] == 0 && j[kJobQEnd] == grp[kGroupTokens]));
    } else if (ok) {
      ok = j[kJobQEnd] <= qsl[r + 1] - int64_t{qsl[r]} &&
           j[kJobQEnd] - j[kJobQBegin] <= plan.tile && rows <= plan.max_rows &&
           (j[kJobSplit] == -1 ? j[kJobSlot] == -1
                               : j[kJobSplit] >= 0 && j[kJobSplit] < j[kJobNSplit] &&
                                     j[kJobNSplit] <= kMaxSplits && j[kJobSlot] >= 0 &&
                                     j[kJobSlot] < plan.num_slots && rows <= plan.slot_rows);
    }
    TORCH_CHECK_VALUE(ok, "scheduler_metadata is corrupt (job ", i, " out of range)");
  }
  for (int64_t i = 0; i < plan.num_merges; ++i) {
    const int32_t* m = plan.merges + i * kMergeFields;
    const int64_t r = m[kMergeReq], g = m[kMergeGroup];
    const int64_t rows = int64_t{m[kMergeQEnd]} - m[kMergeQBegin];
    bool ok =
        r >= 0 && r < num_reqs && m[kMergeKvHead] >= 0 && m[kMergeKvHead] < num_kv_heads &&
        m[kMergeQBegin] >= 0 && m[kMergeQBegin] < m[kMergeQEnd] &&
        m[kMergeQEnd] <= qsl[r + 1] - int64_t{qsl[r]} && m[kMergeNSplit] >= 1 &&
        m[kMergeNSplit] <= kMaxSplits && m[kMergeSlot] >= 0 &&
        m[kMergeSlot] + int64_t{m[kMergeNSplit]} <= plan.num_slots && m[kMergeRow0] >= 0 &&
        m[kMergeRow0] + rows * group <= plan.slot_rows && g >= -1 && g < plan.num_groups;
    if (ok && g >= 0) {  // the group's chunks' partials of these rows, one chunk apart
      const int32_t* grp = plan.group(g);
      ok = m[kMergePrefixRow] >= 0 &&
           m[kMergePrefixRow] + (grp[kGroupSplits] - 1) * group_chunk_rows(grp, num_kv_heads, group) +
                   rows * group <= plan.prefix_rows;
    }
    TORCH_CHECK_VALUE(ok, "scheduler_metadata is corrupt (merge ", i, " out of range)");
  }
  return plan;
}

// Key range of a job: the request's whole range, or chunk `split` of `nsplit` block-aligned
// chunks (at least kMinSplitKeys keys each; trailing ones may be empty) of the keys this
// call lets the request see; for a member of a shared-prefix group, of those past the
// group's keys (prefix_keys). A shared-prefix job covers the group's keys.
std::pair<int64_t, int64_t> job_keys(const AttnParams& p, const CheckedPlan& plan,
                                     const int32_t* j) {
  if (j[kJobGroup] >= 0) {  // chunk `split` of the group's keys, in steps of 64
    const int64_t keys = plan.group(j[kJobGroup])[kGroupKeys];
    const int64_t chunk = ceil_div(ceil_div(keys, j[kJobNSplit]), 64) * 64;
    const int64_t a = std::min(keys, j[kJobSplit] * chunk);
    return {a, std::min(keys, a + chunk)};
  }
  const int64_t r = j[kJobReq], kv_len = p.seq_lens[r], skip = plan.prefix_keys(r);
  if (j[kJobSplit] < 0) return {skip, kv_len};
  KeyRange vis =
      request_key_range(p, p.query_start_loc[r + 1] - int64_t{p.query_start_loc[r]}, kv_len);
  vis.first = std::max(vis.first, skip);
  const int64_t count = std::max<int64_t>(0, vis.last - vis.first + 1);
  const int64_t chunk =
      ceil_div(std::max(ceil_div(count, j[kJobNSplit]), kMinSplitKeys), p.block_size) *
      p.block_size;
  const int64_t a = std::min(vis.first + j[kJobSplit] * chunk, vis.last + 1);
  return {a, std::min(vis.last + 1, a + chunk)};
}
}  // namespace

namespace {
// The call's dimensions, once its tensors and scalars are checked.
struct CallShape {
  DType dtype, cache_dtype;
  int64_t num_tokens, num_heads, head_size, num_blocks, num_kv_heads, block_size, num_reqs;
};

void check_attention_tensors(const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& output,
                             CallShape& c) {
  check_cpu(query, "query");
  check_cpu(output, "output");
  check_cpu(key_cache, "key_cache");
  check_cpu(value_cache, "value_cache");
  c.dtype = to_dtype(query.scalar_type(), "query");
  TORCH_CHECK_VALUE(query.dim() == 3, "query must be 3-D [num_tokens, num_heads, head_size], got shape ",
                    query.sizes());
  TORCH_CHECK_VALUE(output.sizes() == query.sizes(), "output shape ", output.sizes(),
                    " must equal query shape ", query.sizes());
  TORCH_CHECK_TYPE(output.scalar_type() == query.scalar_type(), "output dtype ",
                   output.scalar_type(), " must equal query dtype ", query.scalar_type());
  check_cache_pair(key_cache, value_cache);
  c.cache_dtype = to_cache_dtype(key_cache.scalar_type(), "key_cache");
  TORCH_CHECK_TYPE(c.cache_dtype == c.dtype || is_fp8(c.cache_dtype), "kv cache dtype ",
                   key_cache.scalar_type(), " must equal query dtype ", query.scalar_type(),
                   " or be float8_e4m3fn / float8_e5m2");
  c.num_tokens = query.size(0), c.num_heads = query.size(1), c.head_size = query.size(2);
  c.num_blocks = key_cache.size(0), c.num_kv_heads = key_cache.size(1);
  c.block_size = key_cache.size(2);
  const int64_t hs = c.head_size;
  TORCH_CHECK_VALUE(key_cache.size(3) == hs, "key_cache head_size (", key_cache.size(3),
                    ") must equal query head_size (", hs, ")");
  check_head_size(hs, "query");
  check_heads(c.num_heads, c.num_kv_heads);
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
  TORCH_CHECK_VALUE(c.num_tokens <= 1 || output.stride(0) >= c.num_heads * hs,
                    "output rows overlap: token stride ", output.stride(0),
                    " < num_heads * head_size (", c.num_heads * hs,
                    "); output needs its own storage per token (not an expand()ed tensor)");
}

void check_batch_tensors(const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                         const at::Tensor& block_table, CallShape& c) {
  check_index_tensor(query_start_loc, "query_start_loc", at::kInt, 1);
  check_index_tensor(seq_lens, "seq_lens", at::kInt, 1);
  check_index_tensor(block_table, "block_table", at::kInt, 2);
  c.num_reqs = seq_lens.numel();
  TORCH_CHECK_VALUE(query_start_loc.numel() == c.num_reqs + 1, "query_start_loc must have ",
                    "len(seq_lens) + 1 (", c.num_reqs + 1, ") entries, got ", query_start_loc.numel());
  TORCH_CHECK_VALUE(block_table.size(0) >= c.num_reqs, "block_table has ", block_table.size(0),
                    " rows, need one per request (", c.num_reqs, ")");
  TORCH_CHECK_VALUE(block_table.size(1) <= 1 || block_table.stride(1) == 1,
                    "block_table rows must be contiguous, got strides ", block_table.strides());
}

// scale, softcap and the window, checked; the window clamped (returned through the refs).
void check_scalars(double scale, double softcap, double k_scale, double v_scale,
                   int64_t& window_left, int64_t& window_right) {
  check_kv_scale(k_scale, "k_scale");
  check_kv_scale(v_scale, "v_scale");
  TORCH_CHECK_VALUE(window_left >= -1 && window_right >= -1,
                    "sliding window must be -1 (unbounded) or >= 0, got (", window_left,
                    ", ", window_right, ")");
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
  window_left = std::min(window_left, kUnboundedWindow);
  window_right = std::min(window_right, kUnboundedWindow);
}

// A per-head float32 vector argument ([num_heads]), contiguous fp32, or undefined.
at::Tensor per_head_floats(const std::optional<at::Tensor>& t, const char* name,
                           int64_t num_heads, bool bf16_ok) {
  if (!t.has_value()) return at::Tensor();
  const at::Tensor& a = *t;
  check_cpu(a, name);
  TORCH_CHECK_TYPE(a.scalar_type() == at::kFloat || (bf16_ok && a.scalar_type() == at::kBFloat16),
                   name, bf16_ok ? " must be float32 or bfloat16, got " : " must be float32, got ",
                   a.scalar_type());
  TORCH_CHECK_VALUE(a.dim() == 1 && a.numel() == num_heads, name, " must have shape [",
                    num_heads, "] (num_heads), got ", a.sizes());
  return a.to(at::kFloat).contiguous();
}

AttnParams make_params(const CallShape& c, const at::Tensor& query, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, at::Tensor& output,
                       const at::Tensor& block_table, const int32_t* qsl, const int32_t* sl,
                       double scale, bool causal, const at::Tensor& alibi_f, int64_t window_left,
                       int64_t window_right, double softcap, const at::Tensor& sink_f,
                       double k_scale, double v_scale) {
  AttnParams p{};
  p.dtype = c.dtype;
  p.cache_dtype = c.cache_dtype;
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
  p.block_table = block_table.data_ptr<int32_t>();
  p.bt_stride = block_table.stride(0);
  p.query_start_loc = qsl;
  p.seq_lens = sl;
  p.head_size = static_cast<int32_t>(c.head_size);
  p.block_size = static_cast<int32_t>(c.block_size);
  p.num_heads = static_cast<int32_t>(c.num_heads);
  p.num_kv_heads = static_cast<int32_t>(c.num_kv_heads);
  // fp8: scores on the stored values times (scale * k_scale), outputs times v_scale.
  // Other caches hold the values themselves: their scales are ignored, as in vLLM.
  const bool fp8 = is_fp8(c.cache_dtype);
  p.scale = static_cast<float>(fp8 ? scale * k_scale : scale);
  p.v_scale = fp8 ? static_cast<float>(v_scale) : 1.f;
  p.softcap = static_cast<float>(softcap);
  p.alibi = alibi_f.defined() ? alibi_f.data_ptr<float>() : nullptr;
  p.sink = sink_f.defined() ? sink_f.data_ptr<float>() : nullptr;
  p.window_left = window_left;
  p.window_right = window_right;
  p.causal = causal;
  return p;
}

// Only the blocks each request actually reads must be valid ids. A shared-prefix group's
// jobs read its keys through its representative's row for every member, so the members'
// rows must hold the same ids there: a block table other than the one the plan was made
// for is refused, not read as the wrong keys.
void check_block_ids(const AttnParams& p, const CallShape& c, int64_t table_cols,
                     const CheckedPlan& plan) {
  const int64_t bs = c.block_size;
  for (int64_t r = 0; r < c.num_reqs; ++r) {
    const int32_t* sl = p.seq_lens;
    const KeyRange vis = request_key_range(p, p.query_start_loc[r + 1] - int64_t{p.query_start_loc[r]}, sl[r]);
    if (vis.last < vis.first) continue;
    TORCH_CHECK_VALUE(vis.last / bs < table_cols, "seq_lens[", r, "] (", sl[r],
                      ") needs ", vis.last / bs + 1, " blocks of ", bs,
                      " but block_table has only ", table_cols, " columns");
    const int32_t* row = p.block_table + r * p.bt_stride;
    for (int64_t b = vis.first / bs; b <= vis.last / bs; ++b)
      TORCH_CHECK_VALUE(row[b] >= 0 && row[b] < c.num_blocks, "block_table[", r, ", ", b, "] (",
                        row[b], ") is out of range for a cache of ", c.num_blocks, " blocks");
  }
  for (int64_t g = 0; g < plan.num_groups; ++g) {
    const int32_t* grp = plan.group(g);
    const int64_t rep = grp[kGroupRep], blocks = ceil_div(grp[kGroupKeys], bs);
    TORCH_CHECK_VALUE(blocks <= table_cols, "scheduler_metadata's shared prefix of request ", rep,
                      " needs ", blocks, " blocks of ", bs, " but block_table has only ",
                      table_cols, " columns (a plan made for another block size?)");
    const int32_t* rep_row = p.block_table + rep * p.bt_stride;
    for (int64_t b = 0; b < blocks; ++b)
      TORCH_CHECK_VALUE(rep_row[b] >= 0 && rep_row[b] < c.num_blocks, "block_table[", rep, ", ",
                        b, "] (", rep_row[b], ") is out of range for a cache of ", c.num_blocks,
                        " blocks");
    for (int64_t i = grp[kGroupMemberBegin]; i < grp[kGroupMemberBegin] + grp[kGroupNumMembers];
         ++i) {
      const int64_t m = plan.members[i];
      const int32_t* row = p.block_table + m * p.bt_stride;
      for (int64_t b = 0; b < blocks; ++b)
        TORCH_CHECK_VALUE(row[b] == rep_row[b], "block_table[", m, ", ", b, "] (", row[b],
                          ") differs from block_table[", rep, ", ", b, "] (", rep_row[b],
                          "), which scheduler_metadata shares between them: plan the step with "
                          "this block_table");
    }
  }
}

Workspace& pack_workspace() {
  thread_local Workspace w;
  return w;
}

// Packed K/V tiles of a call's matrix items (kernel_api.h MatrixPack) up to this size; a
// larger call packs the requests past it per item, as each item reads a tile. Tests
// lower it (set_matrix_pack_limit) to run that path.
constexpr int64_t kMaxPackedBytes = int64_t{256} << 20;
std::atomic<int64_t> g_pack_limit{kMaxPackedBytes};
// A pack buffer this large is freed after its call rather than kept for the next.
constexpr int64_t kKeptPackBytes = int64_t{32} << 20;

// Lays out the K/V tiles of every (request, kv head) with matrix items in the thread's
// pack workspace, none packed yet (the items pack each tile as they first read it:
// kernel_api.h MatrixPack), and points p.packed at them. pack/pack_req/the workspace hold
// them until the call returns.
void plan_matrix_pack(AttnParams& p, const CheckedPlan& plan, MatrixPack& pack,
                      std::vector<int64_t>& pack_req) {
  const int64_t num_reqs = plan.num_reqs;
  const int64_t kvh = p.num_kv_heads, hs = p.head_size;
  const int nk = matrix_tile_keys(p.head_size);
  const bool bf16 = matrix_uses_bf16(p);
  const int64_t tile_bytes = 2 * nk * hs * (bf16 ? 2 : 4);
  std::vector<char> wants(num_reqs, 0);
  for (int64_t i = 0; i < plan.num_jobs; ++i) {
    const int32_t* j = plan.jobs + i * kJobFields;
    if (j[kJobGroup] < 0 && item_runs_on_matrix(p, j[kJobQEnd] - j[kJobQBegin], j[kJobKvHeads]))
      wants[j[kJobReq]] = 1;
  }
  pack_req.assign(3 * num_reqs, -1);
  int64_t tiles = 0;
  for (int64_t r = 0; r < num_reqs; ++r) {
    if (!wants[r]) continue;
    const KeyRange vis =
        request_key_range(p, p.query_start_loc[r + 1] - int64_t{p.query_start_loc[r]}, p.seq_lens[r]);
    if (vis.first > vis.last) continue;
    const int64_t first = vis.first / nk, count = vis.last / nk - first + 1;
    if ((tiles + count * kvh) * tile_bytes > g_pack_limit.load()) continue;
    pack_req[3 * r] = tiles;
    pack_req[3 * r + 1] = first;
    pack_req[3 * r + 2] = count;
    tiles += count * kvh;
  }
  if (tiles == 0) return;
  // Per tile two flag bytes (v_nonfinite, state), then the tiles.
  const int64_t flag_floats = align_floats((2 * tiles + 3) / 4);
  float* buf = pack_workspace().floats(static_cast<size_t>(flag_floats + tiles * tile_bytes / 4));
  uint8_t* flags = reinterpret_cast<uint8_t*>(buf);
  std::memset(flags + tiles, 0, static_cast<size_t>(tiles));
  pack = MatrixPack{buf + flag_floats, flags, flags + tiles, pack_req.data(), nk,
                    static_cast<int32_t>(hs), bf16};
  p.packed = &pack;
}

// Each shared-prefix group's token list (kernel_api.h PrefixToken), member by member in
// the group's member order; group g's list starts at at[g].
void group_tokens(const AttnParams& p, const CheckedPlan& plan, std::vector<PrefixToken>& tokens,
                  std::vector<int64_t>& at) {
  tokens.clear();
  at.assign(plan.num_groups, 0);
  for (int64_t g = 0; g < plan.num_groups; ++g) {
    const int32_t* grp = plan.group(g);
    at[g] = static_cast<int64_t>(tokens.size());
    for (int64_t i = grp[kGroupMemberBegin]; i < grp[kGroupMemberBegin] + grp[kGroupNumMembers];
         ++i) {
      const int32_t m = plan.members[i];
      const int32_t qs = p.query_start_loc[m], q_len = p.query_start_loc[m + 1] - qs;
      for (int32_t t = 0; t < q_len; ++t)
        tokens.push_back(PrefixToken{qs + t, p.seq_lens[m] - q_len + t});
    }
  }
}

// Runs the plan's work items on the pool, then merges the split and shared-prefix partials.
void execute_plan(const AttnParams& p, const CheckedPlan& plan, int64_t head_size) {
  const KernelTable* kt = current_kernels();
  const int64_t hs = head_size;
  // Workspace: per-worker scratch, the split partials (outputs, log-sum-exps), then the
  // shared-prefix partials (the same).
  const int64_t threads = at::get_num_threads();
  const int64_t scratch_floats =
      align_floats(static_cast<int64_t>(attn_scratch_floats(plan.max_rows, hs, p.block_size)));
  const int64_t nworkers = std::max<int64_t>(1, std::min(threads, plan.num_jobs));
  const int64_t part_out_at = nworkers * scratch_floats;
  const int64_t part_lse_at = align_floats(part_out_at + plan.num_slots * plan.slot_rows * hs);
  const int64_t prefix_out_at = align_floats(part_lse_at + plan.num_slots * plan.slot_rows);
  const int64_t prefix_lse_at = align_floats(prefix_out_at + plan.prefix_rows * hs);
  thread_local Workspace workspace;
  float* scr = workspace.floats(static_cast<size_t>(prefix_lse_at + plan.prefix_rows));
  float* part_out = scr + part_out_at;
  float* part_lse = scr + part_lse_at;
  float* prefix_out = scr + prefix_out_at;
  float* prefix_lse = scr + prefix_lse_at;
  // The caller's lists: a thread_local named inside the workers' lambda would be theirs.
  thread_local std::vector<PrefixToken> tokens_kept;
  thread_local std::vector<int64_t> tokens_at_kept;
  group_tokens(p, plan, tokens_kept, tokens_at_kept);
  const PrefixToken* tokens = tokens_kept.data();
  const int64_t* tokens_at = tokens_at_kept.data();

  std::atomic<int64_t> next{0};
  const bool profiling = p.matrix != nullptr && matrix_engine_profiling();
  MatrixPack pack{};
  std::vector<int64_t> pack_req;
  AttnParams packed_params = p;
  if (p.matrix != nullptr) plan_matrix_pack(packed_params, plan, pack, pack_req);
  const AttnParams& pp = packed_params;
  // Shared-prefix jobs run on the matrix engine or the vector kernels as their group's
  // plan says (whatever the call's hint), and pack their own tiles.
  AttnParams shared_matrix = p, shared_vector = p;
  shared_matrix.matrix = plan.num_groups > 0 ? matrix_engine() : nullptr;
  shared_matrix.packed = shared_vector.packed = nullptr;
  shared_vector.matrix = nullptr;
  const int64_t G = p.num_heads / p.num_kv_heads;
  pool_parallel_for(0, nworkers, 1, [&](int64_t b, int64_t e) {
    for (int64_t w = b; w < e; ++w) {
      const int64_t start = profiling ? matrix_engine_clock_ns() : 0;
      float* mine = scr + w * scratch_floats;
      bool used_matrix = p.matrix != nullptr;
      for (int64_t i = next.fetch_add(1); i < plan.num_jobs; i = next.fetch_add(1)) {
        const int32_t* j = plan.jobs + i * kJobFields;
        const auto keys = job_keys(p, plan, j);
        if (j[kJobGroup] >= 0) {
          const int32_t* grp = plan.group(j[kJobGroup]);
          const int64_t row = grp[kGroupRowBase] +
                              j[kJobSplit] * group_chunk_rows(grp, p.num_kv_heads, G) +
                              j[kJobKvHead] * grp[kGroupTokens] * G + j[kJobQBegin] * G;
          WorkItem item{j[kJobReq], j[kJobKvHead], 0, j[kJobQEnd] - j[kJobQBegin],
                        static_cast<int32_t>(keys.first), static_cast<int32_t>(keys.second),
                        prefix_out + row * hs, prefix_lse + row, j[kJobKvHeads],
                        tokens + tokens_at[j[kJobGroup]] + j[kJobQBegin]};
          const bool on_matrix = grp[kGroupMatrix] != 0 && shared_matrix.matrix != nullptr;
          used_matrix |= on_matrix;
          kt->attn_item(on_matrix ? shared_matrix : shared_vector, item, mine);
          continue;
        }
        const int64_t slot = j[kJobSlot];
        WorkItem item{j[kJobReq], j[kJobKvHead], j[kJobQBegin], j[kJobQEnd],
                      static_cast<int32_t>(keys.first), static_cast<int32_t>(keys.second),
                      slot < 0 ? nullptr : part_out + slot * plan.slot_rows * hs,
                      slot < 0 ? nullptr : part_lse + slot * plan.slot_rows, j[kJobKvHeads]};
        kt->attn_item(pp, item, mine);
      }
      if (profiling) matrix_engine_add_busy(matrix_engine_clock_ns() - start);
      if (used_matrix) matrix_engine_release();
    }
  });
  if (pp.packed != nullptr && pack_workspace().bytes() > static_cast<size_t>(kKeptPackBytes))
    pack_workspace().release();
  if (plan.num_merges == 0) return;
  pool_parallel_for(0, plan.num_merges, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int32_t* m = plan.merges + i * kMergeFields;
      const int64_t row0 = m[kMergeSlot] * plan.slot_rows + m[kMergeRow0];
      const int64_t prefix_row = m[kMergePrefixRow];
      WorkItem item{m[kMergeReq], m[kMergeKvHead], m[kMergeQBegin], m[kMergeQEnd], 0,
                    p.seq_lens[m[kMergeReq]], part_out + row0 * hs, part_lse + row0, 1};
      if (m[kMergeGroup] >= 0) {
        const int32_t* grp = plan.group(m[kMergeGroup]);
        item.prefix_out = prefix_out + prefix_row * hs;
        item.prefix_lse = prefix_lse + prefix_row;
        item.prefix_parts = grp[kGroupSplits];
        item.prefix_part_rows = group_chunk_rows(grp, p.num_kv_heads, G);
      }
      kt->merge(p, item, m[kMergeNSplit], plan.slot_rows * hs, plan.slot_rows);
    }
  });
}
}  // namespace

// Tests only: the packed-tile budget of a call in bytes (0: every item packs its own
// tiles); returns the previous one.
int64_t set_matrix_pack_limit(int64_t bytes) {
  TORCH_CHECK_VALUE(bytes >= 0, "set_matrix_pack_limit: bytes must be >= 0, got ", bytes);
  return g_pack_limit.exchange(bytes);
}

// check -> params -> plan lookup -> execute.
void cpu_attention_with_kv_cache(const at::Tensor& query, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache, at::Tensor& output,
                                 const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                                 double scale, bool causal,
                                 const std::optional<at::Tensor>& alibi_slopes,
                                 int64_t sliding_window_left, int64_t sliding_window_right,
                                 const at::Tensor& block_table, double softcap,
                                 const at::Tensor& scheduler_metadata,
                                 const std::optional<at::Tensor>& s_aux, double k_scale,
                                 double v_scale) {
  CallShape c{};
  check_attention_tensors(query, key_cache, value_cache, output, c);
  check_batch_tensors(query_start_loc, seq_lens, block_table, c);
  check_scalars(scale, softcap, k_scale, v_scale, sliding_window_left, sliding_window_right);
  const at::Tensor alibi_f = per_head_floats(alibi_slopes, "alibi_slopes", c.num_heads, false);
  const at::Tensor sink_f = per_head_floats(s_aux, "s_aux", c.num_heads, true);

  check_index_tensor(scheduler_metadata, "scheduler_metadata", at::kInt, 1);
  const at::Tensor meta_c = scheduler_metadata.contiguous();
  const at::Tensor qsl_c = query_start_loc.contiguous(), sl_c = seq_lens.contiguous();
  const int32_t* qsl = qsl_c.data_ptr<int32_t>();
  const int32_t* sl = sl_c.data_ptr<int32_t>();
  check_lengths(qsl, sl, c.num_reqs, c.num_tokens);
  const CheckedPlan plan =
      check_plan(meta_c, c.num_reqs, c.num_heads, c.num_kv_heads, c.head_size, qsl, sl);
  check_block_size(c.block_size, "kv cache");

  AttnParams p = make_params(c, query, key_cache, value_cache, output, block_table, qsl, sl,
                             scale, causal, alibi_f, sliding_window_left, sliding_window_right,
                             softcap, sink_f, k_scale, v_scale);
  if (plan.hint == IsaHint::kAmx) p.matrix = matrix_engine();
  p.row_invariant = plan.batch_invariant;
  check_block_ids(p, c, block_table.size(1), plan);
  if (c.num_tokens == 0 || plan.num_jobs == 0) return;
  execute_plan(p, plan, c.head_size);
}

}  // namespace pagedattn

TORCH_LIBRARY_FRAGMENT(pagedattn, m) {
  m.def(
      "cpu_attn_get_scheduler_metadata(int num_reqs, int num_heads, int num_kv_heads, "
      "int head_dim, Tensor seq_lens, ScalarType dtype, Tensor query_start_loc, bool causal, "
      "int sliding_window_size, int isa, bool enable_kv_split, bool batch_invariant=False, "
      "Tensor? block_table=None, int block_size=0, int common_prefix_len=0) -> Tensor");
  m.def(
      "cpu_attention_with_kv_cache(Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor(a!) output, Tensor query_start_loc, Tensor seq_lens, float scale, bool causal, "
      "Tensor? alibi_slopes, int sliding_window_left, int sliding_window_right, "
      "Tensor block_table, float softcap, Tensor scheduler_metadata, Tensor? s_aux, "
      "float k_scale=1.0, float v_scale=1.0) -> ()");
  m.def("set_matrix_pack_limit(int bytes) -> int", &pagedattn::set_matrix_pack_limit);
}

TORCH_LIBRARY_IMPL(pagedattn, CPU, m) {
  m.impl("cpu_attn_get_scheduler_metadata", &pagedattn::cpu_attn_get_scheduler_metadata);
  m.impl("cpu_attention_with_kv_cache", &pagedattn::cpu_attention_with_kv_cache);
}
