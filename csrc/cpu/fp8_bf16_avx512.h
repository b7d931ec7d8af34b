// fp8 (E4M3, E5M2) -> bf16 with AVX-512BW only (vpermt2w, no BF16 instruction), shared by
// the AVX-512 and AVX512-BF16 TUs: included inside their anonymous namespace, after
// attn_kernel_impl.h (CacheConvert), under their target pragma.

// fp8 -> bf16 by table: every fp8 value is a bf16 value, so a 128-entry table of the
// magnitudes' bf16 bits (compile-time, from the scalar decode rule) and the sign bit convert
// exactly -- subnormals, zero and NaN included -- in 6 instructions per 32 values: two
// vpermt2w look up the 64-entry halves (index bits 0-5), bit 6 picks one, a ternlog ORs the
// sign in. bf16 bits of 2^e * (1 + m / 2^M) for a magnitude byte (F: Fp8E4m3 / Fp8E5m2).
template <class F>
constexpr uint16_t fp8_magnitude_bf16_bits(uint32_t mag) {
  if (F::is_nan(mag)) return 0x7FC0;
  if (F::is_inf(mag)) return 0x7F80;
  const int e = static_cast<int>(mag >> F::kMan);
  uint32_t m = mag & ((1u << F::kMan) - 1u);
  if (e == 0 && m == 0) return 0;
  int exp2 = e - F::kBias;  // value = 2^exp2 * (1 + m / 2^kMan) when normal
  if (e == 0) {             // subnormal m * 2^(1 - bias - kMan): normalise m
    exp2 = 1 - F::kBias;
    while (!(m & (1u << F::kMan))) {
      m <<= 1;
      --exp2;
    }
    m &= (1u << F::kMan) - 1u;
  }
  return static_cast<uint16_t>(((exp2 + 127) << 7) | (m << (7 - F::kMan)));
}
struct Bf16Table {
  alignas(64) uint16_t bits[128];
};
template <class F>
constexpr Bf16Table make_bf16_table() {
  Bf16Table t{};
  for (uint32_t mag = 0; mag < 128; ++mag) t.bits[mag] = fp8_magnitude_bf16_bits<F>(mag);
  return t;
}
// constexpr: constant-initialised data, no load-time code compiled for this TU's ISA.
constexpr Bf16Table kE4m3Bf16 = make_bf16_table<Fp8E4m3>();
constexpr Bf16Table kE5m2Bf16 = make_bf16_table<Fp8E5m2>();

// x: the fp8 bytes sign-extended to 16 bits (bit 15 = sign, bits 0-6 = magnitude).
inline __m512i fp8_to_bf16(__m512i x, const Bf16Table& t) {
  const __m512i lo = _mm512_permutex2var_epi16(_mm512_load_si512(t.bits), x,
                                               _mm512_load_si512(t.bits + 32));
  const __m512i hi = _mm512_permutex2var_epi16(_mm512_load_si512(t.bits + 64), x,
                                               _mm512_load_si512(t.bits + 96));
  const __m512i mag = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(x, _mm512_set1_epi16(0x40)), lo, hi);
  return _mm512_ternarylogic_epi32(mag, x, _mm512_set1_epi16(static_cast<short>(0x8000)), 0xF8);
}
// bf16 queries on fp8 caches: each step's rows are decoded to bf16 once (CacheConvert,
// attn_kernel_impl.h), then the TU's bf16-cache kernels run on them (AVX512-BF16: the
// vdpbf16ps kernels; AVX-512: decode_avx512.h's).
template <class C, const Bf16Table& kTable>
struct Fp8ToBf16Rows {
  using E = bf16_t;
  static constexpr bool kActive = true;
  static void rows(const C* src, int64_t sst, bf16_t* dst, int n, int D) {
    for (int r = 0; r < n; ++r) {
      const auto* s = reinterpret_cast<const uint8_t*>(src + r * sst);
      auto* d = reinterpret_cast<uint16_t*>(dst + static_cast<int64_t>(r) * D);
      int c = 0;
      for (; c + 32 <= D; c += 32)
        _mm512_storeu_si512(d + c, fp8_to_bf16(_mm512_cvtepi8_epi16(_mm256_loadu_si256(
                                                   reinterpret_cast<const __m256i*>(s + c))), kTable));
      if (c < D)  // 16 left (head sizes are multiples of 16 in this kernel)
        _mm512_mask_storeu_epi16(d + c, 0xFFFFu, fp8_to_bf16(_mm512_cvtepi8_epi16(
                                                     _mm256_maskz_loadu_epi8(0xFFFFu, s + c)), kTable));
    }
  }
};
