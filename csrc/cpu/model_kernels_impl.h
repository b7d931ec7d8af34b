// The model-layer, stream and attention entries of one ISA's kernel table. Included inside
// the anonymous namespace of a kernels_<isa>.cpp after attn_kernel_impl.h; the TU's
// specializations (PrefillItem, Qk, Pv, CacheConvert) may follow, as templates are
// instantiated only where the table is built, at the end of the TU.
#include "linear_kernel_impl.h"
#include "layer_kernel_impl.h"
#include "stream_read_impl.h"

// VN: the narrower vector ops for head sizes that are not a multiple of VO::W.
template <class VO, class VN = VO>
KernelTable make_isa_kernel_table(const char* name) {
  return with_stream_kernels<VO>(with_model_kernels<VO>(make_kernel_table<VO, VN>(name)));
}
