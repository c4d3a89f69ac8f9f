// The NCCL communicator (parallel/communicator_nccl.h): each collective's NCCL calls from its
// descriptor (ops/desc/nccl_desc.h), run on the communicator's own stream between an event of
// the caller's stream (the inputs are ready) and an event the handle waits on. A bf16 reduction
// runs in f32 device staging (the plan's stage_bf16): widened by the cast kernel, reduced, and
// rounded once into recv, all on that stream; the staging grows on that stream too
// (stream-ordered free and allocation: no host wait). A wait past the timeout (a handle's, or the
// destructor's for the stream) aborts every NCCL communicator of the process (a rank stuck in one
// collective can hold the others' peers) and ends the process naming the group and the call. send_async / recv_async are collected and
// issued together inside one ncclGroupStart / ncclGroupEnd (nccl_p2p_batch.h): an ungrouped
// ncclSend would block the stream until the peer's receive, and the pairs the callers post
// (send to one neighbour, then receive from the other) would wait for ever.
//
// CUDA graphs (--cuda-graph-impl full_iteration, docs/gpu.md "CUDA graphs"): a call made while
// the caller's stream is being captured is captured with it (NCCL >= 2.9): the event recorded on
// the caller's stream and waited on by the communicator's forks that stream into the capture,
// and the handle's wait_on joins it back. Nothing of a call reads the host per step (the plan's
// counts and addresses are the call's arguments, frozen as the eager path's are), and what would
// break a capture is made by the warm-up steps or refused by name: the bf16 staging grows only
// eagerly (its growth synchronises the stream and allocates: refused while capturing, which a
// warm-up step of the same collectives prevents), the events and requests pools are filled by
// the warm-up, and a call issued before the capture cannot be ordered inside it.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "core/check.h"
#include "core/sync_audit.h"
#include "ops/cast.h"
#include "ops/desc/nccl_desc.h"
#include "parallel/communicator_nccl.h"
#include "parallel/nccl_p2p_batch.h"

namespace moecore::parallel {

bool nccl_built() { return true; }

namespace {

using ops::desc::NcclAddr;
using ops::desc::NcclBuf;
using ops::desc::NcclCall;
using ops::desc::NcclKind;
using ops::desc::NcclPlan;
using ops::desc::NcclRedOp;

void cuda_ok(cudaError_t e, const std::string& group, const char* what) {
  MOE_CHECK(e == cudaSuccess, "[comm] group '{}': {} failed: {}", group, what,
            cudaGetErrorString(e));
}
void nccl_ok(ncclResult_t r, const std::string& group, const char* what) {
  MOE_CHECK(r == ncclSuccess, "[comm] group '{}': {} failed: {}", group, what,
            ncclGetErrorString(r));
}

// The live NCCL communicators of the process: a timeout aborts all of them, so that no peer
// stays blocked in a collective of another group on a communicator this rank leaves behind.
struct LiveComms {
  std::mutex mu;
  std::vector<ncclComm_t> comms;
};
LiveComms& live_comms() {
  static LiveComms* l = new LiveComms;  // never destroyed: a timeout may come at any time
  return *l;
}
void register_comm(ncclComm_t c) {
  LiveComms& l = live_comms();
  std::lock_guard<std::mutex> lock(l.mu);
  l.comms.push_back(c);
}
void unregister_comm(ncclComm_t c) {
  LiveComms& l = live_comms();
  std::lock_guard<std::mutex> lock(l.mu);
  std::erase(l.comms, c);
}
// ncclCommAbort on each (without the lock held for long: each abort returns once its kernels are
// stopped); the caller then ends the process.
void abort_live_comms() {
  LiveComms& l = live_comms();
  std::vector<ncclComm_t> all;
  {
    std::lock_guard<std::mutex> lock(l.mu);
    all.swap(l.comms);
  }
  for (ncclComm_t c : all) ncclCommAbort(c);
}

class NcclCommunicator;

// One collective in flight: the event recorded after its calls on the communicator's stream
// (none yet for a point-to-point operation still in the batch: issuing the batch records it).
class NcclRequest final : public CommRequest {
 public:
  NcclRequest(NcclCommunicator* c, cudaEvent_t done, const char* call)
      : comm_(c), done_(done), call_(call) {}
  void reset(cudaEvent_t done, const char* call) {
    done_ = done;
    call_ = call;
  }
  void set_done(cudaEvent_t done) { done_ = done; }
  void set_captured(bool c) { captured_ = c; }
  bool test() override;
  void wait() override;
  // Ordered on the reader's stream: it waits for the event; the host does not.
  bool wait_on(const Exec& ex) override;
  void release() override;

