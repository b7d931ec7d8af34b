// Portable kernels (no target pragma, no intrinsics): the fallback on any CPU. 4-wide via
// compiler vector extensions (VecPortable); VecScalar supplies the bit-exact conversions.
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
#include "vec_portable.h"
#include "attn_kernel_impl.h"
#include "linear_kernel_impl.h"
#include "layer_kernel_impl.h"
#include "stream_read_impl.h"
}  // namespace

const KernelTable* kernels_scalar() {
  static const KernelTable table =
      with_stream_kernels<VecPortable>(
          with_model_kernels<VecPortable>(make_kernel_table<VecPortable>("scalar")));
  return &table;
}

}  // namespace pagedattn
