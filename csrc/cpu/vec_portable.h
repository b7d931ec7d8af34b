// 4 x fp32 with GCC/Clang vector extensions: no ISA-specific intrinsics, so it compiles for
// any target (SSE2 on baseline x86-64, Advanced SIMD on Arm). The "scalar" ISA uses it:
// portable code, but not one float at a time. Included inside an anonymous namespace,
// after vec_scalar.h (whose bit-exact conversions it reuses lane by lane).

typedef float PortableF32x4 __attribute__((vector_size(16)));

struct VecPortable : OperatorArith<PortableF32x4> {
  using V = PortableF32x4;
  typedef int32_t VI __attribute__((vector_size(16)));
  typedef uint32_t VU __attribute__((vector_size(16)));
  using M = VI;  // lane mask: -1 (true) or 0
  static constexpr int W = 4;
  static constexpr int kPvRows = 4;  // 4 rows x 2 vectors = 8 accumulators (16 xmm on SSE2)
  static constexpr int kPvVecs = 2;
  static V zero() { return V{0.f, 0.f, 0.f, 0.f}; }
  static V set1(float x) { return V{x, x, x, x}; }
  static V load(const float* p) { V v; std::memcpy(&v, p, sizeof(V)); return v; }
  static void store(float* p, V v) { std::memcpy(p, &v, sizeof(V)); }
  static float hsum(V v) { return (v[0] + v[2]) + (v[1] + v[3]); }
  static float hmax(V v) { return std::max(std::max(v[0], v[1]), std::max(v[2], v[3])); }
  static V reduce_lanes(const V* a) { return V{hsum(a[0]), hsum(a[1]), hsum(a[2]), hsum(a[3])}; }

  // Masks, selects and int32 lanes (online_softmax.h).
  static M lt(V a, V b) { return a < b; }
  static M eq(V a, V b) { return a == b; }
  static V select(M m, V a, V b) { return m ? a : b; }
  static bool any(M m) { return (m[0] | m[1] | m[2] | m[3]) != 0; }
  static VI loadi(const int32_t* p) { VI v; std::memcpy(&v, p, sizeof(VI)); return v; }
  static VI set1i(int32_t x) { return VI{x, x, x, x}; }
  static VI iotai() { return VI{0, 1, 2, 3}; }
  static VI addi(VI a, VI b) { return a + b; }
  static V cvti(VI a) { return __builtin_convertvector(a, V); }
  static M outside(VI lo, VI k, VI hi) { return (lo > k) | (k > hi); }
  static int32_t hmaxi(VI v) { return std::max(std::max(v[0], v[1]), std::max(v[2], v[3])); }
  static int32_t hmini(VI v) { return std::min(std::min(v[0], v[1]), std::min(v[2], v[3])); }

  // Same polynomial as VecAvx512::exp; floor via truncate-and-fix (no rounding intrinsic).
  static V exp(V x) {
    const V lo = set1(-87.33654f), hi = set1(88.3762626647949f);
    const VI tiny = x < lo;
    x = x > hi ? hi : x;
    x = x < lo ? lo : x;
    const V y0 = x * set1(1.44269504088896341f) + set1(0.5f);
    VI n = __builtin_convertvector(y0, VI);  // truncates toward zero
    n = n + (__builtin_convertvector(n, V) > y0);  // true is -1: floor for negatives
    const V nf = __builtin_convertvector(n, V);
    V r = x - nf * set1(0.693359375f);
    r = r - nf * set1(-2.12194440e-4f);
    V y = set1(1.9875691500E-4f);
    y = y * r + set1(1.3981999507E-3f);
    y = y * r + set1(8.3334519073E-3f);
    y = y * r + set1(4.1665795894E-2f);
    y = y * r + set1(1.6666665459E-1f);
    y = y * r + set1(5.0000001201E-1f);
    y = y * (r * r) + (r + set1(1.f));
    const VI e = (n + 127) << 23;
    const V res = y * (V)e;  // same-size vector cast = bit cast
    return tiny ? zero() : res;
  }

  static V cvt_load(const float* p) { return load(p); }
  static V cvt_load(const bf16_t* p) {
    typedef uint16_t VH __attribute__((vector_size(8)));
    VH h;
    std::memcpy(&h, p, sizeof(h));
    const VU u = __builtin_convertvector(h, VU) << 16;  // zero-extend, then bf16 -> fp32 bits
    return (V)u;
  }
  static V cvt_load(const fp16_t* p) {
    return V{fp16_to_float(p[0].bits), fp16_to_float(p[1].bits), fp16_to_float(p[2].bits),
             fp16_to_float(p[3].bits)};
  }
  template <class C>  // fp8: lane by lane through the scalar definition
  static V cvt_load(const C* p) {
    return V{VecScalar::cvt_load(p), VecScalar::cvt_load(p + 1), VecScalar::cvt_load(p + 2),
             VecScalar::cvt_load(p + 3)};
  }
  template <class C>  // one decoded cache row (fp8 caches)
  static void cvt_row(const C* src, float* dst, int D) {
    for (int d = 0; d < D; d += W) store(dst + d, cvt_load(src + d));
  }
  static void cvt_store(float* p, V v) { store(p, v); }
  static void cvt_store(bf16_t* p, V v) {
    for (int i = 0; i < 4; ++i) p[i].bits = float_to_bf16(v[i]);
  }
  static void cvt_store(fp16_t* p, V v) {
    for (int i = 0; i < 4; ++i) p[i].bits = float_to_fp16(v[i]);
  }

  // Byte streaming (stream_read_impl.h): 16 bytes as two u64 words, each word's 8 bytes
  // summed in-register (SWAR): byte pairs into four 16-bit fields (<= 510 each), then one
  // multiply gathers the four fields' total (<= 2040) into bits 48..63.
  typedef uint64_t SB __attribute__((vector_size(16)));
  static constexpr int kStreamBytes = 16;
  static SB stream_zero() { return SB{0, 0}; }
  static SB stream_add(SB acc, const uint8_t* p) {
    SB w;
    std::memcpy(&w, p, sizeof(w));
    const uint64_t low_bytes = 0x00FF00FF00FF00FFull;
    const SB pairs = (w & low_bytes) + ((w >> 8) & low_bytes);
    return acc + ((pairs * 0x0001000100010001ull) >> 48);
  }
  static uint64_t stream_total(SB acc) { return acc[0] + acc[1]; }
};
