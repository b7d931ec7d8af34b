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
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
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

// Decode (amx_decode_scores): scores come out transposed, keys in rows, one column per query
// row, so the tiles are only as wide as the rows. Tiles 0-1 hold two groups' scores at 4
// columns and 2-3 at 8, 4-5 the two groups' key rows (A: 16 keys x 32 bf16), 6 and 7 the
// query rows at 4 and 8 columns (B: 16 dim pairs x N).
TileConfig make_decode_config() {
  TileConfig c;
  const uint16_t colsb[8] = {16, 16, 32, 32, 64, 64, 16, 32};
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = colsb[t];
    c.rows[t] = 16;
  }
  return c;
}

const TileConfig kDecodeConfig = make_decode_config();

// Rows r < R of S^T [16 keys, N] (fp32, contiguous) -> S[r * lds + 0..16).
template <int N>
inline void transpose_scores(const float* st, int R, float* S, int lds) {
  if constexpr (N == 4) {
    // z[j]: keys 4j..4j+3, 4 columns each; row r: element 4i + r for key i.
    const __m512 z0 = _mm512_load_ps(st), z1 = _mm512_load_ps(st + 16);
    const __m512 z2 = _mm512_load_ps(st + 32), z3 = _mm512_load_ps(st + 48);
    const __m512i base = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int r = 0; r < R; ++r) {
      const __m512i idx = _mm512_add_epi32(base, _mm512_set1_epi32(r));
      const __m512 lo = _mm512_permutex2var_ps(z0, idx, z1);  // keys 0-7 in lanes 0-7
      const __m512 hi = _mm512_permutex2var_ps(z2, idx, z3);  // keys 8-15
      _mm512_storeu_ps(S + r * lds, _mm512_shuffle_f32x4(lo, hi, 0x44));
    }
  } else {
    // z[j]: keys 2j, 2j+1, 8 columns each; row r: element 8i + r for key i.
    __m512 z[8];
    for (int j = 0; j < 8; ++j) z[j] = _mm512_load_ps(st + 16 * j);
    const __m512i base = _mm512_setr_epi32(0, 8, 16, 24, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i join = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int r = 0; r < R; ++r) {
      const __m512i idx = _mm512_add_epi32(base, _mm512_set1_epi32(r));
      __m512 q[4];
      for (int j = 0; j < 4; ++j) q[j] = _mm512_permutex2var_ps(z[2 * j], idx, z[2 * j + 1]);
      const __m512 lo = _mm512_permutex2var_ps(q[0], join, q[1]);
      const __m512 hi = _mm512_permutex2var_ps(q[2], join, q[3]);
      _mm512_storeu_ps(S + r * lds, _mm512_shuffle_f32x4(lo, hi, 0x44));
    }
  }
}

// S^T = K . Q^T, two groups of 16 keys at a time: K's rows are A tiles as the cache holds
// them (no packing), the query rows one B tile per 32 dims. The tile intrinsics take their
// tile numbers as literals, hence one macro body per width.
#define PAGEDATTN_DECODE_GROUPS(C0, C1, B)                     \
  do {                                                         \
    _tile_zero(C0);                                            \
    if (two) _tile_zero(C1);                                   \
    for (int c = 0; c < D / 32; ++c) {                         \
      _tile_loadd(B, qt + 2 * 16 * N * c, 4 * N);              \
      _tile_loadd(4, k0 + 32 * c, kbytes);                     \
      _tile_dpbf16ps(C0, 4, B);                                \
      if (two) {                                               \
        _tile_loadd(5, k0 + 16 * kst + 32 * c, kbytes);        \
        _tile_dpbf16ps(C1, 5, B);                              \
      }                                                        \
    }                                                          \
    _tile_stored(C0, st[0], 4 * N);                            \
    if (two) _tile_stored(C1, st[1], 4 * N);                   \
  } while (0)

