// The execution context: device names, the errors for a device this build or machine cannot
// run, and a kernel launched in a build without a CUDA device stopping with a located error.
#include <gtest/gtest.h>

#include <string>

#include "common/testing.h"
#include "core/check.h"
#include "core/device.h"
#include "core/exec.h"
#include "ops/add.h"
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

TEST(Exec, CudaWithoutTheBuildIsAClearError) {
  std::string why;
  EXPECT_TRUE(training_step_supported(Device::CPU, &why));
  if (cuda_built()) {
    // Every op has a kernel (ops/cuda_kernels.h's table): the whole step runs on CUDA.
    EXPECT_TRUE(training_step_supported(Device::CUDA, &why)) << why;
    return;
  }
  EXPECT_NE(error_of([] { make_exec(Device::CUDA); }).find("built without CUDA"),
            std::string::npos);
  EXPECT_FALSE(training_step_supported(Device::CUDA, &why));
  EXPECT_NE(why.find("built without CUDA (-DMOECORE_CUDA=ON)"), std::string::npos) << why;
}

// Device selection (parallel/device_assignment.h) without the CUDA build: no device to list, and
// selecting one says why.
TEST(Exec, CudaDeviceSelectionWithoutTheBuild) {
  if (cuda_built()) GTEST_SKIP() << "not run: this build has CUDA devices";
  EXPECT_TRUE(cuda_visible_devices().empty());
  const std::string error = error_of([] { cuda_select_device(0); });
  EXPECT_NE(error.find("selecting CUDA device 0: this moecore was built without CUDA"),
            std::string::npos)
      << error;
  EXPECT_EQ(cuda_current_device(), 0);
}

// The CPU build compiles the kernels too (ops/cuda_kernels.h) but has no device to run them on:
// a CUDA context reaching an op's switch (only a test can make one here) never falls back to the
// CPU silently: the launch throws naming the kernel, and nothing is written.
TEST(Exec, AKernelLaunchWithoutTheBuildThrowsNamingIt) {
  if (cuda_built()) GTEST_SKIP() << "not run: this build has a CUDA device";
  Exec ex;
  ex.device = Device::CUDA;
  float a[2] = {1, 2}, b[2] = {3, 4}, y[2] = {-1, -1};
  const std::string msg = error_of([&] { ops::add<float>(ex, y, a, b, 2); });
  EXPECT_NE(msg.find("[cuda] kernel add"), std::string::npos) << msg;
  EXPECT_NE(msg.find("built without CUDA"), std::string::npos) << msg;
  EXPECT_EQ(y[0], -1.0f);
  int64_t counts[2], kept = -1;
  int32_t row_token[2], row_slot[2], token_rows[2];
  const int32_t idx[2] = {0, 1};
  const std::string perm = error_of([&] {
    ops::build_permutation(ex, &kept, counts, row_token, row_slot, token_rows, idx, 2, 1, 2);
  });
  EXPECT_NE(perm.find("built without CUDA"), std::string::npos) << perm;
  ops::add<float>(cpu_exec(), y, a, b, 2);
  EXPECT_EQ(y[1], 6.0f);
}

}  // namespace
}  // namespace moecore
