// The matrix kernel's operand layouts (kernel_api.h MatrixPack), written by two routines:
//   transpose32:  dst[c][n] = rows[n][c] for 32-bit words: K^T from key rows (a bf16 row's
//                 word c is its dimension pair (2c, 2c + 1), which makes K^T VNNI; an fp32
//                 row's word c is dimension c)
//   interleave16: dst[j][c] = (rows[2j][c], rows[2j + 1][c]) for 16-bit words: bf16 V
//                 with its keys in pairs (VNNI)
// A null row reads as zeros (keys past the request's visible range). nrows is a multiple
// of 16. These are the portable versions (ISAs whose TU has no specialization, which never
// run the bf16 microkernel: tests drive them through the reference GEMM); AVX-512 TUs
// specialize TilePack with register transposes (tile_pack_avx512.h).
// Included by attn_kernel_impl.h inside each ISA TU's anonymous namespace.

template <class VO>
struct TilePack {
  static void transpose32(const uint32_t* const* rows, int nrows, int ncols, uint32_t* dst) {
    for (int n = 0; n < nrows; ++n) {
      const uint32_t* src = rows[n];
      for (int c = 0; c < ncols; ++c) dst[static_cast<int64_t>(c) * nrows + n] = src ? src[c] : 0u;
    }
  }
  static void interleave16(const uint16_t* const* rows, int nrows, int ncols, uint32_t* dst) {
    for (int j = 0; j < nrows / 2; ++j) {
      const uint16_t *a = rows[2 * j], *b = rows[2 * j + 1];
      for (int c = 0; c < ncols; ++c)
        dst[static_cast<int64_t>(j) * ncols + c] =
            (a ? a[c] : 0u) | static_cast<uint32_t>(b ? b[c] : 0u) << 16;
    }
  }
  // Whether n 16-bit (bf16) or 32-bit (fp32) values hold a NaN or inf: exponent all ones.
  static bool nonfinite_bf16(const uint16_t* x, int64_t n) {
    bool bad = false;
    for (int64_t i = 0; i < n; ++i) bad |= (x[i] & 0x7f80u) == 0x7f80u;
    return bad;
  }
  static bool nonfinite_f32(const uint32_t* x, int64_t n) {
    bool bad = false;
    for (int64_t i = 0; i < n; ++i) bad |= (x[i] & 0x7f800000u) == 0x7f800000u;
    return bad;
  }
};
