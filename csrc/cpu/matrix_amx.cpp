// The matrix kernel's bf16 GEMM on AMX tiles, written out: C[M, N] (+)= A[M, K] . B[K, N]
// with B in the VNNI layout of MatrixEngine::gemm_bf16_vnni, for the shapes the matrix
// kernel calls it with (M and N multiples of 16, K of 32). Through torch's brgemm each call
// paid a kernel-cache lookup and, where consecutive calls differ in shape, a tile
// reconfiguration; here every shape shares one tile configuration, loaded once per thread
// and region (matrix_engine.cpp owns that protocol and the fallback to brgemm).
//
// Tiles: 0-3 accumulate a 32 x 32 block of C (2 x 2 tiles of 16 x 16 fp32), 4-5 hold A's
// two row tiles (16 rows x 32 bf16) and 6-7 B's two column tiles (16 pairs of K x 16
// columns), so each K step of 32 issues four tile products on four loads.
#pragma GCC target("amx-tile,amx-bf16,avx512f")

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

#include "matrix_amx.h"

namespace pagedattn {
namespace {

constexpr long kArchReqXcompPerm = 0x1023;  // asm/prctl.h
constexpr long kXfeatureXtiledata = 18;

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

TileConfig make_config() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  return c;
}

const TileConfig kConfig = make_config();

// One block of C: (1 + TwoM) x (1 + TwoN) tiles at C, rows of A from A, columns of B
// from B (already offset to the block). Strides in bytes.
template <bool TwoM, bool TwoN>
inline void block(int64_t K, const bf16_t* A, int64_t lda, const bf16_t* B, int64_t ldb,
                  float* C, int64_t ldc, bool add) {
  const int64_t a_stride = lda * 2, b_stride = ldb * 4, c_stride = ldc * 4;
  const bf16_t* A1 = A + 16 * lda;
  float* C1 = C + 16 * ldc;
  if (add) {
    _tile_loadd(0, C, c_stride);
    if constexpr (TwoN) _tile_loadd(1, C + 16, c_stride);
    if constexpr (TwoM) _tile_loadd(2, C1, c_stride);
    if constexpr (TwoM && TwoN) _tile_loadd(3, C1 + 16, c_stride);
  } else {
    _tile_zero(0);
    if constexpr (TwoN) _tile_zero(1);
    if constexpr (TwoM) _tile_zero(2);
    if constexpr (TwoM && TwoN) _tile_zero(3);
  }
  for (int64_t k = 0; k < K; k += 32) {
    const bf16_t* b = B + k * ldb;  // pair row k / 2, 2 * ldb elements each
    _tile_loadd(4, A + k, a_stride);
    _tile_loadd(6, b, b_stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (TwoN) {
      _tile_loadd(7, b + 32, b_stride);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (TwoM) {
      _tile_loadd(5, A1 + k, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (TwoN) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, C, c_stride);
  if constexpr (TwoN) _tile_stored(1, C + 16, c_stride);
  if constexpr (TwoM) _tile_stored(2, C1, c_stride);
  if constexpr (TwoM && TwoN) _tile_stored(3, C1 + 16, c_stride);
}

}  // namespace

bool amx_tiles_permitted() {
  if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
  // Linux hands out the tile state only to processes that ask for it (oneDNN asks too;
  // asking twice is harmless).
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

bool amx_gemm_shape_fits(int64_t M, int64_t N, int64_t K) {
  return M > 0 && N > 0 && K > 0 && M % 16 == 0 && N % 16 == 0 && K % 32 == 0;
}

void amx_configure_tiles() { _tile_loadconfig(&kConfig); }

void amx_release_tiles() { _tile_release(); }

void amx_gemm_bf16_vnni(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc,
                        bool add, const bf16_t* A, const bf16_t* B, float* C) {
  // The tile instructions' asm names no memory: keep the caller's stores before them
  // and the tile stores before the caller's loads.
  asm volatile("" ::: "memory");
  for (int64_t n = 0; n < N; n += 32) {
    const bool two_n = n + 32 <= N;
    const bf16_t* b = B + 2 * n;
    for (int64_t m = 0; m < M; m += 32) {
      const bool two_m = m + 32 <= M;
      const bf16_t* a = A + m * lda;
      float* c = C + m * ldc + n;
      if (two_m && two_n) block<true, true>(K, a, lda, b, ldb, c, ldc, add);
      else if (two_m) block<true, false>(K, a, lda, b, ldb, c, ldc, add);
      else if (two_n) block<false, true>(K, a, lda, b, ldb, c, ldc, add);
      else block<false, false>(K, a, lda, b, ldb, c, ldc, add);
    }
  }
  asm volatile("" ::: "memory");
}

}  // namespace pagedattn
