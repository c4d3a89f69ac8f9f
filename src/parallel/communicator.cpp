// Argument checks shared by every backend, handles, and the one-process local communicator.
#include "parallel/communicator.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "core/check.h"
#include "core/sync_audit.h"
#include "ops/memory.h"

namespace moecore::parallel {

std::string_view reduce_op_name(ReduceOp op) {
  return op == ReduceOp::Sum ? "sum" : "max";
}

// ---- CommHandle ----

CommHandle& CommHandle::operator=(CommHandle&& other) noexcept {
  if (this != &other) {
    finish_or_die();
    req_ = std::move(other.req_);
  }
  return *this;
}

CommHandle::~CommHandle() {
  finish_or_die();
}

void CommHandle::finish_or_die() noexcept {
  if (!req_) return;
  try {
    req_->wait();
  } catch (const std::exception& e) {
    // A destructor cannot throw, and abandoning the request would let the backend write into
    // freed memory: end the process loudly instead.
    std::fprintf(stderr, "error: pending communication failed while its handle was dropped: %s\n",
                 e.what());
    std::fflush(stderr);
    std::abort();
  }
  req_.reset();
}

void CommHandle::wait() {
  if (!req_) return;
  SyncAudit::instance().host_sync("CommHandle::wait: the host reads a collective's result");
  req_->wait();
  req_.reset();
}

void CommHandle::wait_on(const Exec& ex) {
  if (!req_) return;
  if (req_->wait_on(ex)) {  // the backend completed it on the host
    SyncAudit::instance().host_sync("CommHandle::wait_on", SyncAudit::kHostCommWait);
  }
  req_.reset();
}

bool CommHandle::test() {
  if (!req_) return true;
  if (!req_->test()) return false;
  req_.reset();
  return true;
}

// ---- argument checks ----

void Communicator::check_counts(std::span<const int64_t> counts, const char* call) const {
  MOE_CHECK(static_cast<int64_t>(counts.size()) == size(),
            "[comm] {} on group '{}': {} counts given for {} ranks (one per group member)", call,
            name(), counts.size(), size());
  for (size_t r = 0; r < counts.size(); ++r) {
    MOE_CHECK(counts[r] >= 0, "[comm] {} on group '{}': count for rank {} is {} (< 0)", call,
              name(), r, counts[r]);
  }
}

int64_t Communicator::sum_counts(std::span<const int64_t> counts, const char* call) const {
  check_counts(counts, call);
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  return total;
}

void Communicator::check_recv_size(int64_t have, int64_t want, const char* call) const {
  MOE_CHECK(have == want,
            "[comm] {} on group '{}' (rank {} of {}): buffer has {} elements, {} needed", call,
            name(), rank(), size(), have, want);
}

void Communicator::check_v_sizes(int64_t mine, int64_t total, std::span<const int64_t> counts,
                                 const char* call, bool gather) const {
  const int64_t sum = sum_counts(counts, call);
  MOE_CHECK(mine == counts[rank()],
            "[comm] {} on group '{}': this rank's {} buffer has {} elements but counts[{}] = {}",
            call, name(), gather ? "send" : "recv", mine, rank(), counts[rank()]);
  MOE_CHECK(total == sum, "[comm] {} on group '{}': {} buffer has {} elements, counts sum to {}",
            call, name(), gather ? "recv" : "send", total, sum);
}

void Communicator::check_peer(int peer, const char* what, const char* call) const {
  MOE_CHECK(peer >= 0 && peer < size(), "[comm] {} on group '{}': {} {} outside [0, {})", call,
            name(), what, peer, size());
}

namespace {
void check_count(int64_t count, const char* call, const std::string& group) {
  MOE_CHECK(count >= 0, "[comm] {} on group '{}': count {} < 0", call, group, count);
}
}  // namespace

int64_t Communicator::ring_gather_bytes(std::span<const int64_t> counts, DType dt) const {
  const int g = size();
  if (g <= 1) return 0;
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  return (total - counts[(rank() + 1) % g]) * static_cast<int64_t>(dtype_size(dt));
}

int64_t Communicator::ring_scatter_bytes(std::span<const int64_t> counts, DType dt) const {
  if (size() <= 1) return 0;
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  return (total - counts[rank()]) * static_cast<int64_t>(dtype_size(dt));
}

int64_t Communicator::ring_all_reduce_bytes(int64_t count, DType dt) const {
  const int g = size();
  if (g <= 1) return 0;
  // The pieces of the MPI backend's ring (communicator_mpi.cpp): ceil(count / g) elements each,
  // the trailing ones short or empty. A member sends every piece but one in each half.
  const int64_t piece = (count + g - 1) / g;
  const auto chunk = [&](int r) { return std::clamp<int64_t>(count - r * piece, 0, piece); };
  const int64_t elems = (count - chunk(rank())) + (count - chunk((rank() + 1) % g));
  return elems * static_cast<int64_t>(dtype_size(dt));
}

CommHandle Communicator::all_reduce_async(DevPtr<void> data, int64_t count, DType dt, ReduceOp op) {
  check_count(count, "all_reduce", name());
  bytes_sent_.all_reduce += ring_all_reduce_bytes(count, dt);
  ++calls_.all_reduce;
  return start_all_reduce(raw_ptr(data), count, dt, op);
}

CommHandle Communicator::all_gather_async(DevPtr<const void> send, DevPtr<void> recv, int64_t count,
                                          DType dt) {
  check_count(count, "all_gather", name());
  equal_counts_.assign(size(), count);  // keeps its capacity: no allocation per call
  bytes_sent_.all_gather += ring_gather_bytes(equal_counts_, dt);
  ++calls_.all_gather;
  return start_all_gather_v(raw_ptr(send), raw_ptr(recv), equal_counts_, /*equal=*/true, dt);
}

CommHandle Communicator::all_gather_v_async(DevPtr<const void> send, DevPtr<void> recv,
                                            std::span<const int64_t> counts, DType dt) {
  check_counts(counts, "all_gather_v");
  bytes_sent_.all_gather += ring_gather_bytes(counts, dt);
  ++calls_.all_gather;
  return start_all_gather_v(raw_ptr(send), raw_ptr(recv), counts, /*equal=*/false, dt);
}

CommHandle Communicator::reduce_scatter_async(DevPtr<const void> send, DevPtr<void> recv,
                                              int64_t count, DType dt, ReduceOp op) {
  check_count(count, "reduce_scatter", name());
  equal_counts_.assign(size(), count);
  bytes_sent_.reduce_scatter += ring_scatter_bytes(equal_counts_, dt);
  ++calls_.reduce_scatter;
  return start_reduce_scatter_v(raw_ptr(send), raw_ptr(recv), equal_counts_, /*equal=*/true, dt,
                                op);
}

CommHandle Communicator::reduce_scatter_v_async(DevPtr<const void> send, DevPtr<void> recv,
                                                std::span<const int64_t> counts, DType dt,
                                                ReduceOp op) {
  check_counts(counts, "reduce_scatter_v");
  bytes_sent_.reduce_scatter += ring_scatter_bytes(counts, dt);
  ++calls_.reduce_scatter;
  return start_reduce_scatter_v(raw_ptr(send), raw_ptr(recv), counts, /*equal=*/false, dt, op);
}

CommHandle Communicator::all_to_all_v_async(DevPtr<const void> send,
                                            std::span<const int64_t> send_counts, DevPtr<void> recv,
                                            std::span<const int64_t> recv_counts, DType dt) {
  check_counts(send_counts, "all_to_all_v (send counts)");
  check_counts(recv_counts, "all_to_all_v (recv counts)");
  int64_t sent = 0;
  for (int r = 0; r < size(); ++r) sent += r == rank() ? 0 : send_counts[r];
  bytes_sent_.all_to_all += sent * static_cast<int64_t>(dtype_size(dt));
  ++calls_.all_to_all;
  return start_all_to_all_v(raw_ptr(send), send_counts, raw_ptr(recv), recv_counts, dt);
}

CommHandle Communicator::broadcast_async(DevPtr<void> data, int64_t count, DType dt, int root) {
  check_count(count, "broadcast", name());
  check_peer(root, "root", "broadcast");
  ++calls_.broadcast;
  return start_broadcast(raw_ptr(data), count, dt, root);
}

CommHandle Communicator::send_async(DevPtr<const void> data, int64_t count, DType dt, int dst,
                                    int tag) {
  check_count(count, "send", name());
  check_peer(dst, "destination", "send");
  MOE_CHECK(tag >= 0, "[comm] send on group '{}': tag {} < 0", name(), tag);
  ++calls_.send;
  bytes_sent_.send += count * static_cast<int64_t>(dtype_size(dt));
  return start_send(raw_ptr(data), count, dt, dst, tag);
}

CommHandle Communicator::recv_async(DevPtr<void> data, int64_t count, DType dt, int src, int tag) {
  check_count(count, "recv", name());
  check_peer(src, "source", "recv");
  MOE_CHECK(tag >= 0, "[comm] recv on group '{}': tag {} < 0", name(), tag);
  ++calls_.recv;
  return start_recv(raw_ptr(data), count, dt, src, tag);
}

CommHandle Communicator::barrier_async() {
  ++calls_.barrier;
  return start_barrier();
}

// ---- the local (one-rank) communicator ----

namespace {

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(std::string name, int global_rank, const Exec& ex)
      : name_(std::move(name)), ranks_{global_rank}, ex_(ex) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const std::string& name() const override { return name_; }
  const std::vector<int>& global_ranks() const override { return ranks_; }
  std::string_view reduction_algorithm() const override { return "local"; }

