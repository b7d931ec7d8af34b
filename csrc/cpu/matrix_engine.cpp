// The matrix engine of the kernels (kernel_api.h MatrixEngine): oneDNN's brgemm
// microkernels as torch exports them (at::native::cpublas). oneDNN JIT-compiles a kernel
// per shape and thread on first use (AMX tiles where the CPU has them, else AVX-512 or
// AVX2 code), so the kernels keep their set of GEMM shapes small.
#include <ATen/native/CPUBlas.h>

#include <mutex>

#include "binding_utils.h"

namespace pagedattn {
namespace {

void gemm_f32(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add,
              const float* A, const float* B, float* C) {
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add, A, B, C, /*is_vnni=*/false);
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

const MatrixEngine* matrix_engine() {
  static const MatrixEngine engine{&gemm_f32};
  static std::once_flag once;
  static bool usable = false;
  std::call_once(once, [] { usable = probe_f32(); });
  return usable ? &engine : nullptr;
}

void matrix_engine_release() { at::native::cpublas::brgemm_release(false); }

static bool matrix_engine_available_op() { return matrix_engine() != nullptr; }

}  // namespace pagedattn

TORCH_LIBRARY_FRAGMENT(pagedattn, m) {
  m.def("matrix_engine_available() -> bool", &pagedattn::matrix_engine_available_op);
}
