// The matrix engine of the kernels (kernel_api.h MatrixEngine): oneDNN's brgemm
// microkernels as torch exports them (at::native::cpublas). oneDNN JIT-compiles a kernel
// per shape and thread on first use (AMX tiles where the CPU has them, else AVX-512 or
// AVX2 code), so the kernels keep their set of GEMM shapes small.
#include <ATen/native/CPUBlas.h>

#include <atomic>
#include <cstring>
#include <mutex>

#include "binding_utils.h"

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

}  // namespace

namespace {
std::atomic<bool> g_bf16_reference{false};
}

const MatrixEngine* matrix_engine() {
  static std::once_flag once;
  static bool usable = false, bf16 = false;
  static MatrixEngine engine{&gemm_f32}, with_reference{&gemm_f32};
  std::call_once(once, [] {
    usable = probe_f32();
    bf16 = usable && probe_bf16_vnni();
    engine.gemm_bf16_vnni = bf16 ? &gemm_bf16_vnni : nullptr;
    with_reference.gemm_bf16_vnni = &gemm_bf16_vnni_reference;
  });
  if (!usable) return nullptr;
  return g_bf16_reference.load() ? &with_reference : &engine;
}

void matrix_engine_release() {
  const MatrixEngine* e = matrix_engine();
  at::native::cpublas::brgemm_release(e != nullptr && e->gemm_bf16_vnni == &gemm_bf16_vnni);
}

static bool matrix_engine_available_op() { return matrix_engine() != nullptr; }

// Whether bf16 items run their GEMMs in bf16 (oneDNN's VNNI microkernel, or the reference
// loops while tests ask for them), rather than widened to fp32.
static bool matrix_engine_bf16_op() {
  const MatrixEngine* e = matrix_engine();
  return e != nullptr && e->gemm_bf16_vnni != nullptr;
}

// Tests only: the bf16 path on the reference loops, so its packing runs on any CPU.
static void matrix_engine_use_bf16_reference_op(bool on) { g_bf16_reference = on; }

}  // namespace pagedattn

TORCH_LIBRARY_FRAGMENT(pagedattn, m) {
  m.def("matrix_engine_available() -> bool", &pagedattn::matrix_engine_available_op);
  m.def("matrix_engine_bf16() -> bool", &pagedattn::matrix_engine_bf16_op);
  m.def("matrix_engine_use_bf16_reference(bool on) -> ()",
        &pagedattn::matrix_engine_use_bf16_reference_op);
}
