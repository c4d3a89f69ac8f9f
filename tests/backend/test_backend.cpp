// The harness's driver: every case of the table on every backend, one test each
// (Backend/Ops.Run/<backend>_<case>), and the check that the table covers every op of
// src/ops/*.h. A case that cannot run on a backend (no CUDA build, no device, or no kernel for
// the op there yet) is reported as skipped, "not run: <reason>", never as passed.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <numeric>
#include <random>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "backend_case.h"
#include "common/command.h"
#include "common/paths.h"
#include "core/check.h"
#include "core/device.h"
#include "ops/cast.h"
#include "ops/cuda_kernels.h"

namespace moecore::backend_test {

const std::vector<Backend>& backends() {
  static const std::vector<Backend> all = [] {
    std::vector<Backend> b;
    b.push_back({"cpu", true, "", cpu_exec()});
    const DeviceInfo info = cuda_device_info();
    Backend cuda{"cuda", info.available, info.description, Exec{}};
    if (info.available) {
      try {
        cuda.ex = make_exec(Device::CUDA);
      } catch (const moecore::Error& e) {  // a device that is listed but cannot be used
        cuda.available = false;
        cuda.why = e.what();
      }
    }
    b.push_back(cuda);
    return b;
  }();
  return all;
}

const std::vector<OpCase>& op_cases() {
  static const std::vector<OpCase> all = [] {
    std::vector<OpCase> c;
    add_gemm_cases(c);
    add_gemm_bf16_cases(c);
    add_grouped_gemm_device_cases(c);
    add_moe_cases(c);
    add_elementwise_cases(c);
    add_dropout_cases(c);
    add_model_cases(c);
    add_router_cases(c);
    add_router_balance_cases(c);
    add_step_cases(c);
    return c;
  }();
  return all;
}

std::vector<int32_t> distinct_experts(int64_t T, int64_t K, int64_t E, double drop,
                                      uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<int32_t> idx(T * K), perm(E);
  for (int64_t t = 0; t < T; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), gen);
    for (int64_t k = 0; k < K; ++k) idx[t * K + k] = drop > 0 && u(gen) < drop ? -1 : perm[k];
  }
  return idx;
}

std::vector<bf16> to_bf16(const std::vector<float>& x) {
  std::vector<bf16> y(x.size());
  ops::cast_f32_to_bf16_ref(y.data(), x.data(), static_cast<int64_t>(x.size()));
  return y;
}

std::vector<float> bf16_rounded(const std::vector<float>& x) {
  std::vector<float> y(x.size());
  ops::round_f32_to_bf16_ref(y.data(), x.data(), static_cast<int64_t>(x.size()));
  return y;
}

namespace {

struct Param {
  size_t backend, op_case;
};

std::vector<Param> all_params() {
  std::vector<Param> p;
  for (size_t b = 0; b < backends().size(); ++b) {
    for (size_t c = 0; c < op_cases().size(); ++c) p.push_back({b, c});
  }
  return p;
}

// For gtest's failure lines: the test's own name instead of the param's bytes.
void PrintTo(const Param& p, std::ostream* os) {
  *os << backends()[p.backend].name << "_" << op_cases()[p.op_case].name;
}

class Ops : public ::testing::TestWithParam<Param> {};

// Whether the table of kernels (ops/cuda_kernels.h) gives `op` a CUDA path.
bool has_cuda_path(const std::string& op) {
  for (const ops::OpKernel& k : ops::op_kernels()) {
    if (k.op == op) return k.cuda;
  }
  return false;
}

TEST_P(Ops, Run) {
  const Backend& b = backends()[GetParam().backend];
  const OpCase& c = op_cases()[GetParam().op_case];
  if (!b.available) GTEST_SKIP() << "not run: " << b.name << " backend: " << b.why;
  // On CUDA the table of kernels must say what the switches do: a case whose ops all have a
  // kernel runs to the end, one with an op without a kernel stops at that op's switch.
  std::string without_kernel;
  if (!b.ex.on_cpu()) {
    for (const std::string& op : c.ops) {
      if (!has_cuda_path(op)) without_kernel += (without_kernel.empty() ? "" : ", ") + op;
    }
  }
  reset_outputs_digest();
  try {
    c.run(b.ex);
    std::printf("[outputs] %s_%s %016llx\n", b.name.c_str(), c.name.c_str(),
                static_cast<unsigned long long>(outputs_digest()));
  } catch (const moecore::Error& e) {
    // A backend without the op's kernel (ops::no_kernel) has not run it: not a pass.
    const std::string what = e.what();
    const size_t at = what.find("] no " + b.name + " kernel");
    if (!b.ex.on_cpu() && at != std::string::npos) {
      const std::string op = what.substr(what.rfind('[', at) + 1, at - what.rfind('[', at) - 1);
      EXPECT_FALSE(has_cuda_path(op))
          << op << ": the table of kernels (ops/cuda_kernels.cpp) gives it a CUDA path, but its "
          << "switch has none: " << what;
      GTEST_SKIP() << "not run: " << what;
    }
    throw;
  }
  EXPECT_TRUE(without_kernel.empty())
      << "the case ran on " << b.name << " although the table of kernels (ops/cuda_kernels.cpp) "
      << "gives these ops no CUDA path: " << without_kernel;
}

INSTANTIATE_TEST_SUITE_P(Backend, Ops, ::testing::ValuesIn(all_params()),
                         [](const ::testing::TestParamInfo<Param>& info) {
                           return backends()[info.param.backend].name + "_" +
                                  op_cases()[info.param.op_case].name;
                         });

// The ops of src/ops/*.h: every function whose first parameter is `const Exec&`.
std::set<std::string> ops_in_headers() {
  std::set<std::string> ops;
  const std::filesystem::path dir = std::filesystem::path(::moecore::testing::source_dir()) / "src" / "ops";
  const std::regex op_decl(R"(([A-Za-z_][A-Za-z_0-9]*)\s*\(\s*const\s+Exec\s*&)");
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".h") continue;
    std::ifstream in(entry.path());
    std::stringstream text;
    text << in.rdbuf();
    const std::string s = text.str();
    for (std::sregex_iterator it(s.begin(), s.end(), op_decl), end; it != end; ++it) {
      ops.insert((*it)[1].str());
    }
  }
  return ops;
}