 private:
  NcclCommunicator* comm_;
  cudaEvent_t done_;
  const char* call_;
  bool captured_ = false;  // issued while the caller's stream was being captured
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(Communicator& bootstrap, const Exec& ex, double timeout_s)
      : name_(bootstrap.name()),
        ranks_(bootstrap.global_ranks()),
        rank_(bootstrap.rank()),
        caller_(static_cast<cudaStream_t>(ex.stream)),
        timeout_s_(timeout_s) {
    MOE_CHECK(ex.device == Device::CUDA, "[comm] group '{}': the NCCL communicator needs a CUDA "
              "context, not {}", name_, device_name(ex.device));
    // NCCL's unique id travels from rank 0 through the bootstrap communicator (host memory).
    ncclUniqueId id{};
    std::vector<int32_t> bytes((sizeof(id) + 3) / 4, 0);
    if (rank_ == 0) {
      nccl_ok(ncclGetUniqueId(&id), name_, "ncclGetUniqueId");
      std::memcpy(bytes.data(), &id, sizeof(id));
    }
    bootstrap.broadcast(bytes, 0);
    std::memcpy(&id, bytes.data(), sizeof(id));
    nccl_ok(ncclCommInitRank(&comm_, bootstrap.size(), id, rank_), name_, "ncclCommInitRank");
    register_comm(comm_);
    cuda_ok(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), name_,
            "cudaStreamCreate");
    cuda_ok(cudaMalloc(&barrier_, sizeof(int32_t)), name_, "cudaMalloc (barrier word)");
    cuda_ok(cudaMemset(barrier_, 0, sizeof(int32_t)), name_, "cudaMemset (barrier word)");
  }
  ~NcclCommunicator() override {
    // The collectives still on the stream finish before their buffers and the communicator go;
    // a stream that never drains (a peer that never reached a collective) is the watchdog's, as
    // a wait on a handle is: bounded by the group's timeout, then reported and aborted. Otherwise
    // best effort: a failing teardown must not throw from a destructor.
    wait_for_own_stream("the destructor's wait for the communicator's stream");
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    for (NcclRequest* r : requests_) delete r;
    cudaFree(barrier_);
    if (staging_ != nullptr) cudaFreeAsync(staging_, stream_);  // stream-ordered, as allocated
    unregister_comm(comm_);
    ncclCommDestroy(comm_);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(ranks_.size()); }
  const std::string& name() const override { return name_; }
  const std::vector<int>& global_ranks() const override { return ranks_; }

  cudaStream_t stream() const { return stream_; }
  void give_back(cudaEvent_t e) { events_.push_back(e); }
  // Past the timeout: which group, which call; every NCCL communicator of the process is
  // aborted, then the process ends (as MPI's timeout does; mpirun then ends the others).
  [[noreturn]] void abort_on_timeout(const char* call, double waited) {
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(comm_, &async);
    std::fprintf(stderr,
                 "error: [comm] timeout: rank %d of %d in group '%s' (world rank %d) waited %.1f s "
                 "in %s, over the %.1f s limit (--distributed-timeout-minutes); NCCL's state: %s; "
                 "aborting every NCCL communicator of this process and ending it\n",
                 rank_, size(), name_.c_str(), ranks_[rank_], waited, call, timeout_s_,
                 ncclGetErrorString(async));
    std::fflush(stderr);
    abort_live_comms();
    std::abort();
  }
  double timeout_s() const { return timeout_s_; }

