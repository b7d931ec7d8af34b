// FP8 KV-cache storage formats (OCP FP8) and their scalar conversions, the definition every
// vectorised conversion is tested against:
//   E4M3 "fn": 4 exponent bits (bias 7), 3 mantissa bits, no infinities, NaN = S.1111.111,
//              largest finite 448, smallest subnormal 2^-9.
//   E5M2:      5 exponent bits (bias 15), 2 mantissa bits, IEEE-like inf (S.11111.00) and
//              NaN (S.11111.xx), largest finite 57344, smallest subnormal 2^-16.
// Every fp8 value is exactly an fp32 (and a bf16) value, so decoding is exact.
// Included inside an anonymous namespace, after <cmath>, <cstdint>, <cstring>, <limits>, so
// each TU (whatever its target ISA) gets its own copies.

struct Fp8E4m3 {
  static constexpr int kMan = 3, kBias = 7;
  static constexpr float kMax = 448.f;
  static constexpr uint8_t kNaN = 0x7F;
  static constexpr bool is_nan(uint32_t mag) { return mag == 0x7Fu; }
  static constexpr bool is_inf(uint32_t) { return false; }
};
struct Fp8E5m2 {
  static constexpr int kMan = 2, kBias = 15;
  static constexpr float kMax = 57344.f;
  static constexpr uint8_t kNaN = 0x7E;
  static constexpr bool is_nan(uint32_t mag) { return mag > 0x7Cu; }
  static constexpr bool is_inf(uint32_t mag) { return mag == 0x7Cu; }
};

template <class F>
inline float fp8_decode(uint8_t b) {
  const uint32_t mag = b & 0x7Fu;
  float v;
  if (F::is_nan(mag)) {
    v = std::numeric_limits<float>::quiet_NaN();
  } else if (F::is_inf(mag)) {
    v = std::numeric_limits<float>::infinity();
  } else {
    const int e = static_cast<int>(mag >> F::kMan);
    const uint32_t m = mag & ((1u << F::kMan) - 1u);
    v = e == 0 ? std::ldexp(static_cast<float>(m), 1 - F::kBias - F::kMan)
               : std::ldexp(static_cast<float>((1u << F::kMan) | m), e - F::kBias - F::kMan);
  }
  return (b & 0x80u) ? -v : v;
}

// x (already divided by the scale) -> fp8: saturates to +-kMax (infinities too), rounds to
// nearest even, NaN -> NaN (sign kept).
template <class F>
inline uint8_t fp8_encode(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return sign | F::kNaN;
  float a;
  std::memcpy(&a, &u, 4);
  if (a > F::kMax) a = F::kMax;
  if (a < std::ldexp(1.f, 1 - F::kBias)) {  // subnormal range: a multiple of the grid step
    const float q = std::nearbyint(a * std::ldexp(1.f, F::kBias - 1 + F::kMan));  // even ties
    return sign | static_cast<uint8_t>(q);  // q == 2^kMan is the smallest normal's code
  }
  std::memcpy(&u, &a, 4);
  constexpr int shift = 23 - F::kMan;
  u += ((1u << (shift - 1)) - 1u) + ((u >> shift) & 1u);  // round the dropped bits, ties even
  return sign | static_cast<uint8_t>((u >> shift) - ((127u - F::kBias) << F::kMan));
}
