// AVX-512 (F/BW/VL/DQ) kernels without BF16 dot products; fp32 FMA for every dtype.
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "isa_generated.h"
#include "kernel_api.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace pagedattn {
namespace {
#include "vec_scalar.h"
#include "vec_avx512.h"
#include "vec_avx2.h"
#include "attn_kernel_impl.h"
#include "linear_kernel_impl.h"
#include "layer_kernel_impl.h"
#include "stream_read_impl.h"
#include "prefill_lanes_avx512.h"
template <>
struct PrefillItem<VecAvx512, float> : LanesPrefill<float> {};
}  // namespace

const KernelTable* kernels_avx512() {
  static const KernelTable table =
      with_stream_kernels<VecAvx512>(
          with_model_kernels<VecAvx512>(make_kernel_table<VecAvx512, VecAvx2>("avx512")));
  return &table;
}

}  // namespace pagedattn
#pragma GCC pop_options
#endif
