// Portable kernels (no target pragma, no intrinsics): the fallback on any CPU. 4-wide via
// compiler vector extensions (VecPortable); VecScalar supplies the bit-exact conversions.
#include "kernel_tu_includes.h"

namespace pagedattn {
namespace {
#include "vec_scalar.h"
#include "vec_portable.h"
#include "attn_kernel_impl.h"
#include "model_kernels_impl.h"
}  // namespace

const KernelTable* kernels_scalar() {
  static const KernelTable table = make_isa_kernel_table<VecPortable>("scalar");
  return &table;
}

}  // namespace pagedattn
