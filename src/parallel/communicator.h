// The communicator of one process group: the collectives every parallel feature uses, blocking
// and non-blocking, typed for f32, bf16, f64, i32 and i64. Backends implement the protected
// start_* functions (Open MPI now, NCCL later, a one-rank local one for single-process runs);
// the public functions check the arguments the same way for all of them.
//
// Semantics (all counts in elements, all ranks and roots are ranks *within the group*):
// - bf16 reductions are computed in f32 and rounded once at the end.
// - v-variants take one count per group member; pieces are packed back to back in rank order.
// - A non-blocking call returns a CommHandle; its buffers must stay untouched until wait()
//   (or a test() that returned true). Dropping a pending handle waits for it.
// - Every wait is bounded by the group's timeout; past it the backend prints which group, which
//   call, which rank is waiting and what the other members are doing, then aborts the job.
#pragma once

#include <cstdint>
#include <memory>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "core/dev_ptr.h"
#include "core/dtype.h"
#include "core/exec.h"

namespace moecore::parallel {

enum class ReduceOp : uint8_t { Sum, Max };

std::string_view reduce_op_name(ReduceOp op);

// One in-flight operation of a backend.
class CommRequest {
 public:
  virtual ~CommRequest() = default;
  // Makes progress; true once the operation is complete and its results are in place.
  virtual bool test() = 0;
  // Blocks until complete (bounded by the timeout: reports and aborts past it).
  virtual void wait() = 0;
  // The operation's results are next read by ops on `ex`'s stream. A stream-ordered backend
  // makes that stream wait for the operation and returns at once (false: the host did not
  // wait); a backend progressed by the host (MPI) completes it here (true).
  virtual bool wait_on(const Exec& ex) {
    wait();
    return true;
  }
  // Called once the handle is done with it: a backend may keep its requests for reuse (nothing
  // allocates per call once the pool holds as many as are ever in flight).
  virtual void release() { delete this; }
  struct Release {
    void operator()(CommRequest* r) const { r->release(); }
  };
};
using CommRequestPtr = std::unique_ptr<CommRequest, CommRequest::Release>;

// The handle of a non-blocking operation. Default-constructed = already complete.
class CommHandle {
 public:
  CommHandle() = default;
  explicit CommHandle(CommRequestPtr req) : req_(std::move(req)) {}
  CommHandle(CommHandle&&) noexcept = default;
  CommHandle& operator=(CommHandle&& other) noexcept;
  CommHandle(const CommHandle&) = delete;
  CommHandle& operator=(const CommHandle&) = delete;
  // A pending handle is waited for: the backend may still write into the caller's buffers.
  ~CommHandle();

  // The host needs the result (it reads it, or sizes a later call from it): a host sync. Inside
  // a training step only a documented sync point (SyncAudit::Point) may do this.
  void wait();
  // The result is next read by ops on ex's stream: ordered on that stream where the backend
  // can (NCCL); completed on the host where it cannot (MPI: counted as SyncAudit::kHostCommWait).
  void wait_on(const Exec& ex);
  bool test();
  bool done() const { return req_ == nullptr; }

