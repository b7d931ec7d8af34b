// AArch64 NEON kernels (Advanced SIMD is mandatory on AArch64: no target pragma needed).
#if defined(__aarch64__)
#include <arm_neon.h>

#include "kernel_tu_includes.h"

namespace pagedattn {
namespace {
#include "vec_scalar.h"
#include "vec_neon.h"
#include "attn_kernel_impl.h"
#include "model_kernels_impl.h"
}  // namespace

const KernelTable* kernels_neon() {
  static const KernelTable table = make_isa_kernel_table<VecNeon>("neon");
  return &table;
}

}  // namespace pagedattn
#endif
