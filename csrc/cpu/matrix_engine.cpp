// The matrix engine of the kernels (kernel_api.h MatrixEngine): oneDNN's brgemm
// microkernels as torch exports them (at::native::cpublas). oneDNN JIT-compiles a kernel
// per shape and thread on first use (AMX tiles where the CPU has them, else AVX-512 or
// AVX2 code), so the kernels keep their set of GEMM shapes small. On AMX, the bf16 GEMMs
// whose shapes fit run on our own tile loop instead (matrix_amx.cpp), which shares the
// thread's tile state with brgemm by the protocol below (gemm_bf16_vnni_tiles).
#include <ATen/native/CPUBlas.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "binding_utils.h"
#include "matrix_amx.h"

namespace pagedattn {
namespace {

void gemm_f32(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add,
              const float* A, const float* B, float* C) {
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add, A, B, C, /*is_vnni=*/false);
}

void gemm_bf16_vnni(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc,
                    bool add, const bf16_t* A, const bf16_t* B, float* C) {
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add,
                              reinterpret_cast<const at::BFloat16*>(A),
                              reinterpret_cast<const at::BFloat16*>(B), C, /*is_vnni=*/true);
}

float bf16_value(bf16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// The same product in plain loops (exact bf16 products, fp32 sums): what the bf16 path's
// packing is tested against on CPUs where oneDNN has no bf16 microkernel.
void gemm_bf16_vnni_reference(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb,
                              int64_t ldc, bool add, const bf16_t* A, const bf16_t* B,
                              float* C) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float acc = add ? C[m * ldc + n] : 0.f;
      for (int64_t k = 0; k < K; ++k)
        acc += bf16_value(A[m * lda + k]) * bf16_value(B[(k / 2) * 2 * ldb + 2 * n + k % 2]);
      C[m * ldc + n] = acc;
    }
}

bool probe_bf16_vnni() {
  try {
    bf16_t a[16 * 16], b[16 * 16];
    float c[16 * 16];
    for (int i = 0; i < 16 * 16; ++i) a[i].bits = b[i].bits = 0x3f80;  // 1.0
    gemm_bf16_vnni(16, 16, 16, 16, 16, 16, false, a, b, c);
    at::native::cpublas::brgemm_release(true);
    return c[0] == 16.f && c[16 * 16 - 1] == 16.f;
  } catch (const std::exception&) {  // oneDNN: "could not generate a kernel"
    return false;
  }
}

// Whether torch's brgemm runs here: a build without oneDNN's ukernels (or a CPU oneDNN
// has no code for) throws on the first call, which must not happen inside a kernel.
bool probe_f32() {
  try {
    float a[16 * 16], b[16 * 16], c[16 * 16];
    for (int i = 0; i < 16 * 16; ++i) a[i] = b[i] = 1.f;
    gemm_f32(16, 16, 16, 16, 16, 16, false, a, b, c);
    at::native::cpublas::brgemm_release(false);
    return c[0] == 16.f && c[16 * 16 - 1] == 16.f;
  } catch (const std::exception&) {
    return false;
  }
}

// Our tile loop and brgemm each configure the thread's AMX tiles for themselves, and
// brgemm skips configuring when it believes its own configuration is still loaded. So
// before our loop configures, brgemm_release() makes it forget (and frees the tiles); a
// brgemm call afterwards (a shape our loop does not take) makes ours reconfigure; and
// matrix_engine_release(), at the end of a worker's region, frees the tiles for both.
// Which of our two tile configurations the thread has loaded (none: brgemm's, or free).
enum class OwnTiles { kNone, kGemm, kDecode };
thread_local OwnTiles t_own_tiles = OwnTiles::kNone;
bool g_own_tiles_usable = false;  // set once, by matrix_engine()
bool g_bf16_brgemm = false;       // brgemm has a bf16 microkernel here (same)
std::atomic<bool> g_use_own_tiles{true};

