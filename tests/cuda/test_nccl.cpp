// The NCCL communicator on one GPU as one rank (NCCL refuses two ranks on one GPU, so the
// multi-rank logic stays covered by the MPI tests and the NCCL descriptors' interpreter tests):
// every collective of the Communicator against its one-rank semantics, in place and not, with
// uneven and zero counts; the stream order (the collective waits for the caller's stream, the
// caller's stream waits for it after wait_on, the host does not); the barrier; bf16 reductions
// through the f32 staging. Built in the CUDA configuration only; skipped without a visible GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "core/check.h"
#include "core/device.h"
#include "core/exec.h"
#include "parallel/communicator_nccl.h"

namespace moecore::parallel {
namespace {

// A device buffer of n floats holding `values` (or zeros).
struct DeviceFloats {
  float* p = nullptr;
  int64_t n = 0;
  explicit DeviceFloats(int64_t count, const std::vector<float>& values = {}) : n(count) {
    EXPECT_EQ(cudaMalloc(&p, static_cast<size_t>(n) * sizeof(float)), cudaSuccess);
    EXPECT_EQ(cudaMemset(p, 0, static_cast<size_t>(n) * sizeof(float)), cudaSuccess);
    if (!values.empty()) {
      EXPECT_EQ(cudaMemcpy(p, values.data(), values.size() * sizeof(float),
                           cudaMemcpyHostToDevice),
                cudaSuccess);
    }
  }
  ~DeviceFloats() { cudaFree(p); }
  std::vector<float> host() const {
    std::vector<float> h(static_cast<size_t>(n));
    EXPECT_EQ(cudaMemcpy(h.data(), p, h.size() * sizeof(float), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return h;
  }
};

std::vector<float> iota(int64_t n, float start) {
  std::vector<float> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), start);
  return v;
}

class NcclOneRank : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!nccl_built()) GTEST_SKIP() << "not the CUDA build";
    const DeviceInfo info = cuda_device_info();
    if (!info.available) GTEST_SKIP() << info.description;
    ex_ = make_exec(Device::CUDA);
    boot_ = make_local_communicator("world", 0);
    comm_ = make_nccl_communicator(*boot_, ex_, 60.0);
  }
  Exec ex_;
  std::unique_ptr<Communicator> boot_, comm_;
};

