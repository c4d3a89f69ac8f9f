// The execution context: device names, the errors for a device this build or machine cannot
// run, and the switch of an op sending a context without a kernel to a located error.
#include <gtest/gtest.h>

#include <string>

#include "common/testing.h"
#include "core/check.h"
#include "core/device.h"
#include "core/exec.h"
#include "ops/add.h"
#include "ops/cuda_kernels.h"
#include "ops/permute.h"

namespace moecore {
namespace {

using testing::error_of;

TEST(Exec, DevicesByName) {
  EXPECT_EQ(parse_device("cpu"), Device::CPU);
  EXPECT_EQ(parse_device("cuda"), Device::CUDA);
  EXPECT_EQ(device_name(Device::CPU), "cpu");
  EXPECT_EQ(device_name(Device::CUDA), "cuda");
  EXPECT_NE(error_of([] { parse_device("gpu"); }).find("--device gpu: unknown device"),
            std::string::npos);
  EXPECT_TRUE(cpu_exec().on_cpu());
  EXPECT_TRUE(make_exec(Device::CPU).on_cpu());
  EXPECT_EQ(make_exec(Device::CPU).stream, nullptr);
}

TEST(Exec, CudaWithoutTheBuildOrTheKernelsIsAClearError) {
  if (!cuda_built()) {
    EXPECT_NE(error_of([] { make_exec(Device::CUDA); }).find("built without CUDA"),
              std::string::npos);
  }
  std::string why;
  EXPECT_TRUE(training_step_supported(Device::CPU, &why));
  EXPECT_FALSE(training_step_supported(Device::CUDA, &why));
  if (!ops::kHaveCudaKernels) {
    EXPECT_NE(why.find("no CUDA kernels (built without -DMOECORE_CUDA=ON)"), std::string::npos)
        << why;
    return;
  }
  // A build with kernels names the ops without one, and only those.
  EXPECT_NE(why.find("no kernel yet for"), std::string::npos) << why;
  const std::string missing = why.substr(0, why.find(" (those it runs: "));
  EXPECT_NE(missing.find("rmsnorm_backward"), std::string::npos) << why;
  EXPECT_EQ(missing.find(" add,"), std::string::npos) << why;
  EXPECT_NE(why.find("(those it runs: add, bf16_gemm_path, copy,"), std::string::npos) << why;
}

// A context whose backend lacks the op's kernel never falls back silently to the CPU: the op
// throws naming itself and the device, and writes nothing.
TEST(Exec, AnOpWithoutAKernelForTheDeviceThrowsNamingIt) {
  Exec ex;
  ex.device = Device::CUDA;
  float a[2] = {1, 2}, b[2] = {3, 4}, y[2] = {-1, -1};
  // add has a kernel where the build has CUDA kernels (ops/cuda_kernels.h), none elsewhere.
  if (!ops::kHaveCudaKernels) {
    const std::string msg = error_of([&] { ops::add<float>(ex, y, a, b, 2); });
    EXPECT_NE(msg.find("[add] no cuda kernel"), std::string::npos) << msg;
    EXPECT_EQ(y[0], -1.0f);
  }
  int64_t counts[2], kept = -1;
  int32_t row_token[2], row_slot[2], token_rows[2];
  const int32_t idx[2] = {0, 1};
  EXPECT_NE(error_of([&] {
              ops::build_permutation(ex, &kept, counts, row_token, row_slot, token_rows, idx, 2, 1,
                                     2);
            }).find("[build_permutation] no cuda kernel"),
            std::string::npos);
  ops::add<float>(cpu_exec(), y, a, b, 2);
  EXPECT_EQ(y[1], 6.0f);
}

}  // namespace
}  // namespace moecore