 private:
  void finish_or_die() noexcept;
  CommRequestPtr req_;
};

// Bytes one member of a group has sent, by collective form, since the communicator was made.
// The collectives are counted as the ring algorithm moves them (what NCCL runs at these sizes
// and what `moecore plan` models), whatever the backend does, so that every backend reports the
// same figure: with g members and pieces c_0 .. c_{g-1} bytes (M = their sum),
// - all-gather: member r forwards every piece but its successor's: M - c_{(r+1) mod g}
//   (M (g-1)/g for equal pieces);
// - reduce-scatter: member r sends a partial sum of every piece but its own: M - c_r;
// - all-reduce of M bytes: a reduce-scatter and an all-gather of the buffer cut into g chunks
//   (count / g elements, the first count mod g chunks one more): 2 M (g-1)/g when g divides the
//   count;
// - all-to-all: the blocks sent to the other members (its own block is a local copy);
// - send: the point-to-point messages' bytes (the pipeline's activations and gradients).
// One member sends nothing.
struct CommBytesSent {
  int64_t all_gather = 0;
  int64_t reduce_scatter = 0;
  int64_t all_reduce = 0;
  int64_t all_to_all = 0;
  int64_t send = 0;
  int64_t total() const { return all_gather + reduce_scatter + all_reduce + all_to_all + send; }
  CommBytesSent operator-(const CommBytesSent& o) const {
    return {all_gather - o.all_gather, reduce_scatter - o.reduce_scatter,
            all_reduce - o.all_reduce, all_to_all - o.all_to_all, send - o.send};
  }
};

// Calls this member has made, by collective form (a v-variant counts with its form), since the
// communicator was made. Read around a phase, the difference says what it issued: the trainer's
// per-step tp_calls / expt_tp_calls (collectives()), and a test of a phase that must not
// communicate on a group (a checkpoint save moves no tensor data: only its protocol's
// agreements, on the world).
struct CommCalls {
  int64_t all_reduce = 0;
  int64_t all_gather = 0;
  int64_t reduce_scatter = 0;
  int64_t all_to_all = 0;
  int64_t broadcast = 0;
  int64_t send = 0;
  int64_t recv = 0;
  int64_t barrier = 0;
  int64_t total() const {
    return all_reduce + all_gather + reduce_scatter + all_to_all + broadcast + send + recv +
           barrier;
  }
  // The collectives (all-reduce, all-gather(_v), reduce-scatter(_v), all-to-all-v, broadcast;
  // not send / recv / barrier): the trainer's tp_calls and expt_tp_calls.
  int64_t collectives() const {
    return all_reduce + all_gather + reduce_scatter + all_to_all + broadcast;
  }
  CommCalls operator-(const CommCalls& o) const {
    return {all_reduce - o.all_reduce,
            all_gather - o.all_gather,
            reduce_scatter - o.reduce_scatter,
            all_to_all - o.all_to_all,
            broadcast - o.broadcast,
            send - o.send,
            recv - o.recv,
            barrier - o.barrier};
  }
  bool operator==(const CommCalls&) const = default;
};

template <typename R>
concept CommBuffer = std::ranges::contiguous_range<R> && std::ranges::sized_range<R>;

template <typename R>
using CommElem = std::remove_cv_t<std::ranges::range_value_t<R>>;

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;  // position of this process in the group
  virtual int size() const = 0;
  virtual const std::string& name() const = 0;               // "tp", "ep", "world", ...
  virtual const std::vector<int>& global_ranks() const = 0;  // world rank of each member

  // ---- untyped (runtime dtype) non-blocking operations ----
  // In place: data[i] = op over ranks of data[i].
  CommHandle all_reduce_async(DevPtr<void> data, int64_t count, DType dt, ReduceOp op);
  // recv = concat over ranks of send (count elements each).
  CommHandle all_gather_async(DevPtr<const void> send, DevPtr<void> recv, int64_t count, DType dt);
  // recv = concat over ranks r of send_r, where send_r has counts[r] elements.
  CommHandle all_gather_v_async(DevPtr<const void> send, DevPtr<void> recv,
                                std::span<const int64_t> counts, DType dt);
  // recv (count elements) = op over ranks of send[rank*count, (rank+1)*count).
  CommHandle reduce_scatter_async(DevPtr<const void> send, DevPtr<void> recv, int64_t count,
                                  DType dt, ReduceOp op);
  // recv (counts[rank] elements) = op over ranks of this rank's piece of send (sum(counts)).
  // In place (NCCL's convention, both reduce-scatter forms): recv may be this rank's own slot
  // of send, recv = send + (the counts of the ranks before this one); the result then lands in
  // that slot, and the rest of send is left undefined (a backend may use it as scratch).
  CommHandle reduce_scatter_v_async(DevPtr<const void> send, DevPtr<void> recv,
                                    std::span<const int64_t> counts, DType dt, ReduceOp op);
  // send holds send_counts[r] elements for each rank r in order; recv gets recv_counts[r] from
  // each rank r in order. recv_counts[r] must equal rank r's send_counts[this rank].
  CommHandle all_to_all_v_async(DevPtr<const void> send, std::span<const int64_t> send_counts,
                                DevPtr<void> recv, std::span<const int64_t> recv_counts, DType dt);
  CommHandle broadcast_async(DevPtr<void> data, int64_t count, DType dt, int root);
  CommHandle send_async(DevPtr<const void> data, int64_t count, DType dt, int dst, int tag = 0);
  CommHandle recv_async(DevPtr<void> data, int64_t count, DType dt, int src, int tag = 0);
  CommHandle barrier_async();

