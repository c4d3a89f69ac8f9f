// The NCCL communicator of the emulated CUDA build (parallel/communicator_nccl.h; in place of
// the real one, src/parallel/communicator_nccl_cuda.cpp): the same NCCL call plans
// (ops/desc/nccl_desc.h) executed over MPI on host staging of the emulated device memory, so that
// `mpirun moecore train --device cuda` runs every layout on the CPU, and a wrong plan gives wrong
// results here as it would on GPUs. Test-only: no other build links it.
//
// Each NcclCall runs as the host collective of a communicator of the same members
// (duplicate_communicator: its own MPI matching space, the MPI backend's ring reductions, so each
// collective's result is bitwise the MPI communicator's on the same values):
//   AllReduce -> all_reduce, AllGather -> all_gather, ReduceScatter -> reduce_scatter,
//   Broadcast -> broadcast, Reduce (root r) -> reduce_scatter_v with only r's count non-zero (the
//   ring sums piece r in the same order as the full reduce-scatter), Send / Recv -> send / recv
//   under one tag (NCCL has none: a pair's messages match in the order they were posted; a rank's
//   messages to itself through a queue of its own).
// Each send goes with a header (its bytes and the caller's tag, which NCCL ignores) and each
// receive answers with its own: a matched pair that differs in either is an error on both sides,
// naming both (NCCL would write the other message into the receive buffer, or fail, and the
// tags, the MPI backend's matching, say the callers meant other messages: the pair was posted in
// different orders). The data is received into the buffer only after its header matched (a
// mismatched message is drained), and the error is thrown by the wait or test of that send or
// receive, so both ranks stay in step.
// The transport's operations are posted when the collective goes on the communicator's stream
// (a group's calls all at once). As on a GPU, where a communicator's operations run in order on
// its stream, an operation completes only after the one before it (completing a handle completes
// the ones before it first), and a receive counts as posted only once it is the stream's turn:
// then it acknowledges its message (under a tag of its own), and a send completes only once
// acknowledged, as NCCL's do. So an ungrouped send followed by a receive on both sides of a pair
// waits for ever here as on GPUs, until the timeout reports it. Every wait progresses every
// emulated communicator of the process, as the streams run on their own. send_async / recv_async
// are collected and posted as one group (nccl_p2p_batch.h), as the real backend does. Device
// memory is copied to host staging (under emu::DeviceAccess) when the collective is called and
// the received range back when it completes; MPI never touches device pages. A bf16-staged plan runs on f32 staging, rounded once into recv.
//
// Stream capture (tests/emu/stream_capture_emu.h, --cuda-graph-impl full_iteration): a call made
// while the stream is being captured runs nothing; its plan (the calls, buffers, counts, peers),
// its arguments and its point-to-point kind are recorded as one operation of the graph, and its
// handle's wait_on as another (the join of NCCL's stream back onto the captured one). A replay
// issues each recorded call through the eager path at its place in the order (so the groups of
// point-to-point calls form at the same boundaries) and completes it at its recorded join, with
// the eager strict checks. The host cannot test or wait for a captured call (its completion is
// the graph's); a call not joined before the capture ends fails the capture, naming it.
//
// Strict mode (the emulated device's default, device_memory_emu.h): every buffer must be a device
// allocation; the receive range is inaccessible and the send range read-only to kernels, copies
// and sets until the collective completes; the collective itself is checked against the others
// in flight (it reads its send range and writes its receive range as a kernel would). Send and
// recv may overlap only in NCCL's in-place forms (nccl_desc.h), in every mode.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/check.h"
#include "core/device.h"
#include "core/sync_audit.h"
#include "emu/device_memory_emu.h"
#include "emu/stream_capture_emu.h"
#include "ops/desc/nccl_desc.h"
#include "parallel/communicator_nccl.h"
#include "parallel/nccl_p2p_batch.h"

namespace moecore::parallel {

bool nccl_built() {
  return true;
}

namespace {

using ops::desc::NcclAddr;
using ops::desc::NcclBuf;
using ops::desc::NcclCall;
using ops::desc::NcclDataType;
using ops::desc::NcclKind;
using ops::desc::NcclPlan;
using ops::desc::NcclRedOp;
using Clock = std::chrono::steady_clock;

DType dtype_of_nccl(NcclDataType t) {
  switch (t) {
    case NcclDataType::Float32:
      return DType::F32;
    case NcclDataType::Bfloat16:
      return DType::BF16;
    case NcclDataType::Float64:
      return DType::F64;
    case NcclDataType::Int32:
      return DType::I32;
    case NcclDataType::Int64:
      return DType::I64;
  }
  MOE_FAIL("[comm] emulated NCCL: unknown NCCL data type {}", static_cast<int>(t));
}

ReduceOp reduce_op(NcclRedOp op) {
  return op == NcclRedOp::Sum ? ReduceOp::Sum : ReduceOp::Max;
}

// A message of a rank to itself (NCCL allows it; the transport may not).
struct SelfMessage {
  bool sending = false;
  char* buf = nullptr;
  int64_t bytes = 0;
  int tag = 0;
  bool done = false;
};

// What a send announces and a receive answers: its bytes and the caller's tag.
struct P2pHeader {
  int64_t bytes = 0;
  int64_t tag = 0;
  bool operator==(const P2pHeader&) const = default;
};

class EmuNcclCommunicator;

// One collective in flight: the transport's handles, the host staging and what completion does.
class EmuNcclRequest final : public CommRequest {
 public:
  EmuNcclRequest(EmuNcclCommunicator* c, const char* call) : comm_(c), call_(call) {}
  ~EmuNcclRequest() override;
  bool test() override;
  void wait() override;
  // The emulated device runs every launch to completion as it is called, so completing the
  // collective here orders it before every later op on any stream: what the real backend's
  // stream wait does, and (as there) not a host sync for the audit.
  bool wait_on(const Exec&) override {
    // A call issued before the capture began, ordered inside it: the graph would wait for an
    // event of the eager stream (CUDA refuses a capture's dependency outside it), and a replay
    // would not wait at all.
    if (emu::capturing()) {
      const std::string what = fmt::format(
          "{} on group '{}' (emulated NCCL), issued before the capture began, ordered on the "
          "captured stream (complete it before the captured region, or issue it inside)",
          call_, comm_name());
      SyncAudit::instance().not_capturable(what.c_str());
      MOE_FAIL("[emu] {}", what);
    }
    wait();
    return false;
  }
  const std::string& comm_name() const;