void load_own_tiles(OwnTiles want) {
  if (t_own_tiles == want) return;
  if (t_own_tiles == OwnTiles::kNone) at::native::cpublas::brgemm_release(g_bf16_brgemm);
  if (want == OwnTiles::kGemm) amx_configure_tiles();
  else amx_configure_decode_tiles();
  t_own_tiles = want;
}

void gemm_bf16_vnni_tiles(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb,
                          int64_t ldc, bool add, const bf16_t* A, const bf16_t* B, float* C) {
  if (!amx_gemm_shape_fits(M, N, K)) {
    t_own_tiles = OwnTiles::kNone;
    gemm_bf16_vnni(M, N, K, lda, ldb, ldc, add, A, B, C);
    return;
  }
  load_own_tiles(OwnTiles::kGemm);
  amx_gemm_bf16_vnni(M, N, K, lda, ldb, ldc, add, A, B, C);
}

void decode_scores_tiles(const bf16_t* qt, int R, const bf16_t* k, int64_t kst, int groups,
                         int D, float* S, int lds) {
  load_own_tiles(OwnTiles::kDecode);
  amx_decode_scores(qt, R, k, kst, groups, D, S, lds);
}

// Frees the calling thread's tiles, whichever of the two configured them last.
void release_thread_tiles() {
  if (t_own_tiles != OwnTiles::kNone) {
    t_own_tiles = OwnTiles::kNone;
    amx_release_tiles();
  }
  // brgemm's bf16 kernels hold the tiles (on AMX); only where it has them does its
  // release touch tile state.
  at::native::cpublas::brgemm_release(g_bf16_brgemm);
}

// Whether our tile loop computes what brgemm does, on shapes of both kinds the kernel
// calls (a mismatch leaves brgemm in charge, never a wrong result).
bool probe_own_tiles() {
  if (!amx_tiles_permitted()) return false;
  constexpr int M = 32, N = 48, K = 64;
  std::vector<bf16_t> a(M * K), b(K * N);
  std::vector<float> ours(M * N, 1.f), theirs(M * N, 1.f);
  for (int i = 0; i < M * K; ++i) a[i].bits = static_cast<uint16_t>(0x3f80 + (i * 7) % 64);
  for (int i = 0; i < K * N; ++i) b[i].bits = static_cast<uint16_t>(0x3f00 + (i * 5) % 96);
  gemm_bf16_vnni(M, N, K, K, N, N, true, a.data(), b.data(), theirs.data());
  gemm_bf16_vnni_tiles(M, N, K, K, N, N, true, a.data(), b.data(), ours.data());
  release_thread_tiles();
  for (int i = 0; i < M * N; ++i)
    if (std::abs(ours[i] - theirs[i]) > 1e-3f * std::abs(theirs[i]) + 1e-3f) return false;
  return true;
}

}  // namespace

namespace {
std::atomic<bool> g_bf16_reference{false};

// The cost probe (benchmarks/profile_prefill.py): while on, calls go through timing
// wrappers of the engine they would have used, and the op adds each worker's busy time,
// so the time outside the GEMMs is busy - gemm on any CPU, without perf; the kernels time
// their MatrixPhase spans. Per-thread sums, folded into the totals when a worker ends its
// region (matrix_engine_release).
constexpr int kPhases = static_cast<int>(MatrixPhase::kCount);
std::atomic<bool> g_profile{false};
std::atomic<int64_t> g_gemm_ns{0}, g_gemm_calls{0}, g_busy_ns{0};
std::atomic<int64_t> g_phase_ns[kPhases] = {};
thread_local int64_t t_gemm_ns = 0, t_gemm_calls = 0;
thread_local int64_t t_phase_ns[kPhases] = {};
thread_local bool t_phase_timed = false;
const MatrixEngine* g_profiled_base = nullptr;  // set before the profiled engine is returned

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void add_phase_ns(int phase, int64_t ns) {
  t_phase_ns[phase] += ns;
  t_phase_timed = true;
}

void profiled_gemm_f32(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc,
                       bool add, const float* A, const float* B, float* C) {
  const int64_t t0 = now_ns();
  g_profiled_base->gemm_f32(M, N, K, lda, ldb, ldc, add, A, B, C);
  t_gemm_ns += now_ns() - t0;
  ++t_gemm_calls;
}

void profiled_gemm_bf16_vnni(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb,
                             int64_t ldc, bool add, const bf16_t* A, const bf16_t* B, float* C) {
  const int64_t t0 = now_ns();
  g_profiled_base->gemm_bf16_vnni(M, N, K, lda, ldb, ldc, add, A, B, C);
  t_gemm_ns += now_ns() - t0;
  ++t_gemm_calls;
}
}  // namespace

