// The matrix kernel's bf16 GEMM on AMX tiles (matrix_amx.cpp), for the matrix engine
// (matrix_engine.cpp), which decides when it runs and keeps the thread's tile state.
#pragma once

#include <cstdint>

#include "kernel_api.h"

namespace pagedattn {

// Whether this CPU has AMX-BF16 and the OS lets this process use the tiles.
bool amx_tiles_permitted();
// Whether amx_gemm_bf16_vnni takes this shape (M, N multiples of 16, K of 32).
bool amx_gemm_shape_fits(int64_t M, int64_t N, int64_t K);
// Loads the one tile configuration every shape uses; amx_release_tiles frees the tiles.
void amx_configure_tiles();
void amx_release_tiles();
// MatrixEngine::gemm_bf16_vnni's contract, for shapes that fit, tiles configured.
void amx_gemm_bf16_vnni(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc,
                        bool add, const bf16_t* A, const bf16_t* B, float* C);

}  // namespace pagedattn
