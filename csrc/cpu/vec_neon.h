// 4 x fp32 NEON (AArch64) vector ops. Included inside an anonymous namespace of the NEON TU.

struct VecNeon {
  using V = float32x4_t;
  using VI = int32x4_t;
  using M = uint32x4_t;  // lane mask: all-ones lanes
  static constexpr int W = 4;
  static constexpr int kPvRows = 4;  // 4 rows x 4 vectors = 16 accumulators of 32 q-regs
  static constexpr int kPvVecs = 4;
  static V zero() { return vdupq_n_f32(0.f); }
  static V set1(float x) { return vdupq_n_f32(x); }
  static V load(const float* p) { return vld1q_f32(p); }
  static void store(float* p, V v) { vst1q_f32(p, v); }
  static V fma(V a, V b, V c) { return vfmaq_f32(c, a, b); }
  static V add(V a, V b) { return vaddq_f32(a, b); }
  static V sub(V a, V b) { return vsubq_f32(a, b); }
  static V mul(V a, V b) { return vmulq_f32(a, b); }
  static V div(V a, V b) { return vdivq_f32(a, b); }
  static V max(V a, V b) { return vmaxq_f32(a, b); }
  static float hsum(V v) { return vaddvq_f32(v); }
  static float hmax(V v) { return vmaxvq_f32(v); }

  // Masks, selects and int32 lanes (online_softmax.h).
  static M lt(V a, V b) { return vcltq_f32(a, b); }
  static M eq(V a, V b) { return vceqq_f32(a, b); }
  static V select(M m, V a, V b) { return vbslq_f32(m, a, b); }  // m ? a : b
  static bool any(M m) { return vmaxvq_u32(m) != 0; }
  static VI loadi(const int32_t* p) { return vld1q_s32(p); }
  static VI set1i(int32_t x) { return vdupq_n_s32(x); }
  static VI iotai() {
    static const int32_t kIota[4] = {0, 1, 2, 3};
    return vld1q_s32(kIota);
  }
  static VI addi(VI a, VI b) { return vaddq_s32(a, b); }
  static V cvti(VI a) { return vcvtq_f32_s32(a); }
  static M outside(VI lo, VI k, VI hi) { return vorrq_u32(vcgtq_s32(lo, k), vcgtq_s32(k, hi)); }
  static int32_t hmaxi(VI v) { return vmaxvq_s32(v); }
  static int32_t hmini(VI v) { return vminvq_s32(v); }
  // Lane i of the result = sum of a[i]'s lanes.
  static V reduce_lanes(const V* a) {
    return vpaddq_f32(vpaddq_f32(a[0], a[1]), vpaddq_f32(a[2], a[3]));
  }

  // Same polynomial as VecAvx512::exp.
  static V exp(V x) {
    const V lo = vdupq_n_f32(-87.33654f);
    const uint32x4_t tiny = vcltq_f32(x, lo);
    x = vminq_f32(x, vdupq_n_f32(88.3762626647949f));
    x = vmaxq_f32(x, lo);
    V n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
    V r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
    r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
    V y = vdupq_n_f32(1.9875691500E-4f);
    y = vfmaq_f32(vdupq_n_f32(1.3981999507E-3f), y, r);
    y = vfmaq_f32(vdupq_n_f32(8.3334519073E-3f), y, r);
    y = vfmaq_f32(vdupq_n_f32(4.1665795894E-2f), y, r);
    y = vfmaq_f32(vdupq_n_f32(1.6666665459E-1f), y, r);
    y = vfmaq_f32(vdupq_n_f32(5.0000001201E-1f), y, r);
    y = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.f)), y, vmulq_f32(r, r));
    int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    V res = vmulq_f32(y, vreinterpretq_f32_s32(e));
    return vbslq_f32(tiny, vdupq_n_f32(0.f), res);
  }

  static V cvt_load(const float* p) { return vld1q_f32(p); }
  static V cvt_load(const bf16_t* p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
  }
  static V cvt_load(const fp16_t* p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p))));
  }
  template <class C>  // fp8: lane by lane through the scalar definition
  static V cvt_load(const C* p) {
    const float x[4] = {VecScalar::cvt_load(p), VecScalar::cvt_load(p + 1),
                        VecScalar::cvt_load(p + 2), VecScalar::cvt_load(p + 3)};
    return vld1q_f32(x);
  }
  template <class C>  // one decoded cache row (fp8 caches)
  static void cvt_row(const C* src, float* dst, int D) {
    for (int d = 0; d < D; d += 4) vst1q_f32(dst + d, cvt_load(src + d));
  }
  static void cvt_store(float* p, V v) { vst1q_f32(p, v); }
  static void cvt_store(bf16_t* p, V v) {  // round to nearest even
    uint32x4_t u = vreinterpretq_u32_f32(v);
    uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    u = vaddq_u32(u, vaddq_u32(lsb, vdupq_n_u32(0x7fff)));
    vst1_u16(reinterpret_cast<uint16_t*>(p), vshrn_n_u32(u, 16));
  }
  static void cvt_store(fp16_t* p, V v) {
    vst1_u16(reinterpret_cast<uint16_t*>(p), vreinterpret_u16_f16(vcvt_f16_f32(v)));
  }

  // Byte streaming (stream_read_impl.h): 16-byte loads, widened pairwise u8 -> u16 -> u32
  // and accumulated into two u64 lanes.
  using SB = uint64x2_t;
  static constexpr int kStreamBytes = 16;
  static SB stream_zero() { return vdupq_n_u64(0); }
  static SB stream_add(SB acc, const uint8_t* p) {
    return vpadalq_u32(acc, vpaddlq_u16(vpaddlq_u8(vld1q_u8(p))));
  }
  static uint64_t stream_total(SB acc) { return vaddvq_u64(acc); }
};