const MatrixEngine* matrix_engine() {
  static std::once_flag once;
  static bool usable = false, bf16 = false;
  static MatrixEngine engine{&gemm_f32}, with_reference{&gemm_f32};
  static MatrixEngine with_brgemm{&gemm_f32};  // own tiles switched off
  // Profiled: the GEMMs timed, decode scores (not a GEMM) as the base engine runs them.
  static MatrixEngine profiled{&profiled_gemm_f32}, profiled_reference{&profiled_gemm_f32};
  static MatrixEngine profiled_brgemm{&profiled_gemm_f32};
  std::call_once(once, [] {
    usable = probe_f32();
    bf16 = usable && probe_bf16_vnni();
    g_bf16_brgemm = bf16;
    g_own_tiles_usable = bf16 && probe_own_tiles();
    with_brgemm.gemm_bf16_vnni = bf16 ? &gemm_bf16_vnni : nullptr;
    engine.gemm_bf16_vnni = g_own_tiles_usable ? &gemm_bf16_vnni_tiles
                                               : with_brgemm.gemm_bf16_vnni;
    engine.decode_scores_bf16 = g_own_tiles_usable ? &decode_scores_tiles : nullptr;
    with_reference.gemm_bf16_vnni = &gemm_bf16_vnni_reference;
    profiled.gemm_bf16_vnni = bf16 ? &profiled_gemm_bf16_vnni : nullptr;
    profiled.decode_scores_bf16 = engine.decode_scores_bf16;
    profiled_brgemm.gemm_bf16_vnni = profiled.gemm_bf16_vnni;
    profiled_reference.gemm_bf16_vnni = &profiled_gemm_bf16_vnni;
    for (MatrixEngine* e : {&profiled, &profiled_reference, &profiled_brgemm}) {
      e->clock_ns = &now_ns;
      e->add_phase_ns = &add_phase_ns;
    }
  });
  if (!usable) return nullptr;
  const bool reference = g_bf16_reference.load();
  const MatrixEngine* plain = g_use_own_tiles.load() ? &engine : &with_brgemm;
  if (g_profile.load(std::memory_order_relaxed)) {
    g_profiled_base = reference ? &with_reference : plain;
    if (reference) return &profiled_reference;
    return plain == &engine ? &profiled : &profiled_brgemm;
  }
  return reference ? &with_reference : plain;
}

bool matrix_engine_profiling() { return g_profile.load(std::memory_order_relaxed); }

void matrix_engine_add_busy(int64_t ns) { g_busy_ns += ns; }

int64_t matrix_engine_clock_ns() { return now_ns(); }

void matrix_engine_release() {
  if (t_gemm_calls != 0) {
    g_gemm_ns += t_gemm_ns;
    g_gemm_calls += t_gemm_calls;
    t_gemm_ns = t_gemm_calls = 0;
  }
  if (t_phase_timed) {
    for (int i = 0; i < kPhases; ++i) {
      g_phase_ns[i] += t_phase_ns[i];
      t_phase_ns[i] = 0;
    }
    t_phase_timed = false;
  }
  release_thread_tiles();
}

