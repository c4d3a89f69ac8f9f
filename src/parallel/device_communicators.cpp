// The device's communicators of a run's process groups (process_groups.h,
// with_device_communicators): NCCL on a CUDA context, one per distinct member list and shared by
// the groups with those members, each group seeing it through a view with its own name and
// counters; a group of one rank copies on the context's stream.
#include <map>

#include "core/check.h"
#include "parallel/communicator_nccl.h"
#include "parallel/process_groups.h"

namespace moecore::parallel {

namespace {

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
        c = make_local_communicator(g.name, g.ranks[0], ex);
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
