// Run-time ISA selection: detection, PAGEDATTN_CPU_ISA, in-process switching, and the
// Python module entry point of pagedattn._C (it only has to exist: the ops register
// themselves through TORCH_LIBRARY when the shared object is loaded).
#include <Python.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>

#include "binding_utils.h"

namespace pagedattn {

// Whether this CPU executes `isa`'s instructions (whatever the build holds).
static bool cpu_executes(CpuIsa isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512dq");
  switch (isa) {
    case CpuIsa::kScalar: return true;
    case CpuIsa::kAvx2: return avx2;
    case CpuIsa::kAvx512: return avx512;
    case CpuIsa::kAvx512bf16: return avx512 && __builtin_cpu_supports("avx512bf16");
    default: return false;
  }
#else
  return true;  // scalar, and NEON which AArch64 always has
#endif
}

bool cpu_isa_supported(CpuIsa isa) {
  // The CPU first: an ISA's table is built on first use by code compiled for that ISA
  // (its copies may use that ISA's registers), so asking for it is only safe after.
  return cpu_executes(isa) && kernel_table_for(isa) != nullptr;
}

static bool cpu_has_amx() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16");
#else
  return false;
#endif
}

static CpuIsa best_cpu_isa() {
#if defined(__aarch64__)
  return CpuIsa::kNeon;
#else
  for (CpuIsa isa : kX86Preference)
    if (cpu_isa_supported(isa)) return isa;
  return CpuIsa::kScalar;
#endif
}

namespace {
// -1 until resolved; resolution reads PAGEDATTN_CPU_ISA once. A bad value is remembered
// and raised by every op until set_cpu_isa picks a valid ISA.
std::atomic<int64_t> g_isa{-1};
std::string g_env_error;
std::once_flag g_once;

void resolve_from_env() {
  const char* env = std::getenv("PAGEDATTN_CPU_ISA");
  if (env == nullptr || *env == '\0') {
    g_isa = static_cast<int64_t>(best_cpu_isa());
    return;
  }
  std::string want(env);
  for (char& c : want) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (int64_t code = 0; code < kNumCpuIsa; ++code) {
    if (want == cpu_isa_name(code)) {
      if (cpu_isa_supported(static_cast<CpuIsa>(code))) {
        g_isa = code;
      } else {
        g_env_error = "PAGEDATTN_CPU_ISA='" + want + "' is not supported by this CPU/build; best available is '" +
                      cpu_isa_name(static_cast<int64_t>(best_cpu_isa())) + "'";
      }
      return;
    }
  }
  g_env_error = "PAGEDATTN_CPU_ISA='" + std::string(env) + "' is not a known ISA; expected one of " +
                kCpuIsaNameList;
}
}  // namespace

CpuIsa current_cpu_isa() {
  std::call_once(g_once, resolve_from_env);
  const int64_t code = g_isa.load();
  TORCH_CHECK_NOT_IMPLEMENTED(code >= 0, g_env_error);
  return static_cast<CpuIsa>(code);
}

const KernelTable* current_kernels() { return kernel_table_for(current_cpu_isa()); }

IsaHint check_isa_hint(int64_t code, const char* op) {
  TORCH_CHECK_VALUE(code >= 0 && code < kNumIsaHints, op, ": isa hint code ", code,
                    " is not valid; expected the code of one of ", kIsaHintNameList);
  const auto hint = static_cast<IsaHint>(code);
  // 'amx' selects the matrix-engine prefill kernel: oneDNN's brgemm, which runs AMX tiles
  // where the CPU has them and AVX-512/AVX2 code elsewhere.
  if (hint == IsaHint::kAmx)
    TORCH_CHECK_NOT_IMPLEMENTED(matrix_engine() != nullptr, op,
                                ": isa hint 'amx' needs torch's brgemm microkernels (oneDNN), "
                                "which this torch build or CPU does not run (use 'vec' or "
                                "'vec16')");
  if (hint == IsaHint::kNeon) {
#if !defined(__aarch64__)
    TORCH_CHECK_NOT_IMPLEMENTED(false, op, ": isa hint 'neon' is only available on Arm (aarch64) "
                                "CPUs (use 'vec' or 'vec16')");
#endif
  }
  return hint;
}

static int64_t get_cpu_isa_op() { return static_cast<int64_t>(current_cpu_isa()); }

static void set_cpu_isa_op(int64_t code) {
  TORCH_CHECK_VALUE(code >= 0 && code < kNumCpuIsa, "set_cpu_isa: code ", code,
                    " is not valid; expected the code of one of ", kCpuIsaNameList);
  const auto isa = static_cast<CpuIsa>(code);
  TORCH_CHECK_NOT_IMPLEMENTED(cpu_isa_supported(isa), "set_cpu_isa: ISA '", cpu_isa_name(code),
                              "' is not supported by this CPU/build");
  std::call_once(g_once, [] {});  // later calls must not re-read the environment
  g_isa = code;
}

static std::vector<int64_t> supported_cpu_isas_op() {
  std::vector<int64_t> out;
  for (int64_t c = 0; c < kNumCpuIsa; ++c)
    if (cpu_isa_supported(static_cast<CpuIsa>(c))) out.push_back(c);
  return out;
}

static int64_t best_cpu_isa_op() { return static_cast<int64_t>(best_cpu_isa()); }
static bool cpu_has_amx_op() { return cpu_has_amx(); }

}  // namespace pagedattn

TORCH_LIBRARY(pagedattn, m) {
  m.def("get_cpu_isa() -> int", &pagedattn::get_cpu_isa_op);
  m.def("set_cpu_isa(int isa) -> ()", &pagedattn::set_cpu_isa_op);
  m.def("supported_cpu_isas() -> int[]", &pagedattn::supported_cpu_isas_op);
  m.def("best_cpu_isa() -> int", &pagedattn::best_cpu_isa_op);
  m.def("cpu_has_amx() -> bool", &pagedattn::cpu_has_amx_op);
}

static struct PyModuleDef pagedattn_c_module = {PyModuleDef_HEAD_INIT, "_C",
                                                "pagedattn native CPU ops (see torch.ops.pagedattn)",
                                                -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&pagedattn_c_module); }
