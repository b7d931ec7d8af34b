// packed_linear: a model's linear layer over panel-packed weights (linear_kernel_impl.h), for
// CPUs where torch's half-precision GEMM is slow and for decode-sized batches, where a
// linear layer is a stream over its weights. packed_gated_linear: a gated MLP's gate/up
// projection with its activation applied in the kernel (act(gate) * up). packed_linear_dpbf16: the same with bf16
// (or fp32, rounded) activations on vdpbf16ps (linear_dpbf16_impl.h, AVX512-BF16), fp32 or
// bf16 out. Validation here, unchecked
// loops in the ISA TUs.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "binding_utils.h"
#include "work_pool.h"
#include "matrix_amx.h"

namespace pagedattn {

namespace {
// Rows per block: each thread runs its panels over one block of x at a time, so the block
// (48 x k fp32) stays in L2 while the panels stream past it.
constexpr int64_t kRowBlock = 48;
// The most bytes of rounded rows a thread keeps between dpbf16 calls: a decode step's
// rows; a prefill's are freed after its call.
constexpr size_t kKeptRowBytes = 1 << 20;
// Least multiply-adds per parallel chunk: a smaller layer runs on one thread (waking the
// pool costs more than its work).
constexpr int64_t kMinChunkMacs = 1 << 16;

// float32 [out_features] bias, contiguous; undefined when absent.
at::Tensor checked_bias(const std::optional<at::Tensor>& bias, int64_t out_features) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  check_cpu(*bias, "bias");
  TORCH_CHECK_TYPE(bias->scalar_type() == at::kFloat, "bias must be float32, got ",
                   bias->scalar_type());
  TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == out_features, "bias must be [",
                    out_features, "], got shape ", bias->sizes());
  return bias->contiguous();
}

void check_x(const at::Tensor& x) {
  check_cpu(x, "x");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat, "x must be float32, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be 2-D [num_tokens, in_features], got shape ", x.sizes());
}

void check_panels(int64_t out_features, int64_t panels) {
  TORCH_CHECK_VALUE(out_features > 0 && (out_features + kLinearPanel - 1) / kLinearPanel == panels,
                    "out_features ", out_features, " does not match packed_weight's ", panels,
                    " panels of ", kLinearPanel, " columns");
}

// The weight's dtype, after checking x, packed_weight and out_features agree.
DType check_packed_linear_args(const at::Tensor& x, const at::Tensor& packed_weight,
                               int64_t out_features) {
  check_x(x);
  check_cpu(packed_weight, "packed_weight");
  const DType wdt = to_dtype(packed_weight.scalar_type(), "packed_weight");
  TORCH_CHECK_VALUE(packed_weight.dim() == 3 && packed_weight.size(2) == kLinearPanel,
                    "packed_weight must be 3-D [ceil(out_features / ", kLinearPanel,
                    "), in_features, ", kLinearPanel, "] (pack_linear_weight), got shape ",
                    packed_weight.sizes());
  TORCH_CHECK_VALUE(packed_weight.is_contiguous(), "packed_weight must be contiguous");
  TORCH_CHECK_VALUE(packed_weight.size(1) == x.size(1), "x has ", x.size(1),
                    " features but packed_weight has ", packed_weight.size(1));
  check_panels(out_features, packed_weight.size(0));
  return wdt;
}

// Runs block(p, m_begin, m_end, p_begin, p_end) over `panels` output panels, each thread
// taking whole panels and walking them one row block at a time.
template <class Block>
void run_panels(const LinearParams& p, int64_t panels, int64_t macs_per_row_panel,
                const Block& block) {
  const int64_t grain = std::max<int64_t>(
      1, kMinChunkMacs / (std::min(p.m, kRowBlock) * macs_per_row_panel));
  pool_parallel_for(0, panels, grain, [&](int64_t pb, int64_t pe) {
    for (int64_t mb = 0; mb < p.m; mb += kRowBlock) block(p, mb, std::min(p.m, mb + kRowBlock), pb, pe);
  });
}
}  // namespace

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed_weight,
                         const std::optional<at::Tensor>& bias, int64_t out_features) {
  const DType wdt = check_packed_linear_args(x, packed_weight, out_features);
  const at::Tensor bias_c = checked_bias(bias, out_features);
  const float* bias_ptr = bias_c.defined() ? bias_c.data_ptr<float>() : nullptr;
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1);
  at::Tensor out = at::empty({m, out_features}, x.options());
  if (m == 0) return out;
  if (k == 0) return bias_ptr != nullptr ? out.copy_(bias_c.expand({m, out_features})) : out.zero_();

  LinearParams p{xc.data_ptr<float>(), xc.stride(0), packed_weight.data_ptr(), wdt, bias_ptr,
                 out.data_ptr<float>(), out.stride(0), m, out_features, k};
  run_panels(p, packed_weight.size(0), k * kLinearPanel, current_kernels()->linear_block);
  return out;
}