  // Polls the communicator's stream (cudaStreamQuery, never a blocking synchronize) until it has
  // run what was enqueued; past the group's timeout, abort_on_timeout names the group and `call`.
  void wait_for_own_stream(const char* call) {
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      const cudaError_t e = cudaStreamQuery(stream_);
      if (e != cudaErrorNotReady) return;  // done, or failed: nothing left to wait for
      const double waited =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (waited > timeout_s_) abort_on_timeout(call, waited);
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 protected:
  CommHandle start_all_reduce(void* data, int64_t count, DType dt, ReduceOp op) override {
    ops::desc::nccl_all_reduce(plan_, count, dt, red_op(op));
    return run(plan_, data, data, dt, "all_reduce");
  }
  CommHandle start_all_gather_v(const void* send, void* recv, std::span<const int64_t> counts,
                                bool equal, DType dt) override {
    ops::desc::nccl_all_gather_v(plan_, rank_, counts, equal, dt);
    return run(plan_, send, recv, dt,
               "all_gather");
  }
  CommHandle start_reduce_scatter_v(const void* send, void* recv, std::span<const int64_t> counts,
                                    bool equal, DType dt, ReduceOp op) override {
    ops::desc::nccl_reduce_scatter_v(plan_, rank_, counts, equal, dt, red_op(op));
    return run(plan_, send, recv,
               dt, "reduce_scatter");
  }
  CommHandle start_all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                                void* recv, std::span<const int64_t> recv_counts,
                                DType dt) override {
    ops::desc::nccl_all_to_all_v(plan_, rank_, send_counts, recv_counts, dt);
    return run(plan_, send, recv, dt,
               "all_to_all_v");
  }
  CommHandle start_broadcast(void* data, int64_t count, DType dt, int root) override {
    ops::desc::nccl_broadcast(plan_, count, dt, root);
    return run(plan_, data, data, dt, "broadcast");
  }
  // NCCL has no tags: a pair's messages match in the order they were posted. Collected, not
  // issued (nccl_p2p_batch.h); the stream waits for the caller's stream here, so the group reads
  // and writes the buffers after what the caller enqueued before this call.
  CommHandle start_send(const void* data, int64_t count, DType dt, int dst, int) override {
    return collect(NcclKind::Send, data, nullptr, count, dt, dst, "send");
  }
  CommHandle start_recv(void* data, int64_t count, DType dt, int src, int) override {
    return collect(NcclKind::Recv, nullptr, data, count, dt, src, "recv");
  }
  CommHandle start_barrier() override {
    ops::desc::nccl_all_reduce(plan_, 1, DType::I32, NcclRedOp::Sum);
    return run(plan_, barrier_, barrier_,
               DType::I32, "barrier");
  }

 private:
  static NcclRedOp red_op(ReduceOp op) { return op == ReduceOp::Sum ? NcclRedOp::Sum : NcclRedOp::Max; }
  // The caller's stream reached this call: the communicator's stream waits for it.
  void after_caller() {
    cudaEvent_t ready = event();
    cuda_ok(cudaEventRecord(ready, caller_), name_, "cudaEventRecord");
    cuda_ok(cudaStreamWaitEvent(stream_, ready, 0), name_, "cudaStreamWaitEvent");
    give_back(ready);  // reusable once recorded: the wait is already enqueued
  }

  CommHandle collect(NcclKind kind, const void* send, void* recv, int64_t count, DType dt,
                     int peer, const char* call) {
    after_caller();
    NcclRequest* r = request(nullptr, call);
    r->set_captured(capturing());
    batch_.add({kind, send, recv, count, dt, peer, r});
    return CommHandle(CommRequestPtr(r));
  }

 public:
  // The collected sends and receives as one NCCL group on the stream; each handle's event is
  // recorded after the group (one event each: a handle gives its own back).
  void issue_p2p() {
    batch_.issue([this](std::span<const NcclP2pBatch<NcclRequest>::Op> ops) {
      nccl_ok(ncclGroupStart(), name_, "ncclGroupStart");
      for (const auto& op : ops) {
        if (op.count == 0) continue;
        const auto t =
            static_cast<ncclDataType_t>(static_cast<int>(ops::desc::nccl_data_type(op.dt)));
        const size_t n = static_cast<size_t>(op.count);
        nccl_ok(op.kind == NcclKind::Send ? ncclSend(op.send, n, t, op.peer, comm_, stream_)
                                          : ncclRecv(op.recv, n, t, op.peer, comm_, stream_),
                name_, op.kind == NcclKind::Send ? "send" : "recv");
      }
      nccl_ok(ncclGroupEnd(), name_, "ncclGroupEnd");
      for (const auto& op : ops) {
        cudaEvent_t done = event();
        cuda_ok(cudaEventRecord(done, stream_), name_, "cudaEventRecord");
        op.req->set_done(done);
      }
    });
  }

 private:
  cudaEvent_t event() {
    if (!events_.empty()) {
      cudaEvent_t e = events_.back();
      events_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    cuda_ok(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), name_, "cudaEventCreate");
    return e;
  }

