// AVX-512 kernels with AVX512-BF16: bf16 q.k uses vdpbf16ps (exact bf16 products, fp32 sums).
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "isa_generated.h"
#include "kernel_api.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
namespace pagedattn {
namespace {
#include "vec_scalar.h"
#include "vec_avx512.h"
#include "attn_kernel_impl.h"

// q stays bf16; 32 products per instruction. head_size is a multiple of 16, so a tail of
// 16 elements is loaded masked (zeros contribute nothing).
template <>
struct Qk<VecAvx512, bf16_t> {
  using QElem = bf16_t;
  static void pack(const bf16_t* src, QElem* dst, int D) { std::memcpy(dst, src, D * sizeof(bf16_t)); }
  static __m512bh ld(const bf16_t* p, int rem) {
    if (rem >= 32) return (__m512bh)_mm512_loadu_si512(p);
    return (__m512bh)_mm512_maskz_loadu_epi16(0xFFFFu, p);
  }
  template <int NR>
  static void dot(const QElem* q, int ldq, const bf16_t* k, int D, float* out) {
    __m512 a[NR];
    for (int i = 0; i < NR; ++i) a[i] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 32) {
      const __m512bh kv = ld(k + d, D - d);
#pragma GCC unroll 4
      for (int i = 0; i < NR; ++i) a[i] = _mm512_dpbf16_ps(a[i], ld(q + i * ldq + d, D - d), kv);
    }
    for (int i = 0; i < NR; ++i) out[i] = _mm512_reduce_add_ps(a[i]);
  }
};
}  // namespace

const KernelTable* kernels_avx512bf16() {
  static const KernelTable table = make_kernel_table<VecAvx512>("avx512bf16");
  return &table;
}

}  // namespace pagedattn
#pragma GCC pop_options
#endif