namespace {
GatedActivation gated_activation(c10::string_view name) {
  if (name == "silu") return GatedActivation::kSilu;
  TORCH_CHECK_VALUE(name == "gelu_tanh", "activation must be 'silu' or 'gelu_tanh', got '",
                    std::string(name), "'");
  return GatedActivation::kGeluTanh;
}
}  // namespace

at::Tensor packed_gated_linear(const at::Tensor& x, const at::Tensor& packed_weight,
                               const std::optional<at::Tensor>& bias, int64_t out_features,
                               c10::string_view activation) {
  const GatedActivation act = gated_activation(activation);
  const DType wdt = check_packed_linear_args(x, packed_weight, out_features);
  TORCH_CHECK_VALUE(out_features % (2 * kLinearPanel) == 0, "out_features (gate and up, ",
                    out_features, ") must be a multiple of ", 2 * kLinearPanel,
                    ": each half a whole number of ", kLinearPanel, "-column panels");
  const at::Tensor bias_c = checked_bias(bias, out_features);
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), d = out_features / 2;
  at::Tensor out = at::empty({m, d}, x.options());
  if (m == 0) return out;
  LinearParams p{xc.data_ptr<float>(), xc.stride(0), packed_weight.data_ptr(), wdt,
                 bias_c.defined() ? bias_c.data_ptr<float>() : nullptr, out.data_ptr<float>(),
                 out.stride(0), m, out_features, k};
  const auto block = current_kernels()->gated_linear_block;
  run_panels(p, d / kLinearPanel, 2 * std::max<int64_t>(k, 1) * kLinearPanel,
             [&](const LinearParams& lp, int64_t mb, int64_t me, int64_t pb, int64_t pe) {
               block(lp, act, mb, me, pb, pe);
             });
  return out;
}

// float32 or bfloat16: the activation dtypes of the dpbf16 path.
static DType activation_dtype(at::ScalarType t, const char* name) {
  TORCH_CHECK_TYPE(t == at::kFloat || t == at::kBFloat16, name,
                   " must be float32 or bfloat16, got ", t);
  return t == at::kFloat ? DType::kF32 : DType::kBF16;
}

namespace {
// x, packed_weight (pack_linear_weight_dpbf16), bias and out_dtype checked; the
// parameters of the call and its output (not yet written).
struct DpCall {
  LinearDpParams p;
  at::Tensor out, x, bias;
  int64_t panels;
};
DpCall checked_dp_call(const at::Tensor& x, const at::Tensor& packed_weight,
                       const std::optional<at::Tensor>& bias, int64_t out_features,
                       std::optional<at::ScalarType> out_dtype, bool gated = false) {
  check_cpu(x, "x");
  const DType x_dtype = activation_dtype(x.scalar_type(), "x");
  const at::ScalarType out_type = out_dtype.value_or(at::kFloat);
  const DType o_dtype = activation_dtype(out_type, "out_dtype");
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be 2-D [num_tokens, in_features], got shape ", x.sizes());
  check_cpu(packed_weight, "packed_weight");
  TORCH_CHECK_TYPE(packed_weight.scalar_type() == at::kBFloat16,
                   "packed_weight must be bfloat16 (pack_linear_weight_dpbf16), got ",
                   packed_weight.scalar_type());
  TORCH_CHECK_VALUE(packed_weight.dim() == 3 && packed_weight.size(2) == 2 * kLinearPanel,
                    "packed_weight must be 3-D [ceil(out_features / ", kLinearPanel,
                    "), ceil(in_features / 2), ", 2 * kLinearPanel,
                    "] (pack_linear_weight_dpbf16), got shape ", packed_weight.sizes());
  TORCH_CHECK_VALUE(packed_weight.is_contiguous(), "packed_weight must be contiguous");
  const int64_t k = x.size(1), k_pairs = packed_weight.size(1), panels = packed_weight.size(0);
  TORCH_CHECK_VALUE((k + 1) / 2 == k_pairs, "x has ", k, " features but packed_weight has ",
                    k_pairs, " pairs of them (", 2 * k_pairs - 1, " or ", 2 * k_pairs,
                    " features)");
  check_panels(out_features, panels);
  if (gated)
    TORCH_CHECK_VALUE(out_features % (2 * kLinearPanel) == 0, "out_features (gate and up, ",
                      out_features, ") must be a multiple of ", 2 * kLinearPanel,
                      ": each half a whole number of ", kLinearPanel, "-column panels");
  DpCall call;
  call.bias = checked_bias(bias, out_features);
  call.x = x.stride(1) == 1 ? x : x.contiguous();
  call.out = at::empty({x.size(0), gated ? out_features / 2 : out_features},
                       x.options().dtype(out_type));
  call.panels = panels;
  call.p = LinearDpParams{call.x.data_ptr(), call.x.stride(0),
                          reinterpret_cast<const bf16_t*>(packed_weight.data_ptr()),
                          call.bias.defined() ? call.bias.data_ptr<float>() : nullptr,
                          call.out.data_ptr(), call.out.stride(0), x.size(0), out_features, k,
                          k_pairs, x_dtype, o_dtype};
  return call;
}

// An empty x, or one without features (the product is the bias); false: the call has work.
bool done_without_work(DpCall& call, const AmxGatedEpilogue* gated = nullptr) {
  if (call.p.m == 0) return true;
  if (call.p.k != 0) return false;
  if (gated == nullptr) {
    if (call.bias.defined()) call.out.copy_(call.bias.expand({call.p.m, call.p.n}));
    else call.out.zero_();
    return true;
  }
  const int64_t d = call.p.n / 2;
  at::Tensor sums = call.bias.defined() ? call.bias.view({1, 2 * d}).expand({call.p.m, 2 * d}).contiguous()
                                        : at::zeros({call.p.m, 2 * d}, at::kFloat);
  const float* g = sums.data_ptr<float>();
  gated->act_mul(gated->act, g, g + d, 2 * d, call.p.m, d, call.out.data_ptr(), call.out.stride(0),
                 call.p.out_dtype);
  return true;
}
}  // namespace

