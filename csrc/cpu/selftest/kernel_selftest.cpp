// Torch-free self-test of the ISA kernel tables against an fp64 reference.
//
// Why: the NEON kernels cannot run on the x86 CI machine, but they can run under
// qemu-aarch64 when cross-compiled together with this driver (no torch for aarch64 is
// needed because the kernel TUs include no torch headers). On x86 the same driver checks
// every table this CPU executes. tests/test_kernel_selftest.py builds and runs it.
//
// Usage: kernel_selftest [isa ...]   (default: every table compiled in and executable)
// Prints one line per (isa, case) and exits non-zero on the first mismatch.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "isa_generated.h"
#include "kernel_api.h"

namespace pa = pagedattn;

namespace {

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

float from_bf16(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE half conversions in plain C++ (the driver must build on x86 and aarch64 alike).
uint16_t to_fp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  if (std::isnan(f)) return static_cast<uint16_t>(sign | 0x7E00u);
  float a = std::fabs(f);
  if (a >= 65520.f) return static_cast<uint16_t>(sign | 0x7C00u);
  if (a < 6.103515625e-05f) {  // subnormal half: units of 2^-24, round to nearest even
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.f)));
  }
  std::memcpy(&x, &a, 4);
  uint32_t mant = x & 0x7FFFFFu, exp = (x >> 23) - 127 + 15;
  uint32_t h = (exp << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // carries into the exponent
  return static_cast<uint16_t>(sign | h);
}

float from_fp16(uint16_t u) {
  const uint32_t sign = (u & 0x8000u) << 16, exp = (u >> 10) & 0x1Fu, mant = u & 0x3FFu;
  float mag;
  if (exp == 0) mag = std::ldexp(static_cast<float>(mant), -24);
  else if (exp == 31) mag = mant ? NAN : INFINITY;
  else mag = std::ldexp(static_cast<float>(mant | 0x400u), static_cast<int>(exp) - 25);
  uint32_t x;
  std::memcpy(&x, &mag, 4);
  x |= sign;
  std::memcpy(&mag, &x, 4);
  return mag;
}

bool is16(pa::DType t) { return t != pa::DType::kF32; }
uint16_t to16(pa::DType t, float f) { return t == pa::DType::kBF16 ? to_bf16(f) : to_fp16(f); }
float from16(pa::DType t, uint16_t u) { return t == pa::DType::kBF16 ? from_bf16(u) : from_fp16(u); }

struct Case {
  const char* name;
  pa::DType dtype;
  int head_size, block_size, num_heads, num_kv_heads;
  std::vector<int> q_lens, seq_lens;
  bool causal;
  int64_t left, right;
  float softcap;
  bool alibi, sink;
  int splits;  // > 1: split every item's key range and merge by LSE
};

struct Batch {
  std::vector<float> q, k, v;                 // values (already rounded to the dtype)
  std::vector<uint16_t> q16, k16, v16;        // 16-bit storage when dtype is bf16/fp16
  std::vector<int32_t> block_table, qsl, seq_lens;
  std::vector<float> alibi, sink;
  int num_blocks = 0, max_blocks = 0, num_tokens = 0;
};

Batch make_batch(const Case& c, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  Batch b;
  const int reqs = static_cast<int>(c.q_lens.size());
  for (int r = 0; r < reqs; ++r) b.max_blocks = std::max(b.max_blocks, (c.seq_lens[r] + c.block_size - 1) / c.block_size);
  b.num_blocks = reqs * b.max_blocks + 1;
  // Request r owns blocks in reverse order so a kernel that ignores the table is caught.
  b.block_table.resize(static_cast<size_t>(reqs) * b.max_blocks);
  for (int r = 0; r < reqs; ++r)
    for (int i = 0; i < b.max_blocks; ++i)
      b.block_table[r * b.max_blocks + i] = b.num_blocks - 1 - (r * b.max_blocks + i);
  b.qsl.push_back(0);
  for (int r = 0; r < reqs; ++r) b.qsl.push_back(b.qsl.back() + c.q_lens[r]);
  b.seq_lens = c.seq_lens;
  b.num_tokens = b.qsl.back();
  auto fill = [&](std::vector<float>& x, size_t n) {
    x.resize(n);
    for (auto& e : x) {
      e = normal(rng);
      if (is16(c.dtype)) e = from16(c.dtype, to16(c.dtype, e));
    }
  };
  fill(b.q, static_cast<size_t>(b.num_tokens) * c.num_heads * c.head_size);
  const size_t cache = static_cast<size_t>(b.num_blocks) * c.num_kv_heads * c.block_size * c.head_size;
  fill(b.k, cache);
  fill(b.v, cache);
  if (is16(c.dtype)) {
    for (auto pair : {std::make_pair(&b.q, &b.q16), std::make_pair(&b.k, &b.k16), std::make_pair(&b.v, &b.v16)}) {
      pair.second->resize(pair.first->size());
      for (size_t i = 0; i < pair.first->size(); ++i) (*pair.second)[i] = to16(c.dtype, (*pair.first)[i]);
    }
  }
  for (int h = 0; h < c.num_heads; ++h) {
    b.alibi.push_back(0.05f * (h + 1));
    b.sink.push_back(normal(rng));
  }
  return b;
}