bool own_tiles_permitted() {
  static const bool permitted = [] {
    matrix_engine();  // brgemm's bf16 probe first: g_bf16_brgemm
    return amx_tiles_permitted();
  }();
  return permitted;
}

void acquire_own_tiles() { load_own_tiles(OwnTiles::kGemm); }

void release_own_tiles() { release_thread_tiles(); }

static bool matrix_engine_available_op() { return matrix_engine() != nullptr; }

// Whether bf16 items run their GEMMs in bf16 (oneDNN's VNNI microkernel, or the reference
// loops while tests ask for them), rather than widened to fp32.
static bool matrix_engine_bf16_op() {
  const MatrixEngine* e = matrix_engine();
  return e != nullptr && e->gemm_bf16_vnni != nullptr;
}

// Tests only: the bf16 path on the reference loops, so its packing runs on any CPU.
static void matrix_engine_use_bf16_reference_op(bool on) { g_bf16_reference = on; }

// The bf16 GEMMs' microkernel: "tiles" (our AMX tile loop, where it runs), "brgemm"
// (oneDNN's, where a bf16 one runs) or "none"; and a switch between the first two, for
// tests and side-by-side timings (on by default).
static std::string matrix_engine_bf16_microkernel_op() {
  const MatrixEngine* e = matrix_engine();
  if (e == nullptr || e->gemm_bf16_vnni == nullptr) return "none";
  return g_own_tiles_usable && g_use_own_tiles.load() ? "tiles" : "brgemm";
}
static void matrix_engine_use_own_tiles_op(bool on) { g_use_own_tiles = on; }

// Tests only: C (+)= A . B through the current engine's bf16 GEMM, B [K, N] given plain
// and packed here into the VNNI layout; C is fp32 [M, N], updated in place.
static void matrix_engine_gemm_bf16_op(const at::Tensor& a, const at::Tensor& b, at::Tensor& c,
                                       bool add) {
  const char* op = "matrix_engine_gemm_bf16";
  const MatrixEngine* e = matrix_engine();
  TORCH_CHECK_NOT_IMPLEMENTED(e != nullptr && e->gemm_bf16_vnni != nullptr, op,
                              ": no bf16 GEMM microkernel runs on this CPU");
  check_cpu(a, "a");
  check_cpu(b, "b");
  check_cpu(c, "c");
  TORCH_CHECK_TYPE(a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16 &&
                       c.scalar_type() == at::kFloat,
                   op, ": a and b must be bfloat16 and c float32, got ", a.scalar_type(), ", ",
                   b.scalar_type(), ", ", c.scalar_type());
  TORCH_CHECK_VALUE(a.dim() == 2 && b.dim() == 2 && c.dim() == 2 && a.size(1) == b.size(0) &&
                        c.size(0) == a.size(0) && c.size(1) == b.size(1) && a.size(1) % 2 == 0,
                    op, ": shapes must be a [M, K], b [K, N], c [M, N] with K even, got ",
                    a.sizes(), ", ", b.sizes(), ", ", c.sizes());
  TORCH_CHECK_VALUE(c.is_contiguous(), op, ": c must be contiguous");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  const at::Tensor ac = a.contiguous();
  // [K, N] -> [K / 2, N, 2]: B[k][n] at (k / 2) * 2N + 2n + k % 2
  const at::Tensor packed = b.reshape({K / 2, 2, N}).transpose(1, 2).contiguous();
  e->gemm_bf16_vnni(M, N, K, K, N, N, add, reinterpret_cast<const bf16_t*>(ac.data_ptr()),
                    reinterpret_cast<const bf16_t*>(packed.data_ptr()), c.data_ptr<float>());
  matrix_engine_release();
}

