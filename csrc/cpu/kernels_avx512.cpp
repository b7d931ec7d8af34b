// AVX-512 (F/BW/VL/DQ) kernels without BF16 dot products; fp32 FMA for every dtype.
#if defined(__x86_64__)
#include <immintrin.h>

#include "kernel_tu_includes.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace pagedattn {
namespace {
#include "vec_scalar.h"
#include "vec_avx512.h"
#include "vec_avx2.h"
#include "attn_kernel_impl.h"
#include "matrix_avx2.h"
#include "matrix_avx512.h"
template <>
struct ProbVec<VecAvx512> : ProbVecAvx512<false> {};
#include "decode_avx512.h"
#include "fp8_bf16_avx512.h"
// bf16 queries on fp8 caches: rows decoded to bf16 by table (6 instructions per 32 values)
// and read by decode_avx512.h's bf16 kernels, instead of decoded to fp32 through F16C.
template <>
struct CacheConvert<VecAvx512, bf16_t, fp8_e4m3_t> : Fp8ToBf16Rows<fp8_e4m3_t, kE4m3Bf16> {};
template <>
struct CacheConvert<VecAvx512, bf16_t, fp8_e5m2_t> : Fp8ToBf16Rows<fp8_e5m2_t, kE5m2Bf16> {};
#include "model_kernels_impl.h"
#include "prefill_lanes_avx512.h"
template <>
struct PrefillItem<VecAvx512, float> : LanesPrefill<float> {};
}  // namespace

const KernelTable* kernels_avx512() {
  static const KernelTable table = make_isa_kernel_table<VecAvx512, VecAvx2>("avx512");
  return &table;
}

}  // namespace pagedattn
#pragma GCC pop_options
#endif