  // f32 device staging of at least `elems` elements: grown (never shrunk) when a larger bf16
  // reduction comes, so a training step, once its largest one has run, allocates nothing. Only
  // the communicator's stream touches the staging, so growth is ordered on that stream and the
  // host never waits for it: the old block is freed after the collectives in flight that read
  // it (cudaFreeAsync), the new one allocated before the next (cudaMallocAsync).
  float* staging(int64_t elems) {
    if (elems <= staging_elems_) return staging_;
    // The growth synchronises the stream and allocates: neither can be captured. The warm-up
    // steps run the captured step's reductions, so a capture never gets here.
    SyncAudit::instance().device_allocation(
        fmt::format("the bf16 reduction staging of NCCL group '{}' (grown to {} f32 elements)",
                    name_, elems)
            .c_str(),
        static_cast<size_t>(elems) * sizeof(float));
    if (staging_ != nullptr) {
      cuda_ok(cudaFreeAsync(staging_, stream_), name_, "cudaFreeAsync (staging growth)");
      staging_ = nullptr;
    }
    void* p = nullptr;
    cuda_ok(cudaMallocAsync(&p, static_cast<size_t>(elems) * sizeof(float), stream_), name_,
            "cudaMallocAsync (bf16 reduction staging)");
    staging_ = static_cast<float*>(p);
    staging_elems_ = elems;
    return staging_;
  }

  // The plan's calls on the communicator's stream, after the caller's stream reached this call.
  // The point-to-point operations collected before go on the stream first.
  CommHandle run(const NcclPlan& plan, const void* send, void* recv, DType dt, const char* call) {
    MOE_CHECK(!plan.stage_bf16 || dt == DType::BF16,
              "[comm] group '{}': {} of {} with a bf16-staged plan", name_, call, dtype_name(dt));
    issue_p2p();
    after_caller();
    // The buffers the calls address: the caller's, or for a bf16 reduction the f32 staging, laid
    // out as the caller's are (one block when send and recv overlap: the in-place forms).
    size_t esize = dtype_size(dt);
    const char* call_send = static_cast<const char*>(send);
    char* call_recv = static_cast<char*>(recv);
    int64_t recv_at = 0;
    if (plan.stage_bf16) {
      const auto* sb = static_cast<const char*>(send);
      auto* rb = static_cast<char*>(recv);
      const int64_t se = sb != nullptr ? plan.send_elems : 0;
      const int64_t re = rb != nullptr ? plan.recv_elems : 0;
      const int64_t sbytes = se * 2, rbytes = re * 2;
      int64_t send_at = 0, total = 0;
      const bool overlap = se > 0 && re > 0 && sb < rb + rbytes && rb < sb + sbytes;
      float* st = nullptr;
      if (overlap) {
        const char* lo = std::min<const char*>(sb, rb);
        const char* hi = std::max<const char*>(sb + sbytes, rb + rbytes);
        MOE_CHECK((sb - lo) % 2 == 0 && (rb - lo) % 2 == 0,
                  "[comm] group '{}': {}: send and recv overlap at an odd byte offset", name_,
                  call);
        send_at = (sb - lo) / 2;
        recv_at = (rb - lo) / 2;
        total = (hi - lo) / 2;
        st = staging(total);
        ops::cuda::cast_bf16_to_f32(stream_, st, reinterpret_cast<const bf16*>(lo), total);
      } else {
        send_at = 0;
        recv_at = se;
        total = se + re;
        st = staging(total);
        ops::cuda::cast_bf16_to_f32(stream_, st, reinterpret_cast<const bf16*>(sb), se);
      }
      call_send = reinterpret_cast<const char*>(st + send_at);
      call_recv = reinterpret_cast<char*>(st + recv_at);
      esize = sizeof(float);
    }
    const auto at = [&](NcclAddr a) -> char* {
      char* base = a.buf == NcclBuf::Send ? const_cast<char*>(call_send) : call_recv;
      return base == nullptr ? nullptr : base + a.off * static_cast<int64_t>(esize);
    };
    if (plan.grouped) nccl_ok(ncclGroupStart(), name_, "ncclGroupStart");
    for (const NcclCall& c : plan.calls) {
      const auto t = static_cast<ncclDataType_t>(static_cast<int>(c.dtype));
      const auto op = static_cast<ncclRedOp_t>(static_cast<int>(c.op));
      const size_t n = static_cast<size_t>(c.count);
      ncclResult_t r = ncclSuccess;
      switch (c.kind) {
        case NcclKind::AllReduce: r = ncclAllReduce(at(c.send), at(c.recv), n, t, op, comm_, stream_); break;
        case NcclKind::AllGather: r = ncclAllGather(at(c.send), at(c.recv), n, t, comm_, stream_); break;
        case NcclKind::ReduceScatter:
          r = ncclReduceScatter(at(c.send), at(c.recv), n, t, op, comm_, stream_);
          break;
        case NcclKind::Broadcast:
          r = ncclBroadcast(at(c.send), at(c.recv), n, t, c.peer, comm_, stream_);
          break;
        case NcclKind::Reduce: r = ncclReduce(at(c.send), at(c.recv), n, t, op, c.peer, comm_, stream_); break;
        case NcclKind::Send: r = ncclSend(at(c.send), n, t, c.peer, comm_, stream_); break;
        case NcclKind::Recv: r = ncclRecv(at(c.recv), n, t, c.peer, comm_, stream_); break;
      }
      nccl_ok(r, name_, call);
    }
    if (plan.grouped) nccl_ok(ncclGroupEnd(), name_, "ncclGroupEnd");
    if (plan.stage_bf16 && recv != nullptr) {  // rounded once, into the caller's recv
      ops::cuda::cast_f32_to_bf16(stream_, static_cast<bf16*>(recv),
                                  reinterpret_cast<const float*>(call_recv), plan.recv_elems);
    }
    cudaEvent_t done = event();
    cuda_ok(cudaEventRecord(done, stream_), name_, "cudaEventRecord");
    NcclRequest* r = request(done, call);
    r->set_captured(capturing());
    return CommHandle(CommRequestPtr(r));
  }