// Tests only: decode scores through the current engine's tiles (decode_scores_bf16):
// q [R, D] bf16 (R <= kDecodeTileRows) against keys [n, D] bf16 (n a multiple of 16; its
// rows may lie further apart than D, as a cache's do) -> [R, n] fp32.
static at::Tensor matrix_engine_decode_scores_op(const at::Tensor& q, const at::Tensor& keys) {
  const char* op = "matrix_engine_decode_scores";
  const MatrixEngine* e = matrix_engine();
  TORCH_CHECK_NOT_IMPLEMENTED(e != nullptr && e->decode_scores_bf16 != nullptr, op,
                              ": decode scores run on our AMX tiles, which this CPU or OS "
                              "does not offer (or the tiles are switched off)");
  check_cpu(q, "q");
  check_cpu(keys, "keys");
  TORCH_CHECK_TYPE(q.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16, op,
                   ": q and keys must be bfloat16, got ", q.scalar_type(), " and ",
                   keys.scalar_type());
  TORCH_CHECK_VALUE(q.dim() == 2 && keys.dim() == 2 && q.size(1) == keys.size(1), op,
                    ": q must be [R, D] and keys [n, D], got ", q.sizes(), " and ", keys.sizes());
  const int64_t R = q.size(0), D = q.size(1), n = keys.size(0);
  TORCH_CHECK_VALUE(R >= 1 && R <= kDecodeTileRows, op, ": R (", R, ") must be in [1, ",
                    kDecodeTileRows, "]");
  TORCH_CHECK_VALUE(D % 32 == 0 && D > 0 && D <= 512, op, ": D (", D,
                    ") must be a positive multiple of 32, at most 512");
  TORCH_CHECK_VALUE(n % 16 == 0 && n > 0, op, ": the key count (", n,
                    ") must be a positive multiple of 16");
  TORCH_CHECK_VALUE(keys.stride(1) == 1, op, ": keys' rows must be contiguous");
  const at::Tensor qc = q.contiguous();
  std::vector<uint32_t> qt(static_cast<size_t>(D / 2 * decode_tile_cols(static_cast<int>(R))));
  pack_decode_queries(reinterpret_cast<const bf16_t*>(qc.data_ptr()), static_cast<int>(R),
                      static_cast<int>(D), qt.data());
  const int lds = static_cast<int>(n) + 16;
  at::Tensor S = at::empty({R, lds}, q.options().dtype(at::kFloat));
  e->decode_scores_bf16(reinterpret_cast<const bf16_t*>(qt.data()), static_cast<int>(R),
                        reinterpret_cast<const bf16_t*>(keys.data_ptr()), keys.stride(0),
                        static_cast<int>(n / 16), static_cast<int>(D), S.data_ptr<float>(), lds);
  matrix_engine_release();
  return S.narrow(1, 0, n).contiguous();
}