// The table of kernels names every op of the headers once, in order.
TEST(BackendTable, KernelTableListsEveryOpInTheHeaders) {
  const std::set<std::string> declared = ops_in_headers();
  std::vector<std::string> listed;
  for (const ops::OpKernel& k : ops::op_kernels()) listed.emplace_back(k.op);
  EXPECT_TRUE(std::is_sorted(listed.begin(), listed.end()));
  const std::set<std::string> table(listed.begin(), listed.end());
  EXPECT_EQ(table.size(), listed.size()) << "an op listed twice in ops/cuda_kernels.cpp";
  for (const std::string& op : declared) {
    EXPECT_TRUE(table.count(op)) << op << " (src/ops/) is missing from ops/cuda_kernels.cpp";
  }
  for (const std::string& op : table) {
    EXPECT_TRUE(declared.count(op)) << op << " is in ops/cuda_kernels.cpp but in no op header";
  }
}

// `moecore train --device cuda` stops before step 0 with a message naming what is missing: the
// CUDA build (CPU build), a usable device (the CUDA build without one), or the ops without a
// CUDA kernel (the emulated build, a GPU), until every op of the step has one.
TEST(CudaTraining, StopsBeforeStepZeroNamingWhatIsMissing) {
  std::string why;
  if (training_step_supported(Device::CUDA, &why) && cuda_device_info().available) {
    GTEST_SKIP() << "every op has a CUDA kernel and a device is visible: --device cuda trains "
                    "(tests/emu/train_cuda_emu.sh in the emulated CUDA build)";
  }
  const testing::CommandResult r = testing::run_moecore(
      "train --config " + testing::source_dir() + "/configs/tiny.toml --device cuda");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("iteration "), std::string::npos) << "trained on cuda:\n" << r.output;
  if (!cuda_built()) {
    EXPECT_NE(r.output.find("--device cuda: this moecore was built without CUDA"),
              std::string::npos) << r.output;
    return;
  }
  const DeviceInfo info = cuda_device_info();
  if (!info.available) {  // the CUDA build on a machine without a usable GPU
    EXPECT_NE(r.output.find("[exec] --device cuda: " + info.description), std::string::npos)
        << r.output;
    return;
  }
  EXPECT_NE(r.output.find("[train] --device cuda: the CUDA backend has no kernel yet for"),
            std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rmsnorm_backward"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("; train with --device cpu"), std::string::npos) << r.output;
}

TEST(BackendTable, CoversEveryOpInTheHeaders) {
  const std::set<std::string> declared = ops_in_headers();
  ASSERT_GT(declared.size(), 40u) << "the header scan found too few ops: is the regex broken?";
  std::set<std::string> covered;
  for (const OpCase& c : op_cases()) {
    EXPECT_FALSE(c.ops.empty()) << c.name << " names no op";
    covered.insert(c.ops.begin(), c.ops.end());
  }
  for (const std::string& op : declared) {
    EXPECT_TRUE(covered.count(op)) << op << " (src/ops/) has no case in tests/backend/";
  }
  for (const std::string& op : covered) {
    EXPECT_TRUE(declared.count(op)) << op << " is named by a case but declared by no op header";
  }
  std::set<std::string> names;
  for (const OpCase& c : op_cases()) {
    EXPECT_TRUE(names.insert(c.name).second) << "two cases named " << c.name;
    EXPECT_TRUE(std::regex_match(c.name, std::regex("[a-z0-9_]+"))) << c.name;
  }
}

}  // namespace
}  // namespace moecore::backend_test