at::Tensor packed_linear_dpbf16(const at::Tensor& x, const at::Tensor& packed_weight,
                                const std::optional<at::Tensor>& bias, int64_t out_features,
                                std::optional<at::ScalarType> out_dtype) {
  DpCall call = checked_dp_call(x, packed_weight, bias, out_features, out_dtype);
  const KernelTable* kt = current_kernels();
  TORCH_CHECK_NOT_IMPLEMENTED(kt->linear_dpbf16_block != nullptr,
                              "packed_linear_dpbf16 needs the avx512bf16 kernels (a CPU with "
                              "AVX512-BF16); the kernels in use are ", kt->name);
  if (done_without_work(call)) return call.out;
  const LinearDpParams& p = call.p;
  const int64_t m = p.m, k = p.k, panels = call.panels;
  // x's rows are rounded to bf16 once, by the calling thread, into its buffer (kept
  // between calls: no allocation per call); every thread reads them there. Threads split
  // the panels in whole groups of the microkernel's 4-panel tile.
  const int64_t row_elems = 2 * p.k_pairs;
  thread_local std::vector<bf16_t> x_bf16;
  x_bf16.resize(std::max<size_t>(x_bf16.size(), static_cast<size_t>(m * row_elems)));
  const bf16_t* rows = x_bf16.data();
  kt->linear_dpbf16_round(p, 0, m, x_bf16.data());
  constexpr int64_t kGroup = 4;
  const int64_t groups = (panels + kGroup - 1) / kGroup;
  const int64_t grain = std::max<int64_t>(
      1, kMinChunkMacs / (std::min(m, kRowBlock) * k * kLinearPanel * kGroup));
  pool_parallel_for(0, groups, grain, [&](int64_t gb, int64_t ge) {
    const int64_t pb = gb * kGroup, pe = std::min(panels, ge * kGroup);
    for (int64_t mb = 0; mb < m; mb += kRowBlock)
      kt->linear_dpbf16_block(p, mb, std::min(m, mb + kRowBlock), pb, pe, rows + mb * row_elems);
  });
  if (x_bf16.size() * sizeof(bf16_t) > kKeptRowBytes) std::vector<bf16_t>().swap(x_bf16);
  return call.out;
}

// The tiles, where the kernels in use are the AVX512-BF16 ones (the epilogue's rounding
// is theirs; a lower ISA forced, as tests and comparisons do, goes without them too).
bool amx_linear_available() {
  return current_cpu_isa() == CpuIsa::kAvx512bf16 && own_tiles_permitted();
}

