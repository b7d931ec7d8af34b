// Portable kernels (no target pragma): the fallback on any CPU and the baseline in tests.
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
#include "attn_kernel_impl.h"
}  // namespace

const KernelTable* kernels_scalar() {
  static const KernelTable table = make_kernel_table<VecScalar>("scalar");
  return &table;
}

}  // namespace pagedattn