  EmuNcclCommunicator* comm_;
  const char* call_;
  // Posts the calls on the transport (when it goes on the stream: its group is issued).
  void post_calls();
  // Its turn on the stream: its receives acknowledge their messages.
  void start();
  // Whether every call's transport operation is complete (not yet written back).
  bool ready();
  // Its group finished on the stream: the received range is written back to the device.
  void complete();
  void release_buffers();

  std::vector<NcclCall> calls;                     // the plan's calls, posted by post_calls()
  int64_t send_at = 0;                             // the calls' send staging in `host` (elements)
  size_t call_es = 0;                              // the calls' element size
  int tag = 0;                                     // send / recv: the caller's (NCCL ignores it)
  // Per send / receive call: what this side announces, and what the other side's header or
  // answer said (the sends' rendezvous: the answer comes once the receive had its turn).
  std::vector<P2pHeader> mine, theirs;
  // The receives: their data is posted once the header arrived and matched (in posting order).
  struct Incoming {
    size_t call;    // index in calls / mine / theirs
    char* dst;      // the host staging
    int64_t count;
    DType t;
    CommHandle header;
    bool posted = false;
  };
  std::vector<Incoming> incoming;
  std::vector<size_t> outgoing;                    // the sends' call indices
  std::vector<unsigned char> drain;                // a mismatched message's bytes
  std::string error;                               // a mismatched pair: thrown by test() / wait()
  bool receive_posted();                           // the receives' data posted (in order)
  void check_answers();                            // the sends' answers against their headers
  uint64_t group = 0;                              // the stream group it completes with
  bool started = false;
  std::vector<CommHandle> parts;                   // the transport's operations
  std::vector<std::unique_ptr<SelfMessage>> self;  // this rank's messages to itself
  std::vector<unsigned char> host;                 // staging, in the calls' dtype
  std::vector<unsigned char> bounce;               // the bf16 bytes of a staged plan
  char* recv_dev = nullptr;                        // the device range written back
  int64_t recv_elems = 0, recv_at = 0;             // its extent and place in `host` (elements)
  size_t recv_es = 0;                              // the collective's element size
  bool staged = false;
  uint64_t tickets[2] = {0, 0};  // the pending ranges (strict mode)
  bool finished = false;         // its group finished on the stream
  bool done = false;             // and the caller waited for it (or for a later one)
};

// A call recorded into a capture: what the graph's replays share, the handle of the replay's
// eager call between its issue and its join.
struct CapturedCall {
  std::string what;  // "all_reduce on group 'dp' (emulated NCCL, rank 0 of 2)"
  int64_t fork = 0;  // its fork of the captured stream (emu::capture_fork)
  CommHandle live;   // during a replay: the eager call, issued, not yet joined
};

// The capture's handle of a recorded call: joined onto the captured stream by wait_on (recorded
// into the graph); the host can neither wait for nor test it (its completion is the graph's).
class CapturedNcclRequest final : public CommRequest {
 public:
  explicit CapturedNcclRequest(std::shared_ptr<CapturedCall> c) : call_(std::move(c)) {}
  bool test() override {
    host_wait("tests");
    return true;
  }
  void wait() override { host_wait("waits for"); }
  bool wait_on(const Exec& ex) override {
    MOE_CHECK(emu::capturing(),
              "[emu] NCCL {}: recorded into a stream capture, ordered on a stream after the "
              "capture ended (join it inside the captured region)",
              call_->what);
    std::shared_ptr<CapturedCall> c = call_;
    emu::record("an NCCL collective's join", [c, ex] {
      const SyncAudit::Paused device_work;  // NCCL's work, not the host's (--sync-audit)
      c->live.wait_on(ex);
    });
    emu::capture_join(c->fork);
    return false;
  }