 public:
  // Whether the caller's stream is being captured (the calls then go into its graph).
  bool capturing() const {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    cuda_ok(cudaStreamIsCapturing(caller_, &st), name_, "cudaStreamIsCapturing");
    return st != cudaStreamCaptureStatusNone;
  }

 private:

  // The plan of the call being started, reused (its capacity kept: nothing allocates per call).
  NcclPlan plan_;
  std::string name_;
  std::vector<int> ranks_;
  int rank_ = 0;
  cudaStream_t caller_ = nullptr;
  double timeout_s_ = 0;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  int32_t* barrier_ = nullptr;
  float* staging_ = nullptr;  // bf16 reductions' f32 staging (staging())
  int64_t staging_elems_ = 0;
  std::vector<cudaEvent_t> events_;  // recorded and waited for: reusable
  NcclP2pBatch<NcclRequest> batch_;  // send_async / recv_async not yet issued
  // Requests given back (NcclRequest::release): reused, so a step allocates none once the pool
  // holds as many as are ever in flight.
  std::vector<NcclRequest*> requests_;

 public:
  NcclRequest* request(cudaEvent_t done, const char* call);
  void give_back(NcclRequest* r) { requests_.push_back(r); }
  void forget(NcclRequest* r) { batch_.forget(r); }
};

// Testing or waiting for any handle issues the collected point-to-point group first (the handle
// may be one of them).
bool NcclRequest::test() {
  comm_->issue_p2p();
  const cudaError_t e = cudaEventQuery(done_);
  if (e == cudaErrorNotReady) return false;
  MOE_CHECK(e == cudaSuccess, "[comm] {} failed on the device: {}", call_, cudaGetErrorString(e));
  return true;
}

void NcclRequest::wait() {
  const auto start = std::chrono::steady_clock::now();
  while (!test()) {
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > comm_->timeout_s()) comm_->abort_on_timeout(call_, waited);
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

bool NcclRequest::wait_on(const Exec& ex) {
  // A call issued before the capture, ordered inside it: the graph would depend on an event of
  // the eager stream, and a replay would not wait for the call at all.
  if (!captured_ && comm_->capturing()) {
    const std::string what =
        fmt::format("NCCL {} on group '{}', issued before the capture began, ordered on the "
                    "captured stream (complete it before the captured region, or issue it inside)",
                    call_, comm_->name());
    SyncAudit::instance().not_capturable(what.c_str());
  }
  comm_->issue_p2p();
  const cudaError_t e = cudaStreamWaitEvent(static_cast<cudaStream_t>(ex.stream), done_, 0);
  MOE_CHECK(e == cudaSuccess, "[comm] {}: cudaStreamWaitEvent failed: {}", call_,
            cudaGetErrorString(e));
  return false;
}

NcclRequest* NcclCommunicator::request(cudaEvent_t done, const char* call) {
  if (requests_.empty()) return new NcclRequest(this, done, call);
  NcclRequest* r = requests_.back();
  requests_.pop_back();
  r->reset(done, call);
  return r;
}

void NcclRequest::release() {
  if (done_ == nullptr) {
    comm_->forget(this);  // given up before its group was issued
  } else {
    comm_->give_back(done_);  // a later record replaces this one; waits already enqueued hold
  }
  comm_->give_back(this);
}

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& bootstrap, const Exec& ex,
                                                     double timeout_s) {
  return std::make_unique<NcclCommunicator>(bootstrap, ex, timeout_s);
}

}  // namespace moecore::parallel