template <int N>
void decode_scores(const bf16_t* qt, int R, const bf16_t* k, int64_t kst, int groups, int D,
                   float* S, int lds) {
  alignas(64) float st[2][16 * N];
  const int64_t kbytes = kst * static_cast<int64_t>(sizeof(bf16_t));
  asm volatile("" ::: "memory");
  for (int g = 0; g < groups; g += 2) {
    const bool two = g + 1 < groups;
    const bf16_t* k0 = k + int64_t{16} * g * kst;
    if constexpr (N == 4) PAGEDATTN_DECODE_GROUPS(0, 1, 6);
    else PAGEDATTN_DECODE_GROUPS(2, 3, 7);
    asm volatile("" ::: "memory");
    transpose_scores<N>(st[0], R, S + 16 * g, lds);
    if (two) transpose_scores<N>(st[1], R, S + 16 * (g + 1), lds);
  }
}
#undef PAGEDATTN_DECODE_GROUPS

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

// --- linear layers: out = x . W^T + bias, W in pack_linear_weight_dpbf16's layout

__mmask16 first16(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF)
                 : static_cast<__mmask16>((1u << std::max<int64_t>(n, 0)) - 1u);
}
__mmask32 first32(int64_t n) {
  return n >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << std::max<int64_t>(n, 0)) - 1u);
}

// One row block (16 or 32 rows: TwoM) times one or two panels (TwoN) over every K step,
// into the 32 x 32 fp32 buffer C. The full steps read their B tiles where they lie; the
// last, partial one (k_pairs not a multiple of 16) reads the zero-padded copies in tail.
// The weight's tiles come from L3 or memory once per row chunk: the first row block of a
// panel pair prefetches them this many K steps (4 KiB a panel) ahead; the chunk's other
// row blocks find them in L1.
constexpr int64_t kPrefetchSteps = 4;

// A row tile: 16 rows of bf16 features, `stride` bytes apart.
struct RowTile {
  const bf16_t* rows;
  int64_t stride;
};

