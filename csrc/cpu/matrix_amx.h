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
// The decode configuration (amx_decode_scores): the score tiles as narrow as the rows.
void amx_configure_decode_tiles();
// MatrixEngine::gemm_bf16_vnni's contract, for shapes that fit, tiles configured.
void amx_gemm_bf16_vnni(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc,
                        bool add, const bf16_t* A, const bf16_t* B, float* C);

// MatrixEngine::decode_scores_bf16's contract, the decode configuration loaded.
void amx_decode_scores(const bf16_t* qt, int R, const bf16_t* k, int64_t kst, int groups, int D,
                       float* S, int lds);

// Linear layers on the tiles (packed_linear_amx): rows [m_begin, m_end) of
// out = x . W^T + bias for W's panels [p_begin, p_end), in pack_linear_weight_dpbf16's
// layout (LinearDpParams), whose 16-column panels are B tiles as they lie: 16 of a panel's
// 64-byte k-pair rows are one tile. rows: the caller's buffer of
// round_up(m_end - m_begin, 16) x amx_linear_row_stride(k_pairs) bf16 for x's rows in
// A-tile form. Tiles configured (amx_configure_tiles) by the caller.
// matrix_engine.cpp keeps the thread's tile state, shared with brgemm: whether this
// process may use the tiles, and the calling thread's tiles in our configuration (brgemm
// told to forget its own) until release_own_tiles().
bool own_tiles_permitted();
void acquire_own_tiles();
void release_own_tiles();
// With gated: a gated MLP's gate/up projection (p.n = 2d columns, gate panels then up
// panels) whose output is act(gate) * up, [m, d] at p.out: p_begin, p_end count gate
// panels, each run beside its up panel, and the accumulators go through act_mul.
struct AmxGatedEpilogue {
  GatedActivation act;
  void (*act_mul)(GatedActivation act, const float* gate, const float* up, int64_t stride,
                  int64_t rows, int64_t n, void* out, int64_t out_stride, DType out_dtype);
  int64_t up_panels;  // d / 16: the first up panel
};
int64_t amx_linear_row_stride(int64_t k_pairs);
void amx_linear_panels(const LinearDpParams& p, int64_t m_begin, int64_t m_end,
                       int64_t p_begin, int64_t p_end, bf16_t* rows,
                       const AmxGatedEpilogue* gated = nullptr);

}  // namespace pagedattn
