// Portable "vector" of one float: the scalar instantiation of the kernel template, plus the
// bit-exact 16-bit float conversions every ISA falls back to. Included inside an anonymous
// namespace of its TU (after <cmath>, <cstring>), so each TU gets its own copies (no ODR mix).

// Prefetch one cache line into L2. Inline asm because GCC deletes loops made only of
// __builtin_prefetch (C++ -ffinite-loops treats them as side-effect free).
inline void prefetch_l2(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#elif defined(__aarch64__)
  asm volatile("prfm pldl2keep, %0" : : "Q"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

#include "fp8.h"

inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

// Round to nearest even; NaN stays NaN (quiet bit forced).
inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {
    const float v = std::ldexp(static_cast<float>(mant), -24);  // zero or subnormal
    return sign ? -v : v;
  }
  if (exp == 31) return bits_to_float(sign | 0x7f800000u | (mant << 13));
  return bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t float_to_fp16(float f) {
  uint32_t u = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u >= 0x7f800000u) return sign | 0x7c00u | (u > 0x7f800000u ? 0x200u : 0u);
  if (u >= 0x477ff000u) return sign | 0x7c00u;  // rounds past 65504
  if (u < 0x38800000u) {  // half subnormal (or zero): scale so one ulp is 1, round even
    const float v = std::nearbyint(bits_to_float(u) * 16777216.0f);
    return sign | static_cast<uint16_t>(v);
  }
  uint32_t m = u - 0x38000000u;  // rebias exponent 127 -> 15
  m += 0xfffu + ((m >> 13) & 1u);
  return sign | static_cast<uint16_t>(m >> 13);
}

// Arithmetic written with C++ operators: the same code for a float and for a GCC vector
// extension type (VecPortable), whose operators act lane by lane.
template <class V>
struct OperatorArith {
  static V fma(V a, V b, V c) { return a * b + c; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V div(V a, V b) { return a / b; }
  static V max(V a, V b) { return a > b ? a : b; }
};

struct VecScalar : OperatorArith<float> {
  using V = float;
  using VI = int32_t;
  using M = bool;
  static constexpr int W = 1;
  static constexpr int kPvRows = 4;  // register block of the P.V micro-kernel
  static constexpr int kPvVecs = 4;
  static V zero() { return 0.f; }
  static V set1(float x) { return x; }
  static V load(const float* p) { return *p; }
  static void store(float* p, V v) { *p = v; }
  static float hsum(V v) { return v; }
  static float hmax(V v) { return v; }
  static V reduce_lanes(const V* a) { return a[0]; }
  static M lt(V a, V b) { return a < b; }
  static M eq(V a, V b) { return a == b; }
  static V select(M m, V a, V b) { return m ? a : b; }
  static bool any(M m) { return m; }
  static VI loadi(const int32_t* p) { return *p; }
  static VI set1i(int32_t x) { return x; }
  static VI iotai() { return 0; }
  static VI addi(VI a, VI b) { return a + b; }
  static V cvti(VI a) { return static_cast<float>(a); }
  static M outside(VI lo, VI k, VI hi) { return lo > k || k > hi; }
  static int32_t hmaxi(VI v) { return v; }
  static int32_t hmini(VI v) { return v; }
  static V exp(V x) { return std::exp(x); }
  static V cvt_load(const float* p) { return *p; }
  static V cvt_load(const bf16_t* p) { return bf16_to_float(p->bits); }
  static V cvt_load(const fp16_t* p) { return fp16_to_float(p->bits); }
  static V cvt_load(const fp8_e4m3_t* p) { return fp8_decode<Fp8E4m3>(p->bits); }
  static V cvt_load(const fp8_e5m2_t* p) { return fp8_decode<Fp8E5m2>(p->bits); }
  template <class C>  // one decoded cache row (fp8 caches)
  static void cvt_row(const C* src, float* dst, int D) {
    for (int d = 0; d < D; ++d) dst[d] = cvt_load(src + d);
  }
  static void cvt_store(float* p, V v) { *p = v; }
  static void cvt_store(bf16_t* p, V v) { p->bits = float_to_bf16(v); }
  static void cvt_store(fp16_t* p, V v) { p->bits = float_to_fp16(v); }
};