template <bool TwoM, bool TwoN>
inline void linear_block(int64_t full_steps, bool has_tail, RowTile a0, RowTile a1,
                         const bf16_t* B0, const bf16_t* B1, const bf16_t* tail, float* C,
                         bool prefetch) {
  _tile_zero(0);
  if constexpr (TwoN) _tile_zero(1);
  if constexpr (TwoM) _tile_zero(2);
  if constexpr (TwoM && TwoN) _tile_zero(3);
  const auto step = [&](int64_t s, const bf16_t* b0, const bf16_t* b1) {
    // x's rows stream past (read once per panel pair, kept out of L1) while the pair's
    // weight tiles stay in L1 for every row block of the chunk.
    _tile_stream_loadd(4, a0.rows + s * 32, a0.stride);
    _tile_loadd(6, b0, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (TwoN) {
      _tile_loadd(7, b1, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (TwoM) {
      _tile_stream_loadd(5, a1.rows + s * 32, a1.stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (TwoN) _tile_dpbf16ps(3, 5, 7);
    }
  };
  // The panels' step s + kPrefetchSteps into L1 (first row block of a chunk only).
  const auto prefetch_panels = [&](int64_t s) {
    const char* f0 = reinterpret_cast<const char*>(B0 + (s + kPrefetchSteps) * 512);
    const char* f1 = reinterpret_cast<const char*>(B1 + (s + kPrefetchSteps) * 512);
    for (int l = 0; l < 1024; l += 64) {
      _mm_prefetch(f0 + l, _MM_HINT_T0);
      if constexpr (TwoN) _mm_prefetch(f1 + l, _MM_HINT_T0);
    }
  };
  if constexpr (TwoM && TwoN) {
    // Software-pipelined: a tile register has no renaming, so each load of the next K
    // step is issued right after the last product that reads the register it overwrites,
    // and runs under the step's remaining products (6-10% faster at 2048 rows than loading
    // at the top of each step; docs/performance.md).
    const int64_t steps = full_steps + (has_tail ? 1 : 0);
    const auto b0_of = [&](int64_t s) { return s < full_steps ? B0 + s * 512 : tail; };
    const auto b1_of = [&](int64_t s) { return s < full_steps ? B1 + s * 512 : tail + 512; };
    _tile_stream_loadd(4, a0.rows, a0.stride);
    _tile_loadd(6, b0_of(0), 64);
    _tile_loadd(7, b1_of(0), 64);
    _tile_stream_loadd(5, a1.rows, a1.stride);
    for (int64_t s = 0; s < steps; ++s) {
      if (prefetch && s < full_steps) prefetch_panels(s);
      const bool more = s + 1 < steps;
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (more) _tile_stream_loadd(4, a0.rows + (s + 1) * 32, a0.stride);
      _tile_dpbf16ps(2, 5, 6);
      if (more) _tile_loadd(6, b0_of(s + 1), 64);
      _tile_dpbf16ps(3, 5, 7);
      if (more) {
        _tile_stream_loadd(5, a1.rows + (s + 1) * 32, a1.stride);
        _tile_loadd(7, b1_of(s + 1), 64);
      }
    }
    _tile_stored(0, C, 128);
    _tile_stored(1, C + 16, 128);
    _tile_stored(2, C + 512, 128);
    _tile_stored(3, C + 528, 128);
    return;
  }
  for (int64_t s = 0; s < full_steps; ++s) {
    if (prefetch) prefetch_panels(s);
    step(s, B0 + s * 512, B1 + s * 512);
  }
  if (has_tail) step(full_steps, tail, tail + 512);
  _tile_stored(0, C, 128);
  if constexpr (TwoN) _tile_stored(1, C + 16, 128);
  if constexpr (TwoM) _tile_stored(2, C + 512, 128);
  if constexpr (TwoM && TwoN) _tile_stored(3, C + 528, 128);
}

// Rows [m_begin, m_end) of x as A tiles in bf16 (fp32 rounded to nearest even), ld
// features a row, padded with zero features and with zero rows to a multiple of 16.
void load_rows(const LinearDpParams& p, int64_t m_begin, int64_t m_end, int64_t ld,
               bf16_t* dst) {
  const int64_t rows = m_end - m_begin, padded = (rows + 15) / 16 * 16;
  for (int64_t r = 0; r < padded; ++r) {
    bf16_t* d = dst + r * ld;
    if (r >= rows) {
      std::memset(static_cast<void*>(d), 0, ld * sizeof(bf16_t));
      continue;
    }
    if (p.x_dtype == DType::kBF16) {
      const bf16_t* src = static_cast<const bf16_t*>(p.x) + (m_begin + r) * p.x_stride;
      for (int64_t c = 0; c < ld; c += 32)
        _mm512_storeu_si512(d + c, _mm512_maskz_loadu_epi16(first32(p.k - c), src + c));
    } else {
      const float* src = static_cast<const float*>(p.x) + (m_begin + r) * p.x_stride;
      for (int64_t c = 0; c < ld; c += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + c),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(first16(p.k - c), src + c)));
    }
  }
}

// C's rows [0, rows) and its first `panels` 16-column halves, plus the bias, to out at
// (m, first panel's column).
void store_block(const LinearDpParams& p, const float* C, int64_t m, int64_t rows,
                 int64_t panel, int panels) {
  for (int t = 0; t < panels; ++t) {
    const int64_t col = (panel + t) * kLinearPanel;
    const __mmask16 mask = first16(p.n - col);
    const __m512 b = p.bias != nullptr ? _mm512_maskz_loadu_ps(mask, p.bias + col)
                                       : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 y = _mm512_add_ps(_mm512_loadu_ps(C + r * 32 + t * 16), b);
      if (p.out_dtype == DType::kBF16)
        _mm256_mask_storeu_epi16(static_cast<bf16_t*>(p.out) + (m + r) * p.out_stride + col, mask,
                                 (__m256i)_mm512_cvtneps_pbh(y));
      else
        _mm512_mask_storeu_ps(static_cast<float*>(p.out) + (m + r) * p.out_stride + col, mask, y);
    }
  }
}

// The gated form's epilogue: the block's gate and up halves (C's two tiles) plus their
// biases, then act(gate) * up to out at (m, the gate panel's column).
void store_gated(const LinearDpParams& p, const AmxGatedEpilogue& g, float* C, int64_t m,
                 int64_t rows, int64_t panel) {
  if (p.bias != nullptr) {
    const __m512 bg = _mm512_loadu_ps(p.bias + panel * kLinearPanel);
    const __m512 bu = _mm512_loadu_ps(p.bias + (panel + g.up_panels) * kLinearPanel);
    for (int64_t r = 0; r < rows; ++r) {
      _mm512_storeu_ps(C + r * 32, _mm512_add_ps(_mm512_loadu_ps(C + r * 32), bg));
      _mm512_storeu_ps(C + r * 32 + 16, _mm512_add_ps(_mm512_loadu_ps(C + r * 32 + 16), bu));
    }
  }
  const int64_t elem = p.out_dtype == DType::kBF16 ? 2 : 4;
  char* out = static_cast<char*>(p.out) + (m * p.out_stride + panel * kLinearPanel) * elem;
  g.act_mul(g.act, C, C + 16, 32, rows, kLinearPanel, out, p.out_stride, p.out_dtype);
}

}  // namespace