TEST_F(NcclOneRank, EveryCollectiveIsItsOneRankSemantics) {
  const int64_t n = 1000;
  const std::vector<float> v = iota(n, 1.f);
  {  // all-reduce in place: the one rank's values
    DeviceFloats d(n, v);
    comm_->all_reduce(DevPtr<void>(d.p), n, DType::F32, ReduceOp::Sum);
    EXPECT_EQ(d.host(), v);
    comm_->all_reduce(DevPtr<void>(d.p), n, DType::F32, ReduceOp::Max);
    EXPECT_EQ(d.host(), v);
  }
  {  // all-gather (equal and v), not in place and in place
    DeviceFloats s(n, v), r(n);
    comm_->all_gather_async(DevPtr<const void>(s.p), DevPtr<void>(r.p), n, DType::F32).wait();
    EXPECT_EQ(r.host(), v);
    const int64_t counts[1] = {n};
    DeviceFloats in(n, v);
    comm_->all_gather_v_async(DevPtr<const void>(in.p), DevPtr<void>(in.p), counts, DType::F32)
        .wait();
    EXPECT_EQ(in.host(), v);
  }
  {  // reduce-scatter, in place (recv = send + rank's offset = send) and not
    DeviceFloats s(n, v), r(n);
    comm_->reduce_scatter_async(DevPtr<const void>(s.p), DevPtr<void>(r.p), n, DType::F32,
                                ReduceOp::Sum)
        .wait();
    EXPECT_EQ(r.host(), v);
    const int64_t counts[1] = {n};
    comm_->reduce_scatter_v_async(DevPtr<const void>(s.p), DevPtr<void>(s.p), counts, DType::F32,
                                  ReduceOp::Sum)
        .wait();
    EXPECT_EQ(s.host(), v);
  }
  {  // all-to-all-v to itself (a grouped send and receive), and zero counts
    DeviceFloats s(n, v), r(n);
    const int64_t counts[1] = {n};
    comm_->all_to_all_v_async(DevPtr<const void>(s.p), counts, DevPtr<void>(r.p), counts,
                              DType::F32)
        .wait();
    EXPECT_EQ(r.host(), v);
    const int64_t none[1] = {0};
    DeviceFloats z(n);
    comm_->all_to_all_v_async(DevPtr<const void>(s.p), none, DevPtr<void>(z.p), none, DType::F32)
        .wait();
    EXPECT_EQ(z.host(), std::vector<float>(static_cast<size_t>(n), 0.f));
  }
  {  // broadcast from itself
    DeviceFloats d(n, v);
    comm_->broadcast_async(DevPtr<void>(d.p), n, DType::F32, 0).wait();
    EXPECT_EQ(d.host(), v);
  }
  comm_->barrier();
  // bf16 reductions run in f32 staging, rounded once: over one rank the values themselves,
  // in place and out of place, whatever the staging held before (it grows to the largest).
  {
    std::vector<bf16> hb(16);
    for (size_t i = 0; i < hb.size(); ++i) hb[i] = float_to_bf16(0.3f * static_cast<float>(i) - 2.1f);
    DeviceFloats b(8), out(8);  // 16 bf16 each
    ASSERT_EQ(cudaMemcpy(b.p, hb.data(), hb.size() * sizeof(bf16), cudaMemcpyHostToDevice),
              cudaSuccess);
    comm_->all_reduce(DevPtr<void>(b.p), 16, DType::BF16, ReduceOp::Sum);
    const int64_t c16[1] = {16}, c4[1] = {4};
    comm_->reduce_scatter_v_async(DevPtr<const void>(b.p), DevPtr<void>(out.p), c16, DType::BF16,
                                  ReduceOp::Max)
        .wait();
    comm_->reduce_scatter_v_async(DevPtr<const void>(b.p), DevPtr<void>(b.p), c4, DType::BF16,
                                  ReduceOp::Sum)
        .wait();
    std::vector<bf16> got(16), got_out(16);
    ASSERT_EQ(cudaMemcpy(got.data(), b.p, got.size() * sizeof(bf16), cudaMemcpyDeviceToHost),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(got_out.data(), out.p, got_out.size() * sizeof(bf16),
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (size_t i = 0; i < hb.size(); ++i) {
      EXPECT_EQ(bf16_to_float(got[i]), bf16_to_float(hb[i])) << i;
      EXPECT_EQ(bf16_to_float(got_out[i]), bf16_to_float(hb[i])) << i;
    }
  }
}

// The collective starts after what the caller's stream enqueued before it, and the caller's
// stream reads the result after wait_on without the host waiting.
TEST_F(NcclOneRank, OrderedOnTheCallersStream) {
  const int64_t n = int64_t(1) << 22;  // 16 MiB: long enough for a missing order to show
  const std::vector<float> v = iota(n, 0.5f);
  DeviceFloats src(n), dst(n);
  auto stream = static_cast<cudaStream_t>(ex_.stream);
  ASSERT_EQ(cudaMemcpyAsync(src.p, v.data(), static_cast<size_t>(n) * sizeof(float),
                            cudaMemcpyHostToDevice, stream),
            cudaSuccess);
  const int64_t counts[1] = {n};
  CommHandle h = comm_->all_to_all_v_async(DevPtr<const void>(src.p), counts,
                                           DevPtr<void>(dst.p), counts, DType::F32);
  h.wait_on(ex_);
  std::vector<float> got(static_cast<size_t>(n));
  ASSERT_EQ(cudaMemcpyAsync(got.data(), dst.p, got.size() * sizeof(float),
                            cudaMemcpyDeviceToHost, stream),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(got, v);
}

}  // namespace
}  // namespace moecore::parallel
