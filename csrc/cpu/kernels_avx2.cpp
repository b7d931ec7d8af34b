// AVX2 + FMA + F16C kernels, compiled for that target only in this TU (chosen at run time).
#if defined(__x86_64__)
#include <immintrin.h>

#include "kernel_tu_includes.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace pagedattn {
namespace {
#include "vec_scalar.h"
#include "vec_avx2.h"
#include "attn_kernel_impl.h"
#include "matrix_avx2.h"
#include "decode_avx2.h"
#include "model_kernels_impl.h"
#include "prefill_lanes_avx2.h"
// Every query dtype (float, bf16, fp16): the AVX2 lanes kernel converts K/V chunks to fp32.
template <class T>
struct PrefillItem<VecAvx2, T> : LanesPrefillAvx2<T> {};
}  // namespace

const KernelTable* kernels_avx2() {
  static const KernelTable table = make_isa_kernel_table<VecAvx2>("avx2");
  return &table;
}

}  // namespace pagedattn
#pragma GCC pop_options
#endif