// packed_linear_amx, or, with an activation, a gated MLP's act(gate) * up from its
// gate/up projection, the activation applied to the tiles' fp32 sums.
at::Tensor run_linear_amx(const at::Tensor& x, const at::Tensor& packed_weight,
                          const std::optional<at::Tensor>& bias, int64_t out_features,
                          std::optional<at::ScalarType> out_dtype,
                          std::optional<GatedActivation> activation) {
  const char* name = activation ? "packed_gated_linear_amx" : "packed_linear_amx";
  DpCall call = checked_dp_call(x, packed_weight, bias, out_features, out_dtype,
                                activation.has_value());
  TORCH_CHECK_NOT_IMPLEMENTED(amx_linear_available(), name,
                              " needs AMX-BF16 tiles that this process may use (a CPU with "
                              "amx_bf16, a Linux that grants them, the avx512bf16 kernels)");
  std::optional<AmxGatedEpilogue> gated;
  if (activation)
    gated = AmxGatedEpilogue{*activation, current_kernels()->act_mul_f32_rows,
                             call.panels / 2};
  const AmxGatedEpilogue* epilogue = gated ? &*gated : nullptr;
  if (done_without_work(call, epilogue)) return call.out;
  const LinearDpParams& p = call.p;
  // Work units: pairs of panels, or gate panels (each beside its up panel).
  const int64_t m = p.m, units = gated ? call.panels / 2 : (call.panels + 1) / 2;
  // Rows per chunk: each thread streams its panels once per chunk, every row block of the
  // chunk reading a panel pair while it is in L1/L2, so a chunk is as many rows as fit in
  // about 512 KiB of A tiles, at least 32: L2 holds them beside the weight streaming past
  // (1 MiB ran SmolLM2's gate/up 15-20% slower at 2048 rows, 2 MiB twice as slow).
  const int64_t ld = amx_linear_row_stride(p.k_pairs);
  constexpr int64_t kAmxChunkBytes = 512 << 10;
  const int64_t row_chunk =
      std::max<int64_t>(32, kAmxChunkBytes / (ld * static_cast<int64_t>(sizeof(bf16_t))) / 32 * 32);
  const int64_t grain = std::max<int64_t>(
      1, kMinChunkMacs / (std::min(m, row_chunk) * std::max<int64_t>(p.k, 1) * 2 * kLinearPanel));
  pool_parallel_for(0, units, grain, [&](int64_t ub, int64_t ue) {
    thread_local std::vector<bf16_t> rows;
    rows.resize(std::max<size_t>(rows.size(), (std::min(m, row_chunk) + 15) / 16 * 16 * ld));
    const int64_t pb = gated ? ub : 2 * ub, pe = gated ? ue : std::min(call.panels, 2 * ue);
    acquire_own_tiles();
    for (int64_t mb = 0; mb < m; mb += row_chunk)
      amx_linear_panels(p, mb, std::min(m, mb + row_chunk), pb, pe, rows.data(), epilogue);
    release_own_tiles();
  });
  return call.out;
}

// The same product on AMX tiles (matrix_amx.cpp): the weight's panels are read in place
// as B tiles, two at a time, against 32 rows of x at a time.
at::Tensor packed_linear_amx(const at::Tensor& x, const at::Tensor& packed_weight,
                             const std::optional<at::Tensor>& bias, int64_t out_features,
                             std::optional<at::ScalarType> out_dtype) {
  return run_linear_amx(x, packed_weight, bias, out_features, out_dtype, std::nullopt);
}

at::Tensor packed_gated_linear_amx(const at::Tensor& x, const at::Tensor& packed_weight,
                                   const std::optional<at::Tensor>& bias, int64_t out_features,
                                   c10::string_view activation,
                                   std::optional<at::ScalarType> out_dtype) {
  return run_linear_amx(x, packed_weight, bias, out_features, out_dtype,
                        gated_activation(activation));
}

}  // namespace pagedattn

TORCH_LIBRARY_FRAGMENT(pagedattn, m) {
  m.def("packed_linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features) -> Tensor");
  m.def("packed_gated_linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features, "
        "str activation) -> Tensor");
  m.def("packed_linear_dpbf16(Tensor x, Tensor packed_weight, Tensor? bias, int out_features, "
        "ScalarType? out_dtype=None) -> Tensor");
  m.def("packed_linear_amx(Tensor x, Tensor packed_weight, Tensor? bias, int out_features, "
        "ScalarType? out_dtype=None) -> Tensor");
  m.def("packed_gated_linear_amx(Tensor x, Tensor packed_weight, Tensor? bias, "
        "int out_features, str activation, ScalarType? out_dtype=None) -> Tensor");
  m.def("amx_linear_available() -> bool", &pagedattn::amx_linear_available);
}

TORCH_LIBRARY_IMPL(pagedattn, CPU, m) {
  m.impl("packed_linear", &pagedattn::packed_linear);
  m.impl("packed_gated_linear", &pagedattn::packed_gated_linear);
  m.impl("packed_linear_dpbf16", &pagedattn::packed_linear_dpbf16);
  m.impl("packed_linear_amx", &pagedattn::packed_linear_amx);
  m.impl("packed_gated_linear_amx", &pagedattn::packed_gated_linear_amx);
}