 private:
  // A host wait in the captured region is an error (as cudaEventQuery on a captured event is),
  // unless the region is being left by an error already (the handle dropped while unwinding:
  // the capture is discarded). After the capture, there is nothing for the host to wait for.
  void host_wait(const char* verb) const {
    if (!emu::capturing() || std::uncaught_exceptions() > 0) return;
    const std::string what =
        fmt::format("the host {} NCCL {}, recorded into the capture (its completion is the "
                    "graph's: order its readers on the stream with CommHandle::wait_on)",
                    verb, call_->what);
    SyncAudit::instance().not_capturable(what.c_str());
    MOE_FAIL("[emu] {} during a stream capture", what);
  }
  std::shared_ptr<CapturedCall> call_;
};

class EmuNcclCommunicator final : public Communicator {
 public:
  EmuNcclCommunicator(Communicator& bootstrap, const Exec& ex, double timeout_s)
      : name_(bootstrap.name()),
        ranks_(bootstrap.global_ranks()),
        rank_(bootstrap.rank()),
        ex_(ex),
        timeout_s_(timeout_s) {
    MOE_CHECK(ex.device == Device::CUDA,
              "[comm] group '{}': the NCCL communicator needs a CUDA "
              "context, not {}",
              name_, device_name(ex.device));
    MOE_CHECK(timeout_s > 0, "[comm] group '{}': the NCCL communicator's timeout {} s must be > 0",
              name_, timeout_s);
    transport_ = duplicate_communicator(bootstrap, "nccl:" + name_);
    barrier_ = static_cast<int32_t*>(emu::device_alloc(sizeof(int32_t), /*pinned=*/false));
    live().push_back(this);
  }
  ~EmuNcclCommunicator() override {
    // As the real one's: the stream runs what is on it before the buffers go, a wait bounded by
    // the group's timeout and reported past it (MOECORE_FAULT=stream_hang plants a stream that
    // never drains).
    wait_for_stream("the destructor's wait for the communicator's stream");
    std::erase(live(), this);
    emu::device_free(barrier_);
  }