 protected:
  // A sum or max over one rank is the value itself (bf16 included: f32 round trip is exact).
  CommHandle start_all_reduce(void*, int64_t, DType, ReduceOp) override { return {}; }
  CommHandle start_all_gather_v(const void* send, void* recv, std::span<const int64_t> counts, bool,
                                DType dt) override {
    copy(send, recv, counts[0], dt);
    return {};
  }
  CommHandle start_reduce_scatter_v(const void* send, void* recv, std::span<const int64_t> counts,
                                    bool, DType dt, ReduceOp) override {
    copy(send, recv, counts[0], dt);
    return {};
  }
  CommHandle start_all_to_all_v(const void* send, std::span<const int64_t> send_counts, void* recv,
                                std::span<const int64_t> recv_counts, DType dt) override {
    MOE_CHECK(send_counts[0] == recv_counts[0],
              "[comm] all_to_all_v on group '{}': sends {} elements to itself but expects {}",
              name_, send_counts[0], recv_counts[0]);
    copy(send, recv, send_counts[0], dt);
    return {};
  }
  CommHandle start_broadcast(void*, int64_t, DType, int) override { return {}; }
  CommHandle start_send(const void*, int64_t, DType, int, int) override {
    MOE_FAIL("[comm] send on group '{}' of one rank: a rank cannot send to itself here", name_);
  }
  CommHandle start_recv(void*, int64_t, DType, int, int) override {
    MOE_FAIL("[comm] recv on group '{}' of one rank: a rank cannot receive from itself here",
             name_);
  }
  CommHandle start_barrier() override { return {}; }

 private:
  // This rank's own data moved by an op on the context's stream (host memory is moved by the
  // CPU's copy; a device's memory must not be touched by the host).
  void copy(const void* src, void* dst, int64_t count, DType dt) const {
    if (count == 0 || src == dst) return;
    ops::copy<char>(ex_, DevPtr<char>(static_cast<char*>(dst)),
                    DevPtr<const char>(static_cast<const char*>(src)),
                    count * static_cast<int64_t>(dtype_size(dt)));
  }
  std::string name_;
  std::vector<int> ranks_;
  Exec ex_;  // a copy: the context outlives the communicator, its fields never change
};

}  // namespace

std::unique_ptr<Communicator> make_local_communicator(std::string name, int global_rank,
                                                     const Exec& ex) {
  return std::make_unique<LocalCommunicator>(std::move(name), global_rank, ex);
}

}  // namespace moecore::parallel