// Tests only: the matrix kernel's packing routines of the current ISA (KernelTable::
// pack_rows) on `rows` [nrows, ncols] (int32 words for transpose32, int16 for
// interleave16); rows whose `present` entry is false read as zeros. Returns the packed
// words: [ncols, nrows] int32 (transpose32) or [nrows / 2, ncols] int32 (interleave16).
static at::Tensor matrix_pack_rows_op(const at::Tensor& rows, const at::Tensor& present,
                                      int64_t kind) {
  const char* op = "matrix_pack_rows";
  check_cpu(rows, "rows");
  TORCH_CHECK_VALUE(kind == 0 || kind == 1, op, ": kind must be 0 (transpose32) or 1 ",
                    "(interleave16), got ", kind);
  const bool transpose = kind == 0;
  TORCH_CHECK_TYPE(rows.scalar_type() == (transpose ? at::kInt : at::kShort), op, ": rows must be ",
                   transpose ? "int32" : "int16", " for this kind, got ", rows.scalar_type());
  TORCH_CHECK_VALUE(rows.dim() == 2 && rows.is_contiguous(), op,
                    ": rows must be a contiguous 2-D tensor, got shape ", rows.sizes());
  const int64_t nrows = rows.size(0), ncols = rows.size(1);
  TORCH_CHECK_VALUE(nrows > 0 && nrows % 16 == 0 && nrows <= 256 && ncols > 0 && ncols <= 4096,
                    op, ": rows must be [n, c] with n a multiple of 16 up to 256 and 0 < c <= ",
                    "4096, got ", rows.sizes());
  check_index_tensor(present, "present", at::kBool, 1);
  TORCH_CHECK_VALUE(present.numel() == nrows, op, ": present must have ", nrows,
                    " entries, got ", present.numel());
  const at::Tensor pc = present.contiguous();
  std::vector<const void*> ptrs(nrows);
  const int64_t elem = rows.element_size();
  for (int64_t r = 0; r < nrows; ++r)
    ptrs[r] = pc.data_ptr<bool>()[r]
                  ? static_cast<const char*>(rows.data_ptr()) + r * ncols * elem
                  : nullptr;
  at::Tensor out = transpose ? at::empty({ncols, nrows}, at::kInt)
                             : at::empty({nrows / 2, ncols}, at::kInt);
  current_kernels()->pack_rows(transpose ? PackKind::kTranspose32 : PackKind::kInterleave16,
                               ptrs.data(), static_cast<int>(nrows), static_cast<int>(ncols),
                               out.data_ptr());
  return out;
}

// The cost probe: on/off (switching clears the totals), and the totals since: [busy ns
// of the matrix-kernel calls' workers, ns inside the GEMMs, GEMM calls, then ns packing
// the calls' shared tiles, and ns of the queries, softmax, tile packs and finish phases
// (MatrixPhase; all parts of busy outside the GEMMs)].
static void matrix_engine_profile_op(bool on) {
  g_busy_ns = 0;
  g_gemm_ns = 0;
  g_gemm_calls = 0;
  for (auto& ns : g_phase_ns) ns = 0;
  g_profile = on;
}
static std::vector<int64_t> matrix_engine_profile_totals_op() {
  const auto phase = [](MatrixPhase ph) { return g_phase_ns[static_cast<int>(ph)].load(); };
  return {g_busy_ns.load(), g_gemm_ns.load(), g_gemm_calls.load(),
          phase(MatrixPhase::kCallPack), phase(MatrixPhase::kQueries),
          phase(MatrixPhase::kSoftmax), phase(MatrixPhase::kTilePack),
          phase(MatrixPhase::kFinish)};
}

}  // namespace pagedattn

TORCH_LIBRARY_FRAGMENT(pagedattn, m) {
  m.def("matrix_engine_available() -> bool", &pagedattn::matrix_engine_available_op);
  m.def("matrix_engine_bf16() -> bool", &pagedattn::matrix_engine_bf16_op);
  m.def("matrix_engine_use_bf16_reference(bool on) -> ()",
        &pagedattn::matrix_engine_use_bf16_reference_op);
  m.def("matrix_engine_bf16_microkernel() -> str", &pagedattn::matrix_engine_bf16_microkernel_op);
  m.def("matrix_engine_use_own_tiles(bool on) -> ()", &pagedattn::matrix_engine_use_own_tiles_op);
  m.def("matrix_engine_gemm_bf16(Tensor a, Tensor b, Tensor(a!) c, bool add) -> ()",
        &pagedattn::matrix_engine_gemm_bf16_op);
  m.def("matrix_engine_decode_scores(Tensor q, Tensor keys) -> Tensor",
        &pagedattn::matrix_engine_decode_scores_op);
  m.def("matrix_engine_profile(bool on) -> ()", &pagedattn::matrix_engine_profile_op);
  m.def("matrix_pack_rows(Tensor rows, Tensor present, int kind) -> Tensor",
        &pagedattn::matrix_pack_rows_op);
  m.def("matrix_engine_profile_totals() -> int[]",
        &pagedattn::matrix_engine_profile_totals_op);
}