  // Polls the emulated device's stream (idle once its launches returned, unless a hang is
  // planted) until it is idle; past the timeout, abort_on_timeout names the group and `call`.
  void wait_for_stream(const char* call) const {
    const auto start = Clock::now();
    while (!cuda_stream_idle(ex_)) {
      const double waited = std::chrono::duration<double>(Clock::now() - start).count();
      if (waited > timeout_s_) abort_on_timeout(call, waited);
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // The stream: the operations in flight, in posting order. A request leaves it when completed.
  void enqueue(EmuNcclRequest* r, uint64_t group) {
    r->group = group;
    queue_.push_back(r);
    r->post_calls();
    match_self();
    progress();
  }
  void forget(EmuNcclRequest* r) {
    std::erase(queue_, r);
    std::erase(finished_, r);
    batch_.forget(r);
  }
  // The caller waited for r: r and every operation finished before it are the caller's again
  // (a stream's event orders everything before it). The others stay pending until their own
  // wait, as the strict rules want: the caller cannot know they finished.
  void release_through(EmuNcclRequest* r) {
    while (!finished_.empty()) {
      EmuNcclRequest* f = finished_.front();
      finished_.pop_front();
      f->release_buffers();
      if (f == r) return;
    }
  }
  // The collected point-to-point operations go on the stream as one group.
  void issue_p2p() {
    batch_.issue([this](std::span<const NcclP2pBatch<EmuNcclRequest>::Op> ops) {
      const uint64_t g = ++groups_;
      for (const auto& op : ops) {
        op.req->group = g;
        queue_.push_back(op.req);
        op.req->post_calls();
      }
      match_self();
    });
    progress();
  }
  // Runs the stream as far as it goes: the first group starts (all of it at once) and, once all
  // of it is complete, is completed; then the next.
  void progress() {
    const SyncAudit::Paused device_work;  // the device's work, not the host's (--sync-audit)
    while (!queue_.empty()) {
      const uint64_t g = queue_.front()->group;
      size_t end = 0;
      while (end < queue_.size() && queue_[end]->group == g) ++end;
      for (size_t i = 0; i < end; ++i) {
        if (!queue_[i]->started) queue_[i]->start();
      }
      // Every receive of the group posts its data once its header is in, in posting order (a
      // group's sends wait for their peers' receives: none may wait behind a send).
      for (size_t i = 0; i < end; ++i) {
        if (!queue_[i]->receive_posted()) break;
      }
      for (size_t i = 0; i < end; ++i) {
        if (!queue_[i]->ready()) return;
      }
      for (size_t i = 0; i < end; ++i) {
        queue_[i]->complete();
        finished_.push_back(queue_[i]);
      }
      queue_.erase(queue_.begin(), queue_.begin() + static_cast<ptrdiff_t>(end));
    }
  }
  // Every emulated communicator's stream runs while the host waits for any of them.
  static void progress_all() {
    for (EmuNcclCommunicator* c : live()) c->progress();
  }
  uint64_t next_group() { return ++groups_; }
  // The tags of the transport's messages: NCCL's (none: posting order) and the acknowledgements.
  static constexpr int kData = 0, kAck = 1, kHead = 2;
  static constexpr int64_t kHeaderWords = sizeof(P2pHeader) / sizeof(int64_t);
  Communicator& transport() { return *transport_; }
  // A mismatched pair, as this rank saw it (`sending`: its send met the other's receive).
  std::string mismatch(bool sending, int peer, const P2pHeader& mine, const P2pHeader& theirs) const {
    return fmt::format(
        "[comm] group '{}' (emulated NCCL): rank {}'s {} rank {} ({} bytes, tag {}) matched rank "
        "{}'s {} ({} bytes, tag {}): NCCL pairs the messages of two ranks in the order each "
        "posts them, so these two were posted in different orders (or with other sizes). Post "
        "every receive in its sender's order",
        name_, rank_, sending ? "send to" : "receive from", peer, mine.bytes, mine.tag, peer,
        sending ? "receive" : "send", theirs.bytes, theirs.tag);
  }

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(ranks_.size()); }
  const std::string& name() const override { return name_; }
  const std::vector<int>& global_ranks() const override { return ranks_; }
  double timeout_s() const { return timeout_s_; }

  // Past the timeout: which group, which call, what the stream's running group still waits for
  // (the pairs of a wait cycle: this rank's sends no peer has received yet, its receives no
  // peer has sent yet), then the process ends (as the real one does).
  [[noreturn]] void abort_on_timeout(const char* call, double waited) const {
    const std::string pairs = waiting_pairs();
    std::fprintf(stderr,
                 "error: [comm] timeout: rank %d of %d in group '%s' (world rank %d) waited %.1f s "
                 "in %s on the emulated NCCL, over the %.1f s limit "
                 "(--distributed-timeout-minutes)%s; aborting the process\n",
                 rank_, size(), name_.c_str(), ranks_[rank_], waited, call, timeout_s_,
                 pairs.c_str());
    std::fflush(stderr);
    std::abort();
  }
  // The point-to-point operations of the stream's running group not yet matched, as
  // "; its running group waits on: ..." (empty: none, or no group running).
  std::string waiting_pairs() const;

  // Pairs this rank's messages to itself in posting order.
  void match_self() {
    while (!self_sends_.empty() && !self_recvs_.empty()) {
      SelfMessage* s = self_sends_.front();
      SelfMessage* r = self_recvs_.front();
      self_sends_.pop_front();
      self_recvs_.pop_front();
      MOE_CHECK(s->bytes == r->bytes && s->tag == r->tag,
                "[comm] group '{}' (emulated NCCL): rank {} sends itself {} bytes (tag {}) but "
                "its matching receive (the next one posted) takes {} (tag {}): NCCL matches a "
                "pair's messages in posting order",
                name_, rank_, s->bytes, s->tag, r->bytes, r->tag);
      std::memcpy(r->buf, s->buf, static_cast<size_t>(s->bytes));
      s->done = r->done = true;
    }
  }
  void forget_self(SelfMessage* m) {
    std::erase(self_sends_, m);
    std::erase(self_recvs_, m);
  }

 protected:
  // Each plan is built under the audit's pause too: it is NCCL's work (written into the reused
  // plan_, as the real backend does).
  CommHandle start_all_reduce(void* data, int64_t count, DType dt, ReduceOp op) override {
    const SyncAudit::Paused library_work;
    ops::desc::nccl_all_reduce(plan_, count, dt, red_op(op));
    return run(plan_, data, data, dt, "all_reduce",
               Args{"data", "data"});
  }
  CommHandle start_all_gather_v(const void* send, void* recv, std::span<const int64_t> counts,
                                bool equal, DType dt) override {
    const SyncAudit::Paused library_work;
    ops::desc::nccl_all_gather_v(plan_, rank_, counts, equal, dt);
    return run(plan_, send, recv, dt, equal ? "all_gather" : "all_gather_v",
               Args{"send", "recv", false, InPlace::Gather, offset_of(counts)});
  }
  CommHandle start_reduce_scatter_v(const void* send, void* recv, std::span<const int64_t> counts,
                                    bool equal, DType dt, ReduceOp op) override {
    const SyncAudit::Paused library_work;
    ops::desc::nccl_reduce_scatter_v(plan_, rank_, counts, equal, dt, red_op(op));
    return run(plan_, send, recv, dt, equal ? "reduce_scatter" : "reduce_scatter_v",
               Args{"send", "recv", false, InPlace::Scatter, offset_of(counts)});
  }
  CommHandle start_all_to_all_v(const void* send, std::span<const int64_t> send_counts, void* recv,
                                std::span<const int64_t> recv_counts, DType dt) override {
    const SyncAudit::Paused library_work;
    ops::desc::nccl_all_to_all_v(plan_, rank_, send_counts, recv_counts, dt);
    return run(plan_, send, recv, dt, "all_to_all_v", Args{"send", "recv", false, InPlace::None});
  }
  CommHandle start_broadcast(void* data, int64_t count, DType dt, int root) override {
    const SyncAudit::Paused library_work;
    // The root's data is only read.
    ops::desc::nccl_broadcast(plan_, count, dt, root);
    return run(plan_, data, data, dt, "broadcast",
               Args{"data", "data", rank_ == root});
  }
  // NCCL has no tags: a pair's messages match in the order they were posted.
  // (The tag only names the message for the pairing check.)
  CommHandle start_send(const void* data, int64_t count, DType dt, int dst, int tag) override {
    const SyncAudit::Paused library_work;
    p2p(plan_, NcclKind::Send, count, dt, dst);
    return run(plan_, data, nullptr, dt, "send", Args{"data", "data"}, true, tag);
  }
  CommHandle start_recv(void* data, int64_t count, DType dt, int src, int tag) override {
    const SyncAudit::Paused library_work;
    p2p(plan_, NcclKind::Recv, count, dt, src);
    return run(plan_, nullptr, data, dt, "recv", Args{"data", "data"}, true, tag);
  }
  CommHandle start_barrier() override {
    const SyncAudit::Paused library_work;
    ops::desc::nccl_all_reduce(plan_, 1, DType::I32, NcclRedOp::Sum);
    return run(plan_, barrier_, barrier_,
               DType::I32, "barrier", Args{"data", "data"});
  }

 private:
  // The arguments' names in errors; recv_read_only: the root of a broadcast only reads its data.
  // in_place: NCCL's one overlap of send and recv the collective allows (any other is undefined
  // on NCCL, and refused here).
  enum class InPlace : uint8_t {
    None,     // all-to-all-v: none
    Same,     // all-reduce, broadcast: send == recv
    Gather,   // all-gather(v): send == recv + (the counts of the ranks before this one)
    Scatter,  // reduce-scatter(v): recv == send + (the counts of the ranks before this one)
  };
  struct Args {
    const char* send;
    const char* recv;
    bool recv_read_only = false;
    InPlace in_place = InPlace::Same;
    int64_t offset = 0;  // Gather / Scatter: this rank's offset, elements
  };
  int64_t offset_of(std::span<const int64_t> counts) const {
    int64_t off = 0;
    for (int r = 0; r < rank_; ++r) off += counts[r];
    return off;
  }

  static NcclRedOp red_op(ReduceOp op) {
    return op == ReduceOp::Sum ? NcclRedOp::Sum : NcclRedOp::Max;
  }
  // The real backend's point-to-point plan (one ncclSend / ncclRecv), with its extents.
  static void p2p(NcclPlan& p, NcclKind kind, int64_t count, DType dt, int peer) {
    p.grouped = p.stage_bf16 = false;
    p.send_elems = p.recv_elems = 0;
    p.calls.clear();
    (kind == NcclKind::Send ? p.send_elems : p.recv_elems) = count;
    if (count == 0) return;
    NcclCall c;
    c.kind = kind;
    c.send = {NcclBuf::Send, 0};
    c.recv = {NcclBuf::Recv, 0};
    c.count = count;
    c.dtype = ops::desc::nccl_data_type(dt);
    c.peer = peer;
    p.calls.push_back(c);
  }

  CommHandle run(const NcclPlan& plan, const void* send, void* recv, DType dt, const char* call,
                 Args args, bool p2p = false, int tag = 0);
  // run() while the stream is being captured: the call recorded, to be run by each replay.
  CommHandle capture(const NcclPlan& plan, const void* send, void* recv, DType dt,
                     const char* call, Args args, bool p2p, int tag);

 public:
  void post(EmuNcclRequest& req, size_t i, char* s, char* r, size_t es);

 private:

  // The plan of the call being started, reused (its capacity kept: nothing allocates per call).
  NcclPlan plan_;
  std::string name_;
  std::vector<int> ranks_;
  int rank_ = 0;
  Exec ex_;  // the context whose device's stream stands for the communicator's
  double timeout_s_ = 0;
  std::unique_ptr<Communicator> transport_;
  int32_t* barrier_ = nullptr;  // the barrier's all-reduce word, on the device as the real one's
  std::deque<SelfMessage*> self_sends_, self_recvs_;
  std::deque<EmuNcclRequest*> queue_;     // the stream (progress())
  std::deque<EmuNcclRequest*> finished_;  // finished on it, not yet waited for, in order
  NcclP2pBatch<EmuNcclRequest> batch_;    // send_async / recv_async not yet issued
  uint64_t groups_ = 0;                   // the last group's number
  static std::vector<EmuNcclCommunicator*>& live() {
    static std::vector<EmuNcclCommunicator*> all;
    return all;
  }
};

std::string EmuNcclCommunicator::waiting_pairs() const {
  if (queue_.empty()) return "";
  const uint64_t g = queue_.front()->group;
  std::string out;
  const auto add = [&](const std::string& what) { out += (out.empty() ? "" : ", ") + what; };
  for (const EmuNcclRequest* r : queue_) {
    if (r->group != g) break;
    for (size_t i : r->outgoing) {
      // The peer's answer (its receive's header) fills `theirs` once that receive had its turn.
      if (r->theirs[i] == P2pHeader{})
        add(fmt::format("its send to rank {} (world rank {}; {} bytes, tag {}) not received",
                        r->calls[i].peer, ranks_[r->calls[i].peer], r->mine[i].bytes,
                        r->mine[i].tag));
    }
    for (const EmuNcclRequest::Incoming& in : r->incoming) {
      if (!in.posted)
        add(fmt::format("its receive from rank {} (world rank {}; {} bytes, tag {}) not sent",
                        r->calls[in.call].peer, ranks_[r->calls[in.call].peer],
                        r->mine[in.call].bytes, r->mine[in.call].tag));
    }
    for (const auto& m : r->self) {
      if (!m->done)
        add(fmt::format("its {} itself (world rank {}; {} bytes, tag {}) not {}",
                        m->sending ? "send to" : "receive from", ranks_[rank_], m->bytes, m->tag,
                        m->sending ? "received" : "sent"));
    }
  }
  return out.empty() ? "" : "; its running group waits on: " + out;
}

// Copies between the emulated device and the host (the pages are protected outside an access).
void from_device(void* host, const void* dev, size_t bytes) {
  if (bytes == 0) return;
  const emu::DeviceAccess access;
  std::memcpy(host, dev, bytes);
}
void to_device(void* dev, const void* host, size_t bytes) {
  if (bytes == 0) return;
  const emu::DeviceAccess access;
  std::memcpy(dev, host, bytes);
}

CommHandle EmuNcclCommunicator::run(const NcclPlan& plan, const void* send, void* recv, DType dt,
                                    const char* call, Args args, bool p2p, int tag) {
  if (emu::capturing()) return capture(plan, send, recv, dt, call, args, p2p, tag);
  const SyncAudit::Paused device_work;  // NCCL's work, not the host's (--sync-audit)
  // Any other collective goes on the stream after the point-to-point operations collected so far.
  if (!p2p) issue_p2p();
  const size_t es = dtype_size(dt);
  const int64_t se = send != nullptr ? plan.send_elems : 0;
  const int64_t re = recv != nullptr ? plan.recv_elems : 0;
  const size_t send_bytes = static_cast<size_t>(se) * es, recv_bytes = static_cast<size_t>(re) * es;
  const auto* sdev = static_cast<const char*>(send);
  auto* rdev = static_cast<char*>(recv);
  const bool strict = emu::device_memory_mode() == emu::DeviceMemoryMode::Strict;
  std::string what;
  if (strict) {
    what =
        fmt::format("{} on group '{}' (emulated NCCL, rank {} of {})", call, name_, rank_, size());
    emu::check_collective_buffer(what, args.send, sdev, send_bytes);
    emu::check_collective_buffer(what, args.recv, rdev, recv_bytes);
    // The collective reads its send range and writes its receive range, as a kernel would.
    emu::check_pending(what.c_str(), sdev, send_bytes, false);
    emu::check_pending(what.c_str(), rdev, recv_bytes, !args.recv_read_only);
  }

  auto req = std::make_unique<EmuNcclRequest>(this, call);
  // Host staging mirrors the device ranges: one block when they overlap (the in-place forms),
  // two apart otherwise. Offsets in elements of the collective's dtype.
  int64_t send_at = 0, recv_at = 0, total = 0;
  const char* lo = nullptr;  // the device address of host element 0 (overlapping ranges)
  const bool overlap = se > 0 && re > 0 && sdev < rdev + recv_bytes && rdev < sdev + send_bytes;
  if (overlap) {
    const auto at = [es](const char* base, int64_t off) {
      return base + off * static_cast<int64_t>(es);
    };
    const bool nccl_form = (args.in_place == InPlace::Same && sdev == rdev) ||
                           (args.in_place == InPlace::Gather && sdev == at(rdev, args.offset)) ||
                           (args.in_place == InPlace::Scatter && rdev == at(sdev, args.offset));
    MOE_CHECK(nccl_form,
              "[comm] {} on group '{}' (emulated NCCL, rank {} of {}): send ({}, {} elements) and "
              "recv ({}, {} elements) overlap outside NCCL's in-place form, which is undefined on "
              "NCCL: pass separate buffers, or {}",
              call, name_, rank_, size(), static_cast<const void*>(sdev), se,
              static_cast<const void*>(rdev), re,
              args.in_place == InPlace::Gather    ? "send = recv + this rank's offset"
              : args.in_place == InPlace::Scatter ? "recv = send + this rank's offset"
              : args.in_place == InPlace::Same    ? "the same buffer"
                                                  : "no overlap at all (all-to-all-v)");
    lo = std::min<const char*>(sdev, rdev);
    const char* hi = std::max(sdev + send_bytes, static_cast<const char*>(rdev) + recv_bytes);
    MOE_CHECK((sdev - lo) % static_cast<ptrdiff_t>(es) == 0 &&
                  (rdev - lo) % static_cast<ptrdiff_t>(es) == 0,
              "[comm] {} on group '{}': send and recv overlap at an offset that is not a whole "
              "number of {} elements",
              call, name_, dtype_name(dt));
    send_at = (sdev - lo) / static_cast<ptrdiff_t>(es);
    recv_at = (rdev - lo) / static_cast<ptrdiff_t>(es);
    total = (hi - lo) / static_cast<ptrdiff_t>(es);
  } else {
    send_at = 0;
    recv_at = se;
    total = se + re;
  }
  req->staged = plan.stage_bf16;
  MOE_CHECK(!plan.stage_bf16 || dt == DType::BF16,
            "[comm] {} on group '{}': a bf16-staged plan for {}", call, name_, dtype_name(dt));
  const size_t wes = plan.stage_bf16 ? sizeof(float) : es;  // the calls' element size
  std::vector<unsigned char>& bytes = plan.stage_bf16 ? req->bounce : req->host;
  bytes.resize(static_cast<size_t>(total) * es);
  if (overlap) {
    from_device(bytes.data(), lo, static_cast<size_t>(total) * es);
  } else {
    from_device(bytes.data(), sdev, send_bytes);
    from_device(bytes.data() + send_bytes, rdev, recv_bytes);
  }
  if (plan.stage_bf16) {  // widened exactly; the calls run in f32
    req->host.resize(static_cast<size_t>(total) * sizeof(float));
    const auto* b = reinterpret_cast<const bf16*>(req->bounce.data());
    auto* f = reinterpret_cast<float*>(req->host.data());
    for (int64_t i = 0; i < total; ++i) f[i] = bf16_to_float(b[i]);
  }
  req->recv_dev = re > 0 && !args.recv_read_only ? rdev : nullptr;
  req->recv_elems = re;
  req->recv_at = recv_at;
  req->recv_es = es;
  if (strict) {
    if (req->recv_dev != nullptr) {
      req->tickets[0] = emu::pending_begin(rdev, recv_bytes, emu::PendingUse::Recv, what);
    }
    const bool send_is_recv = sdev == rdev && send_bytes == recv_bytes && !args.recv_read_only;
    if (!send_is_recv) {
      const char* ro = args.recv_read_only ? rdev : sdev;
      const size_t ro_bytes = args.recv_read_only ? recv_bytes : send_bytes;
      req->tickets[1] = emu::pending_begin(ro, ro_bytes, emu::PendingUse::Send, what);
    }
  }

  req->calls = plan.calls;
  req->tag = tag;
  req->send_at = send_at;
  req->call_es = wes;
  EmuNcclRequest* raw = req.release();
  CommHandle h{CommRequestPtr(raw)};
  if (p2p) {
    batch_.add({plan.calls.empty() ? NcclKind::Send : plan.calls[0].kind, send, recv,
                se + re, dt, plan.calls.empty() ? rank_ : plan.calls[0].peer, raw});
  } else {
    enqueue(raw, next_group());
  }
  return h;
}

const std::string& EmuNcclRequest::comm_name() const {
  return comm_->name();
}

CommHandle EmuNcclCommunicator::capture(const NcclPlan& plan, const void* send, void* recv,
                                        DType dt, const char* call, Args args, bool p2p,
                                        int tag) {
  auto c = std::make_shared<CapturedCall>();
  c->what = fmt::format("{} on group '{}' (emulated NCCL, rank {} of {})", call, name_, rank_,
                        size());
  c->fork = emu::capture_fork(c->what);
  // By value: the plan_ it came from is reused by the next call.
  emu::record("an NCCL collective", [this, plan, send, recv, dt, call, args, p2p, tag, c] {
    c->live = run(plan, send, recv, dt, call, args, p2p, tag);
  });
  return CommHandle(CommRequestPtr(new CapturedNcclRequest(std::move(c))));
}

void EmuNcclRequest::post_calls() {
  char* s = reinterpret_cast<char*>(host.data()) + send_at * static_cast<int64_t>(call_es);
  char* r = reinterpret_cast<char*>(host.data()) + recv_at * static_cast<int64_t>(call_es);
  // Sized before any is posted: the headers stay put.
  mine.assign(calls.size(), P2pHeader{});
  theirs.assign(calls.size(), P2pHeader{});
  incoming.reserve(calls.size());
  for (size_t i = 0; i < calls.size(); ++i) {
    const NcclCall& c = calls[i];
    comm_->post(*this, i, c.send.buf == NcclBuf::Send ? s : r, c.recv.buf == NcclBuf::Send ? s : r,
                call_es);
  }
}

void EmuNcclRequest::start() { started = true; }

// Its turn on the stream: each receive whose header arrived (in posting order: a later one's
// data never overtakes an earlier one's) is checked against it, its data posted (drained if the
// pair does not match) and the sender answered.
bool EmuNcclRequest::receive_posted() {
  Communicator& x = comm_->transport();
  for (Incoming& in : incoming) {
    if (in.posted) continue;
    if (!in.header.test()) return false;
    const NcclCall& c = calls[in.call];
    char* dst = in.dst;
    if (!(mine[in.call] == theirs[in.call])) {
      if (error.empty()) error = comm_->mismatch(false, c.peer, mine[in.call], theirs[in.call]);
      // (every dtype is a whole number of 2-byte words)
      drain.resize(static_cast<size_t>(std::max<int64_t>(theirs[in.call].bytes, 0)));
      dst = reinterpret_cast<char*>(drain.data());
      parts.push_back(x.recv_async(dst, theirs[in.call].bytes / 2, DType::BF16, c.peer,
                                   EmuNcclCommunicator::kData));
    } else {
      parts.push_back(x.recv_async(dst, in.count, in.t, c.peer, EmuNcclCommunicator::kData));
    }
    parts.push_back(x.send_async(reinterpret_cast<const int64_t*>(&mine[in.call]),
                                 EmuNcclCommunicator::kHeaderWords, DType::I64, c.peer,
                                 EmuNcclCommunicator::kAck));
    in.posted = true;
  }
  return true;
}

void EmuNcclRequest::check_answers() {
  for (size_t i : outgoing) {
    if (error.empty() && !(mine[i] == theirs[i]))
      error = comm_->mismatch(true, calls[i].peer, mine[i], theirs[i]);
  }
}

bool EmuNcclRequest::ready() {
  for (const Incoming& in : incoming) {
    if (!in.posted) return false;
  }
  for (CommHandle& h : parts) {
    if (!h.test()) return false;
  }
  for (const auto& m : self) {
    if (!m->done) return false;
  }
  check_answers();
  return true;
}

// One NCCL call on the transport, its addresses in host staging (s: the send staging, r: the
// recv staging, each at the call's offsets).
void EmuNcclCommunicator::post(EmuNcclRequest& req, size_t i, char* s_base, char* r_base,
                               size_t es) {
  const NcclCall& c = req.calls[i];
  char* s = s_base + c.send.off * static_cast<int64_t>(es);
  char* r = r_base + c.recv.off * static_cast<int64_t>(es);
  const DType t = dtype_of_nccl(c.dtype);
  MOE_CHECK(dtype_size(t) == es,
            "[comm] group '{}' (emulated NCCL): a call of {} in a plan staged as {}-byte elements",
            name_, dtype_name(t), es);
  const size_t bytes = static_cast<size_t>(c.count) * es;
  Communicator& x = *transport_;
  switch (c.kind) {
    case NcclKind::AllReduce:
      if (s != r) std::memmove(r, s, bytes);
      req.parts.push_back(x.all_reduce_async(r, c.count, t, reduce_op(c.op)));
      return;
    case NcclKind::AllGather:
      req.parts.push_back(x.all_gather_async(s, r, c.count, t));
      return;
    case NcclKind::ReduceScatter:
      req.parts.push_back(x.reduce_scatter_async(s, r, c.count, t, reduce_op(c.op)));
      return;
    case NcclKind::Broadcast:
      if (rank_ == c.peer && s != r) std::memmove(r, s, bytes);
      req.parts.push_back(x.broadcast_async(r, c.count, t, c.peer));
      return;
    case NcclKind::Reduce: {
      // The root's piece of a reduce-scatter whose other pieces are empty (the transport copies
      // the counts).
      std::vector<int64_t> counts(static_cast<size_t>(size()), 0);
      counts[c.peer] = c.count;
      req.parts.push_back(x.reduce_scatter_v_async(s, r, counts, t, reduce_op(c.op)));
      return;
    }
    case NcclKind::Send:
    case NcclKind::Recv: {
      const bool sending = c.kind == NcclKind::Send;
      if (c.peer == rank_) {
        auto& m = req.self.emplace_back(std::make_unique<SelfMessage>());
        m->sending = sending;
        m->buf = sending ? s : r;
        m->bytes = static_cast<int64_t>(bytes);
        m->tag = req.tag;
        (sending ? self_sends_ : self_recvs_).push_back(m.get());
        return;
      }
      // The rendezvous: a send completes once the peer's receive had its turn on the peer's
      // stream, which answers it with its own header (receive_posted(); a pair's headers and
      // answers match in order too).
      req.mine[i] = P2pHeader{static_cast<int64_t>(bytes), req.tag};
      auto* their = reinterpret_cast<int64_t*>(&req.theirs[i]);
      if (sending) {
        req.parts.push_back(x.send_async(reinterpret_cast<const int64_t*>(&req.mine[i]),
                                         kHeaderWords, DType::I64, c.peer, kHead));
        req.parts.push_back(x.send_async(s, c.count, t, c.peer, kData));
        req.parts.push_back(x.recv_async(their, kHeaderWords, DType::I64, c.peer, kAck));
        req.outgoing.push_back(i);
      } else {
        req.incoming.push_back(EmuNcclRequest::Incoming{
            i, r, c.count, t, x.recv_async(their, kHeaderWords, DType::I64, c.peer, kHead)});
      }
      return;
    }
  }
}

EmuNcclRequest::~EmuNcclRequest() {
  if (!done) comm_->forget(this);
  for (const auto& m : self) {
    if (!m->done) comm_->forget_self(m.get());
  }
  emu::pending_end(tickets[0]);
  emu::pending_end(tickets[1]);
}

// Testing or waiting for any handle issues the collected point-to-point group first (its
// handle may be one of them); the stream then runs, completing this request in its turn.
bool EmuNcclRequest::test() {
  if (!done) {
    const SyncAudit::Paused device_work;
    comm_->issue_p2p();
    if (finished) comm_->release_through(this);
  }
  // A mismatched pair is reported once; the request is complete (a dropped handle's wait ends).
  if (done && !error.empty()) {
    const std::string e = std::move(error);
    error.clear();
    MOE_FAIL("{}", e);
  }
  return done;
}

void EmuNcclRequest::complete() {
  if (recv_dev != nullptr && recv_elems > 0) {
    if (staged) {  // rounded once, into the bf16 bytes, then to the device
      const auto* f = reinterpret_cast<const float*>(host.data()) + recv_at;
      auto* b = reinterpret_cast<bf16*>(bounce.data());
      for (int64_t i = 0; i < recv_elems; ++i) b[i] = float_to_bf16(f[i]);
      to_device(recv_dev, bounce.data(), static_cast<size_t>(recv_elems) * sizeof(bf16));
    } else {
      to_device(recv_dev, host.data() + recv_at * static_cast<int64_t>(recv_es),
                static_cast<size_t>(recv_elems) * recv_es);
    }
  }
  finished = true;
}

// Completed for the caller (its handle, or a later one of the communicator, was waited or
// tested): the buffers are the caller's again.
void EmuNcclRequest::release_buffers() {
  for (uint64_t& t : tickets) {
    emu::pending_end(t);
    t = 0;
  }
  done = true;
}

void EmuNcclRequest::wait() {
  const auto start = Clock::now();
  for (int64_t spin = 0; !test(); ++spin) {
    EmuNcclCommunicator::progress_all();
    const double waited = std::chrono::duration<double>(Clock::now() - start).count();
    if (waited > comm_->timeout_s()) comm_->abort_on_timeout(call_, waited);
    // Spin briefly (latency), then give the core away: ranks are often oversubscribed.
    if (waited > 5e-3) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    } else if (spin > 1000) {
      std::this_thread::yield();
    }
  }
}

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& bootstrap, const Exec& ex,
                                                     double timeout_s) {
  return std::make_unique<EmuNcclCommunicator>(bootstrap, ex, timeout_s);
}

}  // namespace moecore::parallel