  // Bytes this member's all_to_all_v calls have sent to the other members (its own block, a
  // local copy, not counted), since the communicator was made: the EP dispatchers' traffic,
  // which the trainer reports per step and `moecore plan` predicts.
  int64_t all_to_all_bytes_sent() const { return bytes_sent_.all_to_all; }
  // Every collective form's bytes sent by this member (CommBytesSent: the ring algorithm's
  // figures), since the communicator was made: the TP / SP / ETP collectives' traffic, which the
  // trainer can report per step (the difference of two readings) and `moecore plan` predicts.
  const CommBytesSent& bytes_sent() const { return bytes_sent_; }
  // Calls this member has made per form (CommCalls), since the communicator was made: what a
  // step issues on a group is the difference of two readings (the trainer's metrics report
  // calls().collectives() of the TP groups per step; a test counts the calls of a phase).
  const CommCalls& calls() const { return calls_; }
  // The algorithm behind all_reduce and reduce_scatter(_v): the MPI backend's own ring ("ring",
  // the default) or Open MPI's non-blocking MPI_Iallreduce / MPI_Ireduce_scatter ("libnbc",
  // MOECORE_MPI_REDUCTIONS=libnbc); "native" elsewhere (NCCL's own; "local" for a group of one).
  virtual std::string_view reduction_algorithm() const { return "native"; }

  // ---- blocking untyped ----
  void all_reduce(DevPtr<void> data, int64_t count, DType dt, ReduceOp op) {
    all_reduce_async(data, count, dt, op).wait();
  }
  void barrier() { barrier_async().wait(); }

  // ---- typed (any contiguous range: std::vector, std::span, ...) ----
  template <CommBuffer R>
  CommHandle all_reduce_async(R&& data, ReduceOp op = ReduceOp::Sum) {
    return all_reduce_async(std::ranges::data(data), n(data), dtype_of<R>(), op);
  }
  template <CommBuffer R>
  void all_reduce(R&& data, ReduceOp op = ReduceOp::Sum) {
    all_reduce_async(data, op).wait();
  }
  template <CommBuffer S, CommBuffer R>
  CommHandle all_gather_async(const S& send, R&& recv) {
    same_type<S, R>();
    check_recv_size(n(recv), n(send) * size(), "all_gather");
    return all_gather_async(std::ranges::data(send), std::ranges::data(recv), n(send),
                            dtype_of<R>());
  }
  template <CommBuffer S, CommBuffer R>
  void all_gather(const S& send, R&& recv) {
    all_gather_async(send, recv).wait();
  }
  template <CommBuffer S, CommBuffer R>
  CommHandle all_gather_v_async(const S& send, R&& recv, std::span<const int64_t> counts) {
    same_type<S, R>();
    check_v_sizes(n(send), n(recv), counts, "all_gather_v", /*gather=*/true);
    return all_gather_v_async(std::ranges::data(send), std::ranges::data(recv), counts,
                              dtype_of<R>());
  }
  template <CommBuffer S, CommBuffer R>
  void all_gather_v(const S& send, R&& recv, std::span<const int64_t> counts) {
    all_gather_v_async(send, recv, counts).wait();
  }
  template <CommBuffer S, CommBuffer R>
  CommHandle reduce_scatter_async(const S& send, R&& recv, ReduceOp op = ReduceOp::Sum) {
    same_type<S, R>();
    check_recv_size(n(send), n(recv) * size(), "reduce_scatter (send)");
    return reduce_scatter_async(std::ranges::data(send), std::ranges::data(recv), n(recv),
                                dtype_of<R>(), op);
  }
  template <CommBuffer S, CommBuffer R>
  void reduce_scatter(const S& send, R&& recv, ReduceOp op = ReduceOp::Sum) {
    reduce_scatter_async(send, recv, op).wait();
  }
  template <CommBuffer S, CommBuffer R>
  CommHandle reduce_scatter_v_async(const S& send, R&& recv, std::span<const int64_t> counts,
                                    ReduceOp op = ReduceOp::Sum) {
    same_type<S, R>();
    check_v_sizes(n(recv), n(send), counts, "reduce_scatter_v", /*gather=*/false);
    return reduce_scatter_v_async(std::ranges::data(send), std::ranges::data(recv), counts,
                                  dtype_of<R>(), op);
  }
  template <CommBuffer S, CommBuffer R>
  void reduce_scatter_v(const S& send, R&& recv, std::span<const int64_t> counts,
                        ReduceOp op = ReduceOp::Sum) {
    reduce_scatter_v_async(send, recv, counts, op).wait();
  }
  template <CommBuffer S, CommBuffer R>
  CommHandle all_to_all_v_async(const S& send, std::span<const int64_t> send_counts, R&& recv,
                                std::span<const int64_t> recv_counts) {
    same_type<S, R>();
    check_recv_size(n(send), sum_counts(send_counts, "all_to_all_v send"), "all_to_all_v send");
    check_recv_size(n(recv), sum_counts(recv_counts, "all_to_all_v recv"), "all_to_all_v recv");
    return all_to_all_v_async(std::ranges::data(send), send_counts, std::ranges::data(recv),
                              recv_counts, dtype_of<R>());
  }
  template <CommBuffer S, CommBuffer R>
  void all_to_all_v(const S& send, std::span<const int64_t> send_counts, R&& recv,
                    std::span<const int64_t> recv_counts) {
    all_to_all_v_async(send, send_counts, recv, recv_counts).wait();
  }
  template <CommBuffer R>
  CommHandle broadcast_async(R&& data, int root) {
    return broadcast_async(std::ranges::data(data), n(data), dtype_of<R>(), root);
  }
  template <CommBuffer R>
  void broadcast(R&& data, int root) {
    broadcast_async(data, root).wait();
  }
  template <CommBuffer R>
  CommHandle send_async(const R& data, int dst, int tag = 0) {
    return send_async(std::ranges::data(data), n(data), dtype_of<R>(), dst, tag);
  }
  template <CommBuffer R>
  void send(const R& data, int dst, int tag = 0) {
    send_async(data, dst, tag).wait();
  }
  template <CommBuffer R>
  CommHandle recv_async(R&& data, int src, int tag = 0) {
    return recv_async(std::ranges::data(data), n(data), dtype_of<R>(), src, tag);
  }
  template <CommBuffer R>
  void recv(R&& data, int src, int tag = 0) {
    recv_async(data, src, tag).wait();
  }

