// AArch64 NEON kernels (Advanced SIMD is mandatory on AArch64: no target pragma needed).
#if defined(__aarch64__)
#include <arm_neon.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "isa_generated.h"
#include "kernel_api.h"

namespace pagedattn {
namespace {
#include "vec_scalar.h"
#include "vec_neon.h"
#include "attn_kernel_impl.h"
#include "linear_kernel_impl.h"
#include "layer_kernel_impl.h"
#include "stream_read_impl.h"
}  // namespace

const KernelTable* kernels_neon() {
  static const KernelTable table =
      with_stream_kernels<VecNeon>(
          with_model_kernels<VecNeon>(make_kernel_table<VecNeon>("neon")));
  return &table;
}

}  // namespace pagedattn
#endif