// fp64 attention of query (token t, head h), straight from docs/semantics.md.
void reference_row(const Case& c, const Batch& b, int r, int t, int h, double* out) {
  const int q_len = c.q_lens[r], kv_len = c.seq_lens[r], d = c.head_size;
  const int kvh = h / (c.num_heads / c.num_kv_heads);
  const int64_t p = kv_len - q_len + t;
  const float* q = &b.q[(static_cast<size_t>(b.qsl[r] + t) * c.num_heads + h) * d];
  std::vector<double> s(kv_len, -INFINITY);
  double m = c.sink ? b.sink[h] : -INFINITY;
  for (int j = 0; j < kv_len; ++j) {
    if (c.causal && j > p) continue;
    if (c.left >= 0 && j < p - c.left) continue;
    if (c.right >= 0 && j > p + c.right) continue;
    const int blk = b.block_table[r * b.max_blocks + j / c.block_size];
    const float* k = &b.k[((static_cast<size_t>(blk) * c.num_kv_heads + kvh) * c.block_size + j % c.block_size) * d];
    double dot = 0;
    for (int i = 0; i < d; ++i) dot += static_cast<double>(q[i]) * k[i];
    double x = dot * (d == 0 ? 1.0 : 1.0 / std::sqrt(static_cast<double>(d)));
    if (c.softcap > 0) x = c.softcap * std::tanh(x / c.softcap);
    if (c.alibi) x += b.alibi[h] * static_cast<double>(j - p);
    s[j] = x;
    m = std::max(m, x);
  }
  double denom = c.sink ? std::exp(b.sink[h] - m) : 0.0;
  std::vector<double> acc(d, 0.0);
  for (int j = 0; j < kv_len; ++j) {
    if (std::isinf(s[j])) continue;
    const double w = std::exp(s[j] - m);
    denom += w;
    const int blk = b.block_table[r * b.max_blocks + j / c.block_size];
    const float* v = &b.v[((static_cast<size_t>(blk) * c.num_kv_heads + kvh) * c.block_size + j % c.block_size) * d];
    for (int i = 0; i < d; ++i) acc[i] += w * v[i];
  }
  for (int i = 0; i < d; ++i) out[i] = denom > 0 ? acc[i] / denom : 0.0;
}

pa::AttnParams make_params(const Case& c, const Batch& b, void* out) {
  const bool bf16 = is16(c.dtype);
  pa::AttnParams p{};
  p.dtype = c.dtype;
  p.q = bf16 ? static_cast<const void*>(b.q16.data()) : b.q.data();
  p.k_cache = bf16 ? static_cast<const void*>(b.k16.data()) : b.k.data();
  p.v_cache = bf16 ? static_cast<const void*>(b.v16.data()) : b.v.data();
  p.out = out;
  p.q_stride_tok = p.o_stride_tok = static_cast<int64_t>(c.num_heads) * c.head_size;
  p.q_stride_head = p.o_stride_head = c.head_size;
  p.k_stride_tok = p.v_stride_tok = c.head_size;
  p.k_stride_head = p.v_stride_head = static_cast<int64_t>(c.block_size) * c.head_size;
  p.k_stride_block = p.v_stride_block = static_cast<int64_t>(c.num_kv_heads) * p.k_stride_head;
  p.block_table = b.block_table.data();
  p.bt_stride = b.max_blocks;
  p.query_start_loc = b.qsl.data();
  p.seq_lens = b.seq_lens.data();
  p.head_size = c.head_size;
  p.block_size = c.block_size;
  p.num_heads = c.num_heads;
  p.num_kv_heads = c.num_kv_heads;
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_size)));
  p.softcap = c.softcap;
  p.alibi = c.alibi ? b.alibi.data() : nullptr;
  p.sink = c.sink ? b.sink.data() : nullptr;
  p.window_left = c.left;
  p.window_right = c.right;
  p.causal = c.causal;
  return p;
}

