// The device's communicators of a run's process groups (process_groups.h,
// with_device_communicators): NCCL on a CUDA context, one per distinct member list and shared by
// the groups with those members, each group seeing it through a view with its own name and
// counters; a group of one rank copies on the context's stream.
#include <map>

#include "core/check.h"
#include "ops/memory.h"
#include "parallel/communicator_nccl.h"
#include "parallel/process_groups.h"

namespace moecore::parallel {

namespace {

// A group of one rank on a device: every collective is this rank's own data, moved by an op on
// the context's stream (the host's local communicator would memmove device memory).
class DeviceLocalCommunicator final : public Communicator {
 public:
  DeviceLocalCommunicator(std::string name, int global_rank, const Exec& ex)
      : name_(std::move(name)), ranks_{global_rank}, ex_(ex) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const std::string& name() const override { return name_; }
  const std::vector<int>& global_ranks() const override { return ranks_; }
  std::string_view reduction_algorithm() const override { return "local"; }

 protected:
  // A sum or max over one rank is the value itself.
  CommHandle start_all_reduce(void*, int64_t, DType, ReduceOp) override { return {}; }
  CommHandle start_all_gather_v(const void* send, void* recv, std::span<const int64_t> counts,
                                bool, DType dt) override {
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
  void copy(const void* src, void* dst, int64_t count, DType dt) const {
    if (count == 0 || src == dst) return;
    ops::copy<char>(ex_, DevPtr<char>(static_cast<char*>(dst)),
                    DevPtr<const char>(static_cast<const char*>(src)),
                    count * static_cast<int64_t>(dtype_size(dt)));
  }
  std::string name_;
  std::vector<int> ranks_;
  Exec ex_;  // a copy: the context outlives the groups, its fields never change
};

// One group's view of a communicator it shares with the groups of the same members: the
// collectives are the shared one's, the name and the counters (calls, bytes sent) the group's,
// so that the trainer's per-group metrics count what that group issued.
class GroupView final : public Communicator {
 public:
  GroupView(std::shared_ptr<Communicator> shared, std::string name)
      : shared_(std::move(shared)), name_(std::move(name)) {}
  int rank() const override { return shared_->rank(); }
  int size() const override { return shared_->size(); }
  const std::string& name() const override { return name_; }
  const std::vector<int>& global_ranks() const override { return shared_->global_ranks(); }
  std::string_view reduction_algorithm() const override {
    return shared_->reduction_algorithm();
  }

 protected:
  CommHandle start_all_reduce(void* data, int64_t count, DType dt, ReduceOp op) override {
    return shared_->all_reduce_async(DevPtr<void>(data), count, dt, op);
  }
  CommHandle start_all_gather_v(const void* send, void* recv, std::span<const int64_t> counts,
                                bool equal, DType dt) override {
    if (equal) return shared_->all_gather_async(send, DevPtr<void>(recv), counts[0], dt);
    return shared_->all_gather_v_async(send, DevPtr<void>(recv), counts, dt);
  }
  CommHandle start_reduce_scatter_v(const void* send, void* recv, std::span<const int64_t> counts,
                                    bool equal, DType dt, ReduceOp op) override {
    if (equal) return shared_->reduce_scatter_async(send, DevPtr<void>(recv), counts[0], dt, op);
    return shared_->reduce_scatter_v_async(send, DevPtr<void>(recv), counts, dt, op);
  }
  CommHandle start_all_to_all_v(const void* send, std::span<const int64_t> send_counts, void* recv,
                                std::span<const int64_t> recv_counts, DType dt) override {
    return shared_->all_to_all_v_async(send, send_counts, DevPtr<void>(recv), recv_counts, dt);
  }
  CommHandle start_broadcast(void* data, int64_t count, DType dt, int root) override {
    return shared_->broadcast_async(DevPtr<void>(data), count, dt, root);
  }
  CommHandle start_send(const void* data, int64_t count, DType dt, int dst, int tag) override {
    return shared_->send_async(data, count, dt, dst, tag);
  }
  CommHandle start_recv(void* data, int64_t count, DType dt, int src, int tag) override {
    return shared_->recv_async(DevPtr<void>(data), count, dt, src, tag);
  }
  CommHandle start_barrier() override { return shared_->barrier_async(); }

 private:
  std::shared_ptr<Communicator> shared_;
  std::string name_;
};

}  // namespace

ProcessGroups with_device_communicators(const ProcessGroups& groups, const Exec& ex) {
  ProcessGroups out = groups;
  if (ex.on_cpu()) return out;  // the host's communicators move the CPU backend's memory
  MOE_CHECK(groups.world().comm != nullptr,
            "[parallel] the device communicators are bootstrapped through the host's: call "
            "connect_communicators() first");
  const double timeout_s = groups.layout().config.timeout_seconds();
  // In the same order on every rank (the world, then the kinds): the members of a list reach
  // its creation together, as with MPI_Comm_split (a list first seen at kind k is first seen at
  // kind k by each of its members: an earlier kind's group of one member is the list itself
  // exactly when it is for all of them).
  std::map<std::vector<int>, std::shared_ptr<Communicator>> shared;
  const auto connect = [&](ProcessGroup& g) {
    std::shared_ptr<Communicator>& c = shared[g.ranks];
    if (c == nullptr) {
      if (g.size() == 1) {
        c = std::make_shared<DeviceLocalCommunicator>(g.name, g.ranks[0], ex);
      } else {
        c = std::shared_ptr<Communicator>(make_nccl_communicator(g.communicator(), ex, timeout_s));
      }
    }
    g.device_comm = std::make_shared<GroupView>(c, g.name);
  };
  connect(out.world());
  for (GroupKind k : kAllGroupKinds) connect(out.group(k));
  return out;
}

}  // namespace moecore::parallel