 protected:
  // Backend hooks, called after the arguments were checked. Counts fit in int64 and are >= 0.
  virtual CommHandle start_all_reduce(void* data, int64_t count, DType dt, ReduceOp op) = 0;
  virtual CommHandle start_all_gather_v(const void* send, void* recv,
                                        std::span<const int64_t> counts, bool equal, DType dt) = 0;
  virtual CommHandle start_reduce_scatter_v(const void* send, void* recv,
                                            std::span<const int64_t> counts, bool equal, DType dt,
                                            ReduceOp op) = 0;
  virtual CommHandle start_all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                                        void* recv, std::span<const int64_t> recv_counts,
                                        DType dt) = 0;
  virtual CommHandle start_broadcast(void* data, int64_t count, DType dt, int root) = 0;
  virtual CommHandle start_send(const void* data, int64_t count, DType dt, int dst, int tag) = 0;
  virtual CommHandle start_recv(void* data, int64_t count, DType dt, int src, int tag) = 0;
  virtual CommHandle start_barrier() = 0;

 private:
  template <typename R>
  static int64_t n(const R& r) {
    return static_cast<int64_t>(std::ranges::size(r));
  }
  template <typename R>
  static constexpr DType dtype_of() {
    return DTypeOf<CommElem<R>>::value;
  }
  template <typename S, typename R>
  static constexpr void same_type() {
    static_assert(std::is_same_v<CommElem<S>, CommElem<R>>,
                  "send and recv buffers must have the same element type");
  }
  void check_counts(std::span<const int64_t> counts, const char* call) const;
  int64_t sum_counts(std::span<const int64_t> counts, const char* call) const;
  void check_recv_size(int64_t have, int64_t want, const char* call) const;
  void check_v_sizes(int64_t mine, int64_t total, std::span<const int64_t> counts, const char* call,
                     bool gather) const;
  void check_peer(int peer, const char* what, const char* call) const;

  std::vector<int64_t> equal_counts_;  // the equal-count forms' counts, reused per call
  // The ring algorithm's bytes for the counts of one call (CommBytesSent).
  int64_t ring_gather_bytes(std::span<const int64_t> counts, DType dt) const;
  int64_t ring_scatter_bytes(std::span<const int64_t> counts, DType dt) const;
  int64_t ring_all_reduce_bytes(int64_t count, DType dt) const;
  CommBytesSent bytes_sent_;
  CommCalls calls_;
};

// A group of one process: every collective is a local copy. Used for size-1 groups without
// MPI (single-process runs, the stub build) and in tests of the argument checks.
// On a device context (`ex`) its copies are ops on the context's stream: the device's group of
// one rank (parallel::with_device_communicators).
std::unique_ptr<Communicator> make_local_communicator(std::string name, int global_rank,
                                                     const Exec& ex = cpu_exec());

}  // namespace moecore::parallel