// Runs every (request, kv head, query tile) item, optionally split over the keys.
void run_table(const pa::KernelTable& kt, const Case& c, const pa::AttnParams& p) {
  const int group = c.num_heads / c.num_kv_heads;
  const int tile = std::max(1, 16 / group);
  const int rows = tile * group;
  std::vector<float> scratch(pa::attn_scratch_floats(rows, c.head_size, c.block_size));
  std::vector<float> part_out(static_cast<size_t>(c.splits) * rows * c.head_size);
  std::vector<float> part_lse(static_cast<size_t>(c.splits) * rows);
  for (int r = 0; r < static_cast<int>(c.q_lens.size()); ++r)
    for (int kvh = 0; kvh < c.num_kv_heads; ++kvh)
      for (int q0 = 0; q0 < c.q_lens[r]; q0 += tile) {
        pa::WorkItem it{r, kvh, q0, std::min(q0 + tile, c.q_lens[r]), 0, c.seq_lens[r], nullptr, nullptr};
        if (c.splits <= 1) {
          kt.attn_item(p, it, scratch.data());
          continue;
        }
        const int chunk = (c.seq_lens[r] + c.splits - 1) / c.splits;
        for (int s = 0; s < c.splits; ++s) {
          pa::WorkItem part = it;
          part.kv_begin = std::min(s * chunk, c.seq_lens[r]);
          part.kv_end = std::min((s + 1) * chunk, c.seq_lens[r]);
          part.part_out = part_out.data() + static_cast<size_t>(s) * rows * c.head_size;
          part.part_lse = part_lse.data() + static_cast<size_t>(s) * rows;
          kt.attn_item(p, part, scratch.data());
        }
        it.part_out = part_out.data();
        it.part_lse = part_lse.data();
        kt.merge(p, it, c.splits, static_cast<int64_t>(rows) * c.head_size, rows);
      }
}

bool check_case(const pa::KernelTable& kt, const Case& c, std::mt19937& rng) {
  Batch b = make_batch(c, rng);
  const size_t n = static_cast<size_t>(b.num_tokens) * c.num_heads * c.head_size;
  std::vector<float> out32(n, NAN);
  std::vector<uint16_t> out16(n, to16(c.dtype, NAN));
  const bool bf16 = is16(c.dtype);
  run_table(kt, c, make_params(c, b, bf16 ? static_cast<void*>(out16.data()) : out32.data()));
  const double tol = c.dtype == pa::DType::kBF16 ? 1.6e-2 : c.dtype == pa::DType::kF16 ? 2e-3 : 2e-5;
  std::vector<double> want(c.head_size);
  double worst = 0;
  for (int r = 0; r < static_cast<int>(c.q_lens.size()); ++r)
    for (int t = 0; t < c.q_lens[r]; ++t)
      for (int h = 0; h < c.num_heads; ++h) {
        reference_row(c, b, r, t, h, want.data());
        const size_t base = (static_cast<size_t>(b.qsl[r] + t) * c.num_heads + h) * c.head_size;
        for (int i = 0; i < c.head_size; ++i) {
          const double got = bf16 ? from16(c.dtype, out16[base + i]) : out32[base + i];
          const double err = std::fabs(got - want[i]) - tol * std::fabs(want[i]);
          if (!(err <= tol)) {  // also catches NaN
            std::printf("FAIL %s %s: req %d token %d head %d dim %d got %g want %g\n", kt.name,
                        c.name, r, t, h, i, got, want[i]);
            return false;
          }
          worst = std::max(worst, std::fabs(got - want[i]));
        }
      }
  std::printf("ok   %-10s %-28s max abs err %.2e\n", kt.name, c.name, worst);
  return true;
}