int64_t amx_linear_row_stride(int64_t k_pairs) { return (k_pairs + 15) / 16 * 32; }

void amx_linear_panels(const LinearDpParams& p, int64_t m_begin, int64_t m_end,
                       int64_t p_begin, int64_t p_end, bf16_t* rows,
                       const AmxGatedEpilogue* gated) {
  const int64_t ld = amx_linear_row_stride(p.k_pairs);
  const int64_t full_steps = p.k_pairs / 16, tail_pairs = p.k_pairs % 16;
  const int64_t panel_elems = p.k_pairs * 32;
  alignas(64) bf16_t tail[2 * 512];
  alignas(64) float C[32 * 32];
  // bf16 rows whose features fill whole K steps are read where they lie, but for a last
  // partial tile of 16 rows; other rows are copied (rounded, zero-padded) into rows.
  const bool in_place = p.x_dtype == DType::kBF16 && p.k % 32 == 0;
  const int64_t copied_from = in_place ? m_begin + (m_end - m_begin) / 16 * 16 : m_begin;
  if (copied_from < m_end) load_rows(p, copied_from, m_end, ld, rows);
  const auto row_tile = [&](int64_t m) -> RowTile {
    if (m < copied_from)
      return {static_cast<const bf16_t*>(p.x) + m * p.x_stride, p.x_stride * 2};
    return {rows + (m - copied_from) * ld, ld * 2};
  };
  asm volatile("" ::: "memory");
  // Plain: panels pn and pn + 1 side by side. Gated: gate panel pn beside its up panel.
  for (int64_t pn = p_begin; pn < p_end; pn += gated ? 1 : 2) {
    const bool two_n = gated != nullptr || pn + 1 < p_end;
    const bf16_t* B0 = p.weight + pn * panel_elems;
    const bf16_t* B1 = gated ? p.weight + (pn + gated->up_panels) * panel_elems
                             : (two_n ? B0 + panel_elems : B0);
    if (tail_pairs) {
      std::memset(static_cast<void*>(tail), 0, sizeof(tail));
      std::memcpy(static_cast<void*>(tail), B0 + full_steps * 512, tail_pairs * 64);
      if (two_n) std::memcpy(static_cast<void*>(tail + 512), B1 + full_steps * 512, tail_pairs * 64);
    }
    for (int64_t m = m_begin; m < m_end; m += 32) {
      const int64_t rows_here = std::min<int64_t>(32, m_end - m);
      const bool two_m = rows_here > 16, first = m == m_begin;
      const RowTile a0 = row_tile(m), a1 = two_m ? row_tile(m + 16) : a0;
      asm volatile("" ::: "memory");
      if (two_m && two_n) linear_block<true, true>(full_steps, tail_pairs, a0, a1, B0, B1, tail, C, first);
      else if (two_m) linear_block<true, false>(full_steps, tail_pairs, a0, a1, B0, B1, tail, C, first);
      else if (two_n) linear_block<false, true>(full_steps, tail_pairs, a0, a1, B0, B1, tail, C, first);
      else linear_block<false, false>(full_steps, tail_pairs, a0, a1, B0, B1, tail, C, first);
      asm volatile("" ::: "memory");
      if (gated) store_gated(p, *gated, C, m, rows_here, pn);
      else store_block(p, C, m, rows_here, pn, two_n ? 2 : 1);
    }
  }
}

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

void amx_configure_decode_tiles() { _tile_loadconfig(&kDecodeConfig); }

void amx_decode_scores(const bf16_t* qt, int R, const bf16_t* k, int64_t kst, int groups, int D,
                       float* S, int lds) {
  if (decode_tile_cols(R) == 4) decode_scores<4>(qt, R, k, kst, groups, D, S, lds);
  else decode_scores<8>(qt, R, k, kst, groups, D, S, lds);
}

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
