// Which path the grouped GEMMs take on CUDA (ops/gemm.h): the choice of MOECORE_GROUPED_GEMM,
// the backend's answer per shape (probed once per process and cached: no allocation, one lock),
// the device-table path's workspace size and the start-up line.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "core/check.h"
#include "ops/cuda/grouped_gemm_device.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"

namespace moecore::ops {

namespace {

GroupedGemmPathChoice choice_from_env() {
  const char* env = std::getenv("MOECORE_GROUPED_GEMM");
  if (env == nullptr || *env == '\0') return GroupedGemmPathChoice::Auto;
  const std::string_view v(env);
  if (v == "auto") return GroupedGemmPathChoice::Auto;
  if (v == "host") return GroupedGemmPathChoice::Host;
  if (v == "device") return GroupedGemmPathChoice::Device;
  MOE_FAIL(
      "[gemm] MOECORE_GROUPED_GEMM={}: expected auto (device tables where supported), host "
      "(cublasGemmGroupedBatchedEx from sizes read on the host) or device (device tables, an "
      "error where unsupported)",
      v);
}

struct Probe {
  desc::GemmTypes types = desc::GemmTypes::F32;
  int64_t N = 0, K = 0;
  bool supported = false;
};

struct State {
  std::mutex mu;
  bool choice_set = false;
  GroupedGemmPathChoice choice = GroupedGemmPathChoice::Auto;
  std::array<Probe, 64> probes;  // a fixed table: a lookup never allocates
  size_t n_probes = 0;
  int64_t planned_calls = 0;  // distinct device-table calls of the workspaces planned so far
};

// The distinct device-table calls one workspace serves in a step: the backend's parameters
// depend on (workspace, G, beta, types), and a layer's calls share its workspace and G, with
// beta 0 (forwards, dgrads) or 1 (wgrads), and fc1's forward with a bf16 D under --bf16.
constexpr int64_t kCallsPerWorkspace = 3;

State& state() {
  static State s;
  return s;
}

// The backend's answer for a shape, asked once per shape (the table full: asked again).
bool supported(desc::GemmTypes types, int64_t N, int64_t K) {
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    for (size_t i = 0; i < s.n_probes; ++i) {
      const Probe& p = s.probes[i];
      if (p.types == types && p.N == N && p.K == K) return p.supported;
    }
  }
  const bool ok = cuda::device_grouped_gemm_supported(types, N, K, nullptr);
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.n_probes < s.probes.size()) s.probes[s.n_probes++] = Probe{types, N, K, ok};
  return ok;
}

// Whether the build's backend takes any of the project's types at all (at an aligned shape).
bool device_tables_built() {
  for (desc::GemmTypes t : {desc::GemmTypes::Bf16F32, desc::GemmTypes::F32,
                            desc::GemmTypes::F32Tf32, desc::GemmTypes::F64}) {
    if (supported(t, 256, 256)) return true;
  }
  return false;
}

}  // namespace

GroupedGemmPathChoice grouped_gemm_path_choice() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.choice_set) {
    s.choice = choice_from_env();
    s.choice_set = true;
  }
  return s.choice;
}

void set_grouped_gemm_path_choice(GroupedGemmPathChoice choice) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.choice = choice;
  s.choice_set = true;
}

GroupedGemmPath grouped_gemm_path(desc::GemmTypes types, int64_t N, int64_t K) {
  const GroupedGemmPathChoice c = grouped_gemm_path_choice();
  if (c == GroupedGemmPathChoice::Host) return GroupedGemmPath::Host;
  if (supported(types, N, K)) return GroupedGemmPath::Device;
  if (c == GroupedGemmPathChoice::Device) {
    std::string why;
    cuda::device_grouped_gemm_supported(types, N, K, &why);
    MOE_FAIL(
        "[gemm] MOECORE_GROUPED_GEMM=device, but the {} grouped GEMM with N={} K={} cannot run "
        "from device tables: {}; unset it (auto) to take the host tables there",
        desc::gemm_types_name(types), N, K, why);
  }
  return GroupedGemmPath::Host;
}

bool grouped_gemm_device_bf16_output(int64_t N, int64_t K) {
  return grouped_gemm_path(desc::GemmTypes::Bf16F32, N, K) == GroupedGemmPath::Device &&
         supported(desc::GemmTypes::Bf16Bf16, N, K);
}

int64_t grouped_gemm_workspace_bytes(const Exec& ex, int64_t G) {
  if (ex.on_cpu() || G <= 0 || grouped_gemm_path_choice() == GroupedGemmPathChoice::Host ||
      !device_tables_built())
    return 0;
  if (ex.stream != nullptr) {
    // A workspace of a context that runs: its two calls (beta 0 and 1) join the process's count
    // of distinct device-table calls, which the backend keeps (a sizing pass's context has no
    // stream: it plans nothing that runs).
    State& s = state();
    int64_t calls = 0;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      s.planned_calls += kCallsPerWorkspace;
      calls = s.planned_calls;
    }
    cuda::device_grouped_gemm_reserve_calls(calls);
  }
  return grouped_gemm_device_workspace_bytes(G);
}

std::string grouped_gemm_path_line(const Exec& ex, desc::GemmTypes types,
                                   std::span<const int64_t> dims) {
  const char* t = desc::gemm_types_name(types);
  if (ex.on_cpu())
    return fmt::format("[gemm] grouped GEMMs ({}): CPU (the group sizes read where they are)", t);
  const std::string host =
      "host tables: cublasGemmGroupedBatchedEx, the group sizes read on the host at every call "
      "(a host sync each, kGroupedGemmSizes)";
  if (grouped_gemm_path_choice() == GroupedGemmPathChoice::Host)
    return fmt::format("[gemm] grouped GEMMs ({}): {} (MOECORE_GROUPED_GEMM=host)", t, host);
  std::vector<int64_t> d(dims.begin(), dims.end());
  std::sort(d.begin(), d.end());
  d.erase(std::unique(d.begin(), d.end()), d.end());
  std::vector<std::string> refused;
  std::string why;
  size_t pairs = 0;
  for (int64_t n : d) {
    for (int64_t k : d) {
      ++pairs;
      if (supported(types, n, k)) continue;
      refused.push_back(fmt::format("{}x{}", n, k));
      if (why.empty()) cuda::device_grouped_gemm_supported(types, n, k, &why);
    }
  }
  if (refused.empty()) {
    return fmt::format(
        "[gemm] grouped GEMMs ({}): device tables (N, K in {{{}}}): the group sizes stay on the "
        "device, no host sync (MOECORE_GROUPED_GEMM=host for the host tables)",
        t, fmt::join(d, ", "));
  }
  if (refused.size() == pairs)
    return fmt::format("[gemm] grouped GEMMs ({}): {} (no device tables: {})", t, host, why);
  return fmt::format(
      "[gemm] grouped GEMMs ({}): device tables where the backend takes N and K; {} for N x K "
      "in {{{}}} ({})",
      t, host, fmt::join(refused, ", "), why);
}

}  // namespace moecore::ops