// sum_bytes (the stream_read kernel) against a byte loop: lengths on and off every load
// width and its 4-load unroll (16, 32, 64; 64, 128, 256), at every start alignment mod 64.
bool check_sum_bytes(const pa::KernelTable& kt, std::mt19937& rng) {
  std::vector<uint8_t> buf(4096 + 64);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  for (int64_t n : {0, 1, 15, 16, 17, 31, 33, 63, 64, 65, 127, 255, 256, 257, 1000, 4096})
    for (int64_t offset = 0; offset < 64; ++offset) {
      uint64_t want = 0;
      for (int64_t i = 0; i < n; ++i) want += buf[offset + i];
      const uint64_t got = kt.sum_bytes(buf.data() + offset, n);
      if (got != want) {
        std::printf("FAIL %s sum_bytes: %lld bytes at offset %lld: got %llu want %llu\n", kt.name,
                    static_cast<long long>(n), static_cast<long long>(offset),
                    static_cast<unsigned long long>(got), static_cast<unsigned long long>(want));
        return false;
      }
    }
  std::printf("ok   %-10s sum_bytes\n", kt.name);
  return true;
}

std::vector<Case> cases() {
  using D = pa::DType;
  return {
      {"f32_causal_gqa_decode_prefill", D::kF32, 64, 16, 8, 2, {1, 5, 40}, {37, 60, 40}, true, -1, -1, 0.f, false, false, 1},
      {"f32_window_softcap_alibi_sink", D::kF32, 128, 32, 8, 2, {3, 50}, {90, 120}, true, 20, 0, 4.f, true, true, 1},
      {"f32_noncausal_two_sided", D::kF32, 80, 16, 4, 4, {7, 1}, {30, 19}, false, 5, 3, 0.f, false, false, 1},
      {"f32_split_kv_merge", D::kF32, 128, 32, 8, 1, {1, 4}, {700, 333}, true, -1, -1, 0.f, false, true, 4},
      {"bf16_causal_gqa", D::kBF16, 128, 32, 16, 4, {1, 33}, {200, 97}, true, -1, -1, 0.f, false, false, 1},
      {"fp16_window_alibi_sink", D::kF16, 96, 16, 6, 3, {1, 9}, {150, 40}, true, 30, 0, 0.f, true, true, 1},
      {"bf16_everything_split", D::kBF16, 256, 16, 4, 2, {2, 17}, {300, 64}, true, 40, 0, 5.f, true, true, 3},
  };
}

// The table called `name` where this CPU executes it; nullptr where the build has none.
// Names are matched before any table is built: building one runs code compiled for its
// ISA, which an older CPU cannot execute.
const pa::KernelTable* table_named(const std::string& name) {
  for (int i = 0; i < pa::kNumCpuIsa; ++i)
    if (name == pa::cpu_isa_name(i)) return pa::kernel_table_for(static_cast<pa::CpuIsa>(i));
  return nullptr;
}

bool executable(const std::string& name) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (name == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (name == "avx512") return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  if (name == "avx512bf16") return __builtin_cpu_supports("avx512bf16");
#endif
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> wanted(argv + 1, argv + argc);
  if (wanted.empty())
    for (const char* n : {"scalar", "avx2", "avx512", "avx512bf16", "neon"})
      if (executable(n) && table_named(n) != nullptr) wanted.push_back(n);
  std::mt19937 rng(1234);
  for (const auto& name : wanted) {
    if (!executable(name)) {
      std::printf("FAIL this CPU cannot execute the %s kernels\n", name.c_str());
      return 2;
    }
    const pa::KernelTable* kt = table_named(name);
    if (kt == nullptr) {
      std::printf("FAIL no kernel table %s in this build\n", name.c_str());
      return 2;
    }
    for (const Case& c : cases())
      if (!check_case(*kt, c, rng)) return 1;
    if (!check_sum_bytes(*kt, rng)) return 1;
  }
  std::printf("all %zu tables passed\n", wanted.size());
  return 0;
}
