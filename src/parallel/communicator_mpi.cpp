// Open MPI communicators: one MPI_Comm per process group, every operation started non-blocking
// and completed by polling MPI_Test against a deadline, so that no wait can hang silently. A
// rank that times out asks the members it waits for, over a side channel, how far they got
// (every rank inside a wait answers), prints that, and aborts the job.
// Reduce-scatter and all-reduce run as a ring of non-blocking point-to-point steps of our own
// (default), or as Open MPI's MPI_Ireduce_scatter / MPI_Iallreduce (MOECORE_MPI_REDUCTIONS=
// libnbc). libnbc's reduce-scatter reduces the whole buffer to the group's rank 0 along a
// binomial tree and scatters it from there (its in-place all-reduce is that tree up and down),
// so rank 0 does log2(g) whole-buffer reductions and holds two buffer-sized scratch blocks; the
// ring spreads the work evenly ((g-1)/g of the buffer sent and reduced by every rank, 2/g of it
// as scratch) and sums every element in a fixed order, the all-reduce in the order of the
// reduce-scatter of the same pieces (bench/RESULTS.md has the measurements that chose it).
#include <mpi.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <thread>

#include "core/fault_injection.h"
#include "parallel/communicator_nccl.h"
#include "parallel/mpi_check.h"
#include "parallel/process_groups.h"

namespace moecore::parallel {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

bool mpi_alive() {
  int inited = 0, finalized = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  return inited && !finalized;
}

// Tags of the diagnosis side channel (its own communicator, so no clash with user tags).
constexpr int kQueryTag = 1;
constexpr int kReplyTag = 2;
constexpr int kNameLen = 32;

void copy_name(char (&dst)[kNameLen], std::string_view src) {
  std::memset(dst, 0, kNameLen);
  std::memcpy(dst, src.data(), std::min<size_t>(src.size(), kNameLen - 1));
}

// "What are you doing, and how far are you on group <group>?"
struct Query {
  char group[kNameLen];
};

struct Reply {
  int64_t entered = 0;       // calls this rank has entered on the queried group
  char last_call[kNameLen];  // the latest of them
  int32_t waiting = 0;       // inside a wait right now?
  char wait_call[kNameLen];
  char wait_group[kNameLen];
  int64_t wait_seq = 0;
  double wait_seconds = 0;
};

class MpiCommunicator;
class MpiRequest;

// The algorithm of the reductions, all-reduce and reduce-scatter (MOECORE_MPI_REDUCTIONS), the
// same on every rank (checked).
enum class ReductionAlgo : int64_t { Ring = 0, Libnbc = 1 };

ReductionAlgo reduction_algo_from_env() {
  const char* env = std::getenv("MOECORE_MPI_REDUCTIONS");
  if (env == nullptr || *env == '\0') return ReductionAlgo::Ring;
  const std::string v(env);
  MOE_CHECK(v == "ring" || v == "libnbc",
            "[comm] MOECORE_MPI_REDUCTIONS={} must be 'ring' (moecore's ring of point-to-point "
            "steps, the default) or 'libnbc' (Open MPI's MPI_Iallreduce and "
            "MPI_Ireduce_scatter), or unset",
            v);
  return v == "ring" ? ReductionAlgo::Ring : ReductionAlgo::Libnbc;
}

// Shared by the communicators of one ProcessGroups.
class MpiContext {
 public:
  MpiContext(double timeout_s, int world_rank, ReductionAlgo rs)
      : timeout_s_(timeout_s), world_rank_(world_rank), red_algo_(rs) {}
  ~MpiContext() {
    if (!mpi_alive()) return;
    if (!replies_.empty()) {
      // A querier that never took its reply is aborting the job; MPI may still read these
      // buffers, so they are deliberately leaked rather than freed under it.
      new std::deque<PendingReply>(std::move(replies_));
    }
    if (diag_ != MPI_COMM_NULL) MPI_Comm_free(&diag_);
  }
  MpiContext(const MpiContext&) = delete;
  MpiContext& operator=(const MpiContext&) = delete;

  void set_diag(MPI_Comm diag) { diag_ = diag; }
  double timeout_s() const { return timeout_s_; }
  ReductionAlgo reduction_algo() const { return red_algo_; }
  // The rings in flight (an intrusive list in start order: linking one allocates nothing).
  // Every test or wait of any request of this context advances all of them, as Open MPI's
  // progress engine advances every libnbc schedule inside any MPI call: a ring started
  // non-blocking keeps moving while the caller polls or waits for something else.
  void link_ring(MpiRequest* r);
  void progress_rings();
  int world_rank() const { return world_rank_; }
  void add(const MpiCommunicator* c) { comms_.push_back(c); }
  void remove(const MpiCommunicator* c) { std::erase(comms_, c); }

  struct WaitState {
    const MpiCommunicator* comm = nullptr;
    const char* call = nullptr;
    int64_t seq = 0;
    Clock::time_point since;
  };
  WaitState& waiting() { return waiting_; }

  // Answers pending queries of ranks that timed out. Called from every wait loop.
  void service();
  [[noreturn]] void abort_on_timeout(const MpiCommunicator& c, const char* call, int64_t seq,
                                     const std::string& what, int peer, double waited);

 private:
  Reply describe(std::string_view group) const;
  struct PendingReply {
    MPI_Request req = MPI_REQUEST_NULL;
    Reply reply;
  };
  double timeout_s_;
  int world_rank_;
  ReductionAlgo red_algo_;
  MpiRequest* rings_head_ = nullptr;
  MpiRequest* rings_tail_ = nullptr;
  bool progressing_ = false;
  MPI_Comm diag_ = MPI_COMM_NULL;
  std::vector<const MpiCommunicator*> comms_;
  WaitState waiting_;
  std::deque<PendingReply> replies_;  // deque: elements never move while MPI sends them
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, std::string name, std::vector<int> ranks,
                  std::shared_ptr<MpiContext> ctx)
      : comm_(comm), name_(std::move(name)), ranks_(std::move(ranks)), ctx_(std::move(ctx)) {
    MOE_CHECK_MPI(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "[comm] group '{}'", name_);
    MOE_CHECK_MPI(MPI_Comm_rank(comm_, &rank_), "[comm] group '{}'", name_);
    MOE_CHECK_MPI(MPI_Comm_size(comm_, &size_), "[comm] group '{}'", name_);
    if (size_ > 1) {
      // The ring's point-to-point steps travel on a communicator of their own, so that they
      // never match the caller's send / recv on the group, whatever the tags.
      MOE_CHECK_MPI(MPI_Comm_dup(comm_, &ring_comm_), "[comm] group '{}'", name_);
      MOE_CHECK_MPI(MPI_Comm_set_errhandler(ring_comm_, MPI_ERRORS_RETURN), "[comm] group '{}'",
                    name_);
    }
    ctx_->add(this);
  }
  ~MpiCommunicator() override;
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  const std::vector<int>& global_ranks() const override { return ranks_; }
  std::string_view reduction_algorithm() const override {
    if (size_ == 1) return "local";
    return ctx_->reduction_algo() == ReductionAlgo::Ring ? "ring" : "libnbc";
  }

  MpiContext& ctx() const { return *ctx_; }
  const std::shared_ptr<MpiContext>& context() const { return ctx_; }
  MPI_Comm mpi_comm() const { return comm_; }
  int64_t calls() const { return calls_; }
  const char* last_call() const { return last_call_; }
  int64_t enter(const char* call) {
    last_call_ = call;
    return ++calls_;
  }
  // A request from the pool (new only while the pool is smaller than the most ever in flight);
  // its vectors keep their capacity, so a steady state allocates nothing per call.
  std::unique_ptr<MpiRequest, CommRequest::Release> acquire(const char* call, DType dt,
                                                            int64_t count, int peer = -1);
  void give_back(MpiRequest* r) { pool_.push_back(r); }

 protected:
  CommHandle start_all_reduce(void* data, int64_t count, DType dt, ReduceOp op) override;
  CommHandle start_all_gather_v(const void* send, void* recv, std::span<const int64_t> counts,
                                bool equal, DType dt) override;
  CommHandle start_reduce_scatter_v(const void* send, void* recv, std::span<const int64_t> counts,
                                    bool equal, DType dt, ReduceOp op) override;
  CommHandle start_all_to_all_v(const void* send, std::span<const int64_t> send_counts, void* recv,
                                std::span<const int64_t> recv_counts, DType dt) override;
  CommHandle start_broadcast(void* data, int64_t count, DType dt, int root) override;
  CommHandle start_send(const void* data, int64_t count, DType dt, int dst, int tag) override;
  CommHandle start_recv(void* data, int64_t count, DType dt, int src, int tag) override;
  CommHandle start_barrier() override;

 private:
  int to_int(int64_t v, const char* call) const {
    MOE_CHECK(v <= INT_MAX,
              "[comm] {} on group '{}': {} elements exceed MPI's int count limit {}; split the "
              "buffer into smaller calls",
              call, name_, v, INT_MAX);
    return static_cast<int>(v);
  }
  // Into `out` (resized: its capacity is kept across calls).
  void ints(std::vector<int>& out, std::span<const int64_t> v, const char* call) const {
    out.resize(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = to_int(v[i], call);
  }
  void displs(std::vector<int>& out, std::span<const int64_t> counts, const char* call) const {
    out.resize(counts.size());
    int64_t off = 0;
    for (size_t i = 0; i < counts.size(); ++i) {
      out[i] = to_int(off, call);
      off += counts[i];
    }
    to_int(off, call);
  }

  MPI_Comm comm_;
  MPI_Comm ring_comm_ = MPI_COMM_NULL;  // the ring reduce-scatter's steps (groups of 2 or more)
  int64_t rings_started_ = 0;           // the ring's tag: the same sequence on every member
  std::string name_;
  std::vector<int> ranks_;
  std::shared_ptr<MpiContext> ctx_;
  std::vector<MpiRequest*> pool_;  // finished requests, owned here (freed with the group)
  size_t created_ = 0;             // requests made so far (the pool's reserved room)
  int rank_ = 0, size_ = 1;
  int64_t calls_ = 0;
  const char* last_call_ = "none";
};

// One in-flight MPI operation and what it needs kept alive until completion.
class MpiRequest final : public CommRequest {
 public:
  // The count vectors are sized for the group once: whichever call a pooled request serves
  // next, they do not grow.
  explicit MpiRequest(MpiCommunicator& comm) : comm_(comm) {
    for (auto* v : {&counts, &displs, &counts2, &displs2}) v->reserve(comm.size());
  }

  // Ready for one call (a pooled request keeps its vectors' capacity).
  void reset(const char* call, DType dt, int64_t count, int peer) {
    call_ = call;
    seq_ = comm_.enter(call);
    dt_ = dt;
    count_ = count;
    peer_ = peer;
    done_ = false;
    req = MPI_REQUEST_NULL;
    status = MPI_Status{};
    finish = nullptr;
    src = nullptr;
    dst = nullptr;
    n = 0;
    ring_ = Ring{};
  }
  void release() override;

  bool test() override {
    if (done_) return true;
    comm_.ctx().progress_rings();  // may complete this request too, if it is a ring
    if (ring_.active) return done_;
    int flag = 0;
    MOE_CHECK_MPI(MPI_Test(&req, &flag, &status), "[comm] {} #{} on group '{}' (rank {} of {})",
                  call_, seq_, comm_.name(), comm_.rank(), comm_.size());
    if (!flag) return false;
    complete();
    return true;
  }

  void wait() override {
    if (done_) return;
    MpiContext& ctx = comm_.ctx();
    const auto start = Clock::now();
    const MpiContext::WaitState saved = ctx.waiting();
    ctx.waiting() = {&comm_, call_, seq_, start};
    struct Restore {
      MpiContext& ctx;
      MpiContext::WaitState saved;
      ~Restore() { ctx.waiting() = saved; }
    } restore{ctx, saved};
    auto last_service = start;
    for (int64_t spin = 0; !test(); ++spin) {
      const auto now = Clock::now();
      const double waited = std::chrono::duration<double>(now - start).count();
      if (waited > ctx.timeout_s()) ctx.abort_on_timeout(comm_, call_, seq_, what(), peer_, waited);
      if (now - last_service > std::chrono::milliseconds(1)) {
        ctx.service();
        last_service = now;
      }
      // Spin briefly (latency), then give the core away: ranks are often oversubscribed.
      if (waited > 5e-3) {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      } else if (spin > 1000) {
        std::this_thread::yield();
      }
    }
  }

  std::string what() const {
    std::string s = fmt::format("{} x {}", dtype_name(dt_), count_);
    if (peer_ >= 0)
      s += fmt::format(", peer {} (world rank {})", peer_, comm_.global_ranks()[peer_]);
    return s;
  }

  MPI_Request req = MPI_REQUEST_NULL;
  MPI_Status status{};
  std::vector<int> counts, displs, counts2, displs2;
  std::vector<float> staging, staging2;  // bf16 reductions run in f32
  // Run once on completion, with what it needs in the request (no capturing closure: those
  // allocate).
  void (*finish)(MpiRequest&) = nullptr;
  void* src = nullptr;
  void* dst = nullptr;
  int64_t n = 0;
  MPI_Datatype recv_type = MPI_DATATYPE_NULL;
  int recv_tag = 0;
  const MpiCommunicator& comm() const { return comm_; }
  int peer() const { return peer_; }

  // The ring reduce-scatter over g members, this one at position r (counts / displs: the
  // pieces, in elements of dt). Step s = 0 .. g-2 sends to r+1 the partial sum of piece
  // (r-1-s) mod g (at s = 0 this member's own values) and receives from r-1 the partial sum of
  // piece (r-2-s) mod g, to which it adds its own values: piece c starts on member c+1 and
  // travels the ring once, so element i of it is summed in the fixed order
  // (((x_{c+1} + x_{c+2}) + ...) + x_{c-1}) + x_c, on every run. The last step's sum is this
  // member's piece r, written to `out`. Each step waits for its send and receive before the
  // next is posted, so the messages of one pair arrive in step order under one tag; every
  // member uses the same tag for the same call (their rings start in the same order).
  // base: the whole input (the caller's send buffer, or its f32 staging for bf16), read only,
  // except that `out` may be this member's own piece of it (in place).
  // The all-reduce (gather = base, out = base + this member's offset): after those g-1 steps,
  // g-1 more pass the finished pieces round the ring, step a sending piece (r-a) mod g and
  // receiving piece (r-1-a) mod g into its place, so every member ends with every sum, each
  // element summed exactly as the reduce-scatter of the same pieces sums it.
  void start_ring(const void* base, void* out, DType dt, ReduceOp op, MPI_Comm comm, int tag,
                  int rank, int size, void* gather = nullptr);
  // Takes every step whose messages have arrived; true once the result is in place.
  bool advance_ring();
  MpiRequest* next_ring = nullptr;  // MpiContext's list of rings in flight

 private:
  struct Ring {
    bool active = false;
    bool posted = false;  // the current step's send and receive are in flight
    int step = 0, rank = 0, size = 1, tag = 0;
    MPI_Request reqs[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    const char* base = nullptr;
    char* out = nullptr;
    char* gather = nullptr;    // all-reduce: the whole buffer, the finished pieces' destination
    char* recv_buf = nullptr;  // the partial sum arriving this step
    char* send_buf = nullptr;  // the partial sum leaving this step (after step 0)
    void* scratch = nullptr;   // both, one largest piece each
    DType dt = DType::F32;
    MPI_Datatype type = MPI_DATATYPE_NULL;
    ReduceOp op = ReduceOp::Sum;
    MPI_Comm comm = MPI_COMM_NULL;
  };
  void post_ring_step();
  void complete();
  Ring ring_;

  MpiCommunicator& comm_;
  const char* call_ = "none";
  int64_t seq_ = 0;
  DType dt_ = DType::F32;
  int64_t count_ = 0;
  int peer_ = -1;
  bool done_ = false;
};

MPI_Datatype mpi_type(DType dt);

void MpiRequest::release() {
  comm_.give_back(this);
}

void MpiRequest::complete() {
  done_ = true;
  if (ring_.scratch != nullptr) {
    std::free(ring_.scratch);
    ring_.scratch = nullptr;
  }
  if (finish) finish(*this);
}

// out[i] = a[i] op own[i]: the partial sum that arrived first, then this member's term.
template <typename T>
void ring_combine(T* out, const T* a, const T* own, int64_t n, ReduceOp op) {
  if (op == ReduceOp::Sum) {
    for (int64_t i = 0; i < n; ++i) out[i] = a[i] + own[i];
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = std::max(a[i], own[i]);
  }
}

void ring_combine(DType dt, void* out, const void* a, const void* own, int64_t n, ReduceOp op) {
  switch (dt) {
    case DType::F32:
      return ring_combine(static_cast<float*>(out), static_cast<const float*>(a),
                          static_cast<const float*>(own), n, op);
    case DType::F64:
      return ring_combine(static_cast<double*>(out), static_cast<const double*>(a),
                          static_cast<const double*>(own), n, op);
    case DType::I32:
      return ring_combine(static_cast<int32_t*>(out), static_cast<const int32_t*>(a),
                          static_cast<const int32_t*>(own), n, op);
    case DType::I64:
      return ring_combine(static_cast<int64_t*>(out), static_cast<const int64_t*>(a),
                          static_cast<const int64_t*>(own), n, op);
    case DType::BF16:
      break;  // staged in f32 by the caller
  }
  MOE_FAIL("[comm] ring reduction: no reduction for {}", dtype_name(dt));
}

void MpiRequest::start_ring(const void* base, void* out, DType dt, ReduceOp op, MPI_Comm comm,
                            int tag, int rank, int size, void* gather) {
  ring_ = Ring{};
  ring_.active = true;
  ring_.base = static_cast<const char*>(base);
  ring_.out = static_cast<char*>(out);
  ring_.gather = static_cast<char*>(gather);
  ring_.dt = dt;
  ring_.type = mpi_type(dt);
  ring_.op = op;
  ring_.comm = comm;
  ring_.tag = tag;
  ring_.rank = rank;
  ring_.size = size;
  int largest = 0;
  int64_t total = 0;
  for (int c : counts) {
    largest = std::max(largest, c);
    total += c;
  }
  if (size == 1 || total == 0) {  // every member sees the same counts: all skip together
    const int64_t mine = counts[rank];
    if (mine > 0 && ring_.out != ring_.base + displs[rank] * dtype_size(dt)) {
      std::memmove(ring_.out, ring_.base + displs[rank] * dtype_size(dt), mine * dtype_size(dt));
    }
    complete();
    return;
  }
  // Scratch for one piece arriving and one leaving, allocated per call and freed on completion
  // as libnbc's own scratch is (2/g of the buffer where libnbc's rank 0 takes twice all of it);
  // plain malloc, outside the request pool, so that no pooled request keeps the largest
  // bucket's scratch for good.
  const size_t piece = static_cast<size_t>(largest) * dtype_size(dt);
  ring_.scratch = std::malloc(std::max<size_t>(2 * piece, 1));
  MOE_CHECK(ring_.scratch != nullptr,
            "[comm] {} on group '{}': no memory for the ring's {} bytes of scratch", call_,
            comm_.name(), 2 * piece);
  ring_.recv_buf = static_cast<char*>(ring_.scratch);
  ring_.send_buf = ring_.recv_buf + piece;
  post_ring_step();
  comm_.ctx().link_ring(this);
}

void MpiRequest::post_ring_step() {
  Ring& g = ring_;
  const int n = g.size, next = (g.rank + 1) % n, prev = (g.rank + n - 1) % n;
  const size_t es = dtype_size(g.dt);
  int out_piece = 0, in_piece = 0;
  const void* sbuf = nullptr;
  void* rbuf = nullptr;
  if (g.step < n - 1) {  // reducing
    out_piece = ((g.rank - 1 - g.step) % n + n) % n;
    in_piece = ((g.rank - 2 - g.step) % n + n) % n;
    sbuf = g.step == 0 ? g.base + displs[out_piece] * es : g.send_buf;
    rbuf = g.recv_buf;
  } else {  // the all-reduce's gathering: finished pieces straight to their places
    const int a = g.step - (n - 1);
    out_piece = ((g.rank - a) % n + n) % n;
    in_piece = ((g.rank - 1 - a) % n + n) % n;
    sbuf = g.gather + displs[out_piece] * es;
    rbuf = g.gather + displs[in_piece] * es;
  }
  MOE_CHECK_MPI(MPI_Irecv(rbuf, counts[in_piece], g.type, prev, g.tag, g.comm, &g.reqs[0]),
                "[comm] {} #{} (ring step {}) on group '{}'", call_, seq_, g.step, comm_.name());
  MOE_CHECK_MPI(MPI_Isend(sbuf, counts[out_piece], g.type, next, g.tag, g.comm, &g.reqs[1]),
                "[comm] {} #{} (ring step {}) on group '{}'", call_, seq_, g.step, comm_.name());
  g.posted = true;
}

bool MpiRequest::advance_ring() {
  Ring& g = ring_;
  if (done_) return true;
  for (;;) {
    int flag = 0;
    MOE_CHECK_MPI(MPI_Testall(2, g.reqs, &flag, MPI_STATUSES_IGNORE),
                  "[comm] {} #{} (ring step {}) on group '{}' (rank {} of {})", call_, seq_,
                  g.step, comm_.name(), comm_.rank(), comm_.size());
    if (!flag) return false;
    g.posted = false;
    const int n = g.size;
    if (g.step >= n - 1) {  // the all-reduce's gathering
      if (g.step == 2 * n - 3) {
        complete();
        return true;
      }
      ++g.step;
      post_ring_step();
      continue;
    }
    const int piece = ((g.rank - 2 - g.step) % n + n) % n;
    const char* own = g.base + displs[piece] * dtype_size(g.dt);
    if (g.step == n - 2) {  // piece == rank: the result
      ring_combine(g.dt, g.out, g.recv_buf, own, counts[piece], g.op);
      if (g.gather == nullptr) {
        complete();
        return true;
      }
      std::free(g.scratch);  // the gathering needs none
      g.scratch = nullptr;
      ++g.step;
      post_ring_step();
      continue;
    }
    // The partial sum with this member's term is what leaves next step; the buffer that left
    // this step receives the next one.
    ring_combine(g.dt, g.recv_buf, g.recv_buf, own, counts[piece], g.op);
    std::swap(g.recv_buf, g.send_buf);
    ++g.step;
    post_ring_step();
  }
}

void MpiContext::link_ring(MpiRequest* r) {
  r->next_ring = nullptr;
  if (rings_tail_ == nullptr) {
    rings_head_ = rings_tail_ = r;
  } else {
    rings_tail_->next_ring = r;
    rings_tail_ = r;
  }
}

void MpiContext::progress_rings() {
  if (rings_head_ == nullptr || progressing_) return;
  progressing_ = true;
  struct Reset {
    bool& b;
    ~Reset() { b = false; }
  } reset{progressing_};
  MpiRequest* prev = nullptr;
  for (MpiRequest* r = rings_head_; r != nullptr;) {
    MpiRequest* next = r->next_ring;
    if (r->advance_ring()) {  // done: unlink
      (prev == nullptr ? rings_head_ : prev->next_ring) = next;
      if (rings_tail_ == r) rings_tail_ = prev;
      r->next_ring = nullptr;
    } else {
      prev = r;
    }
    r = next;
  }
}

std::unique_ptr<MpiRequest, CommRequest::Release> MpiCommunicator::acquire(const char* call,
                                                                           DType dt, int64_t count,
                                                                           int peer) {
  MpiRequest* r = nullptr;
  if (pool_.empty()) {
    r = new MpiRequest(*this);
    // Room for every request there is: one given back later (possibly in a later step, as the
    // deferred parameter gathers of --overlap-param-gather are) never grows the pool.
    pool_.reserve(++created_);
  } else {
    r = pool_.back();
    pool_.pop_back();
  }
  r->reset(call, dt, count, peer);
  // A hung rank, for the watchdog's tests: it stops here, inside the call, before communicating.
  fault::sleep_point(call, ctx_->world_rank());
  return std::unique_ptr<MpiRequest, CommRequest::Release>(r);
}

MpiCommunicator::~MpiCommunicator() {
  for (MpiRequest* r : pool_) delete r;
  ctx_->remove(this);
  if (mpi_alive()) {
    if (ring_comm_ != MPI_COMM_NULL) MPI_Comm_free(&ring_comm_);
    MPI_Comm_free(&comm_);
  }
}

MPI_Datatype mpi_type(DType dt) {
  switch (dt) {
    case DType::F32:
      return MPI_FLOAT;
    case DType::F64:
      return MPI_DOUBLE;
    case DType::I32:
      return MPI_INT32_T;
    case DType::I64:
      return MPI_INT64_T;
    case DType::BF16:
      return MPI_UINT16_T;  // moved as raw bits; reductions are staged in f32
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op mpi_op(ReduceOp op) {
  return op == ReduceOp::Sum ? MPI_SUM : MPI_MAX;
}

void bf16_to_f32(const void* src, float* dst, int64_t n) {
  const bf16* s = static_cast<const bf16*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(s[i]);
}

void f32_to_bf16(const float* src, void* dst, int64_t n) {
  bf16* d = static_cast<bf16*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(src[i]);
}

CommHandle MpiCommunicator::start_all_reduce(void* data, int64_t count, DType dt, ReduceOp op) {
  auto r = acquire("all_reduce", dt, count);
  const int n = to_int(count, "all_reduce");
  if (ctx_->reduction_algo() == ReductionAlgo::Ring) {
    // The ring over g pieces of ceil(count / g) elements (the trailing ones short or empty):
    // the distributed optimizer's shards of a gradient bucket (bucket_shards.h), so that its
    // reduce-scatter gives each element exactly this all-reduce's sum.
    const int64_t piece = (count + size_ - 1) / size_;
    r->counts.resize(size_);
    r->displs.resize(size_);
    for (int q = 0; q < size_; ++q) {
      const int64_t begin = std::min<int64_t>(static_cast<int64_t>(q) * piece, count);
      r->displs[q] = static_cast<int>(begin);
      r->counts[q] = static_cast<int>(std::min<int64_t>(piece, count - begin));
    }
    void* buf = data;
    DType rdt = dt;
    if (dt == DType::BF16) {  // summed in f32, rounded once at the end
      r->staging.resize(count);
      bf16_to_f32(data, r->staging.data(), count);
      buf = r->staging.data();
      rdt = DType::F32;
      r->dst = data;
      r->n = count;
      r->finish = [](MpiRequest& q) { f32_to_bf16(q.staging.data(), q.dst, q.n); };
    }
    char* mine = static_cast<char*>(buf) + static_cast<size_t>(r->displs[rank_]) * dtype_size(rdt);
    const int tag = static_cast<int>(rings_started_++ % 32768);
    r->start_ring(buf, mine, rdt, op, ring_comm_, tag, rank_, size_, buf);
    return CommHandle(std::move(r));
  }
  if (dt == DType::BF16) {
    r->staging.resize(count);
    bf16_to_f32(data, r->staging.data(), count);
    MOE_CHECK_MPI(
        MPI_Iallreduce(MPI_IN_PLACE, r->staging.data(), n, MPI_FLOAT, mpi_op(op), comm_, &r->req),
        "[comm] all_reduce on group '{}'", name_);
    r->dst = data;
    r->n = count;
    r->finish = [](MpiRequest& q) { f32_to_bf16(q.staging.data(), q.dst, q.n); };
  } else {
    MOE_CHECK_MPI(MPI_Iallreduce(MPI_IN_PLACE, data, n, mpi_type(dt), mpi_op(op), comm_, &r->req),
                  "[comm] all_reduce on group '{}'", name_);
  }
  return CommHandle(std::move(r));
}

CommHandle MpiCommunicator::start_all_gather_v(const void* send, void* recv,
                                               std::span<const int64_t> counts, bool equal,
                                               DType dt) {
  const char* call = equal ? "all_gather" : "all_gather_v";
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  auto r = acquire(call, dt, total);
  ints(r->counts, counts, call);
  displs(r->displs, counts, call);
  const size_t es = dtype_size(dt);
  // The caller may pass its own slot of recv as send: MPI needs MPI_IN_PLACE for that.
  const void* sendbuf = send;
  if (send == static_cast<const char*>(recv) + r->displs[rank_] * es) sendbuf = MPI_IN_PLACE;
  const MPI_Datatype t = mpi_type(dt);
  if (equal) {
    MOE_CHECK_MPI(
        MPI_Iallgather(sendbuf, r->counts[rank_], t, recv, r->counts[0], t, comm_, &r->req),
        "[comm] {} on group '{}'", call, name_);
  } else {
    MOE_CHECK_MPI(MPI_Iallgatherv(sendbuf, r->counts[rank_], t, recv, r->counts.data(),
                                  r->displs.data(), t, comm_, &r->req),
                  "[comm] {} on group '{}'", call, name_);
  }
  return CommHandle(std::move(r));
}

CommHandle MpiCommunicator::start_reduce_scatter_v(const void* send, void* recv,
                                                   std::span<const int64_t> counts, bool equal,
                                                   DType dt, ReduceOp op) {
  const char* call = equal ? "reduce_scatter" : "reduce_scatter_v";
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  auto r = acquire(call, dt, total);
  ints(r->counts, counts, call);
  displs(r->displs, counts, call);  // checks the total fits MPI's int
  const int64_t mine = counts[rank_];
  const size_t es = dtype_size(dt);
  // In place: recv is this rank's own slot of send (NCCL's convention).
  const bool in_place = recv == static_cast<const char*>(send) + r->displs[rank_] * es;
  MOE_CHECK(in_place || send != recv || total == 0,
            "[comm] {} on group '{}': send and recv must be different buffers, or recv this "
            "rank's own slot of send (in place)",
            call, name_);
  const void* sbuf = send;
  void* rbuf = recv;
  DType rdt = dt;
  if (dt == DType::BF16) {  // summed in f32, rounded once at the end
    r->staging.resize(total);
    r->staging2.resize(mine);
    bf16_to_f32(send, r->staging.data(), total);
    sbuf = r->staging.data();
    rbuf = r->staging2.data();
    rdt = DType::F32;
    r->dst = recv;
    r->n = mine;
    r->finish = [](MpiRequest& q) { f32_to_bf16(q.staging2.data(), q.dst, q.n); };
  }
  if (ctx_->reduction_algo() == ReductionAlgo::Ring) {
    // In place, the ring reads every piece of send and writes only this rank's, last, from its
    // own values and the partial sum that arrived.
    const int tag = static_cast<int>(rings_started_++ % 32768);
    r->start_ring(sbuf, rbuf, rdt, op, ring_comm_, tag, rank_, size_);
    return CommHandle(std::move(r));
  }
  // MPI_IN_PLACE leaves the result at the start of the buffer instead of this rank's slot; it is
  // moved to the slot on completion (the two ranges coincide on rank 0; on another rank they may
  // overlap with uneven counts: memmove). The bf16 path reduces in f32 staging and writes recv
  // at the end anyway.
  if (in_place && dt != DType::BF16) {
    sbuf = MPI_IN_PLACE;
    rbuf = const_cast<void*>(send);
    if (rank_ != 0 && mine > 0) {
      r->src = rbuf;
      r->dst = recv;
      r->n = mine * static_cast<int64_t>(es);  // bytes
      r->finish = [](MpiRequest& q) { std::memmove(q.dst, q.src, q.n); };
    }
  }
  const MPI_Datatype t = mpi_type(rdt);
  if (equal) {
    MOE_CHECK_MPI(
        MPI_Ireduce_scatter_block(sbuf, rbuf, r->counts[0], t, mpi_op(op), comm_, &r->req),
        "[comm] {} on group '{}'", call, name_);
  } else {
    MOE_CHECK_MPI(MPI_Ireduce_scatter(sbuf, rbuf, r->counts.data(), t, mpi_op(op), comm_, &r->req),
                  "[comm] {} on group '{}'", call, name_);
  }
  return CommHandle(std::move(r));
}

CommHandle MpiCommunicator::start_all_to_all_v(const void* send,
                                               std::span<const int64_t> send_counts, void* recv,
                                               std::span<const int64_t> recv_counts, DType dt) {
  int64_t total = 0;
  for (int64_t c : recv_counts) total += c;
  auto r = acquire("all_to_all_v", dt, total);
  ints(r->counts, send_counts, "all_to_all_v");
  displs(r->displs, send_counts, "all_to_all_v");
  ints(r->counts2, recv_counts, "all_to_all_v");
  displs(r->displs2, recv_counts, "all_to_all_v");
  const MPI_Datatype t = mpi_type(dt);
  MOE_CHECK_MPI(MPI_Ialltoallv(send, r->counts.data(), r->displs.data(), t, recv, r->counts2.data(),
                               r->displs2.data(), t, comm_, &r->req),
                "[comm] all_to_all_v on group '{}'", name_);
  return CommHandle(std::move(r));
}

CommHandle MpiCommunicator::start_broadcast(void* data, int64_t count, DType dt, int root) {
  auto r = acquire("broadcast", dt, count, root);
  MOE_CHECK_MPI(MPI_Ibcast(data, to_int(count, "broadcast"), mpi_type(dt), root, comm_, &r->req),
                "[comm] broadcast on group '{}'", name_);
  return CommHandle(std::move(r));
}

CommHandle MpiCommunicator::start_send(const void* data, int64_t count, DType dt, int dst,
                                       int tag) {
  MOE_CHECK(tag <= 32767, "[comm] send on group '{}': tag {} above MPI's guaranteed bound 32767",
            name_, tag);
  auto r = acquire("send", dt, count, dst);
  MOE_CHECK_MPI(MPI_Isend(data, to_int(count, "send"), mpi_type(dt), dst, tag, comm_, &r->req),
                "[comm] send to {} on group '{}'", dst, name_);
  return CommHandle(std::move(r));
}

CommHandle MpiCommunicator::start_recv(void* data, int64_t count, DType dt, int src, int tag) {
  MOE_CHECK(tag <= 32767, "[comm] recv on group '{}': tag {} above MPI's guaranteed bound 32767",
            name_, tag);
  auto r = acquire("recv", dt, count, src);
  const MPI_Datatype t = mpi_type(dt);
  MOE_CHECK_MPI(MPI_Irecv(data, to_int(count, "recv"), t, src, tag, comm_, &r->req),
                "[comm] recv from {} on group '{}'", src, name_);
  r->n = count;
  r->recv_type = t;
  r->recv_tag = tag;
  r->finish = [](MpiRequest& q) {
    int got = 0;
    MOE_CHECK_MPI(MPI_Get_count(&q.status, q.recv_type, &got), "[comm] recv on group '{}'",
                  q.comm().name());
    MOE_CHECK(got == q.n,
              "[comm] recv on group '{}': expected {} elements from rank {} (tag {}), got {}: the "
              "sender and receiver disagree on the size",
              q.comm().name(), q.n, q.peer(), q.recv_tag, got);
  };
  return CommHandle(std::move(r));
}

CommHandle MpiCommunicator::start_barrier() {
  auto r = acquire("barrier", DType::I32, 0);
  MOE_CHECK_MPI(MPI_Ibarrier(comm_, &r->req), "[comm] barrier on group '{}'", name_);
  return CommHandle(std::move(r));
}

// ---- timeout diagnosis ----

Reply MpiContext::describe(std::string_view group) const {
  Reply r{};
  copy_name(r.last_call, "none");
  for (const MpiCommunicator* c : comms_) {
    if (c->name() == group) {
      r.entered = c->calls();
      copy_name(r.last_call, c->last_call());
    }
  }
  if (waiting_.comm != nullptr) {
    r.waiting = 1;
    copy_name(r.wait_call, waiting_.call);
    copy_name(r.wait_group, waiting_.comm->name());
    r.wait_seq = waiting_.seq;
    r.wait_seconds = seconds_since(waiting_.since);
  }
  return r;
}

void MpiContext::service() {
  if (diag_ == MPI_COMM_NULL) return;
  while (!replies_.empty()) {
    int done = 0;
    MOE_CHECK_MPI(MPI_Test(&replies_.front().req, &done, MPI_STATUS_IGNORE), "[comm] diagnosis");
    if (!done) break;
    replies_.pop_front();
  }
  for (;;) {
    int flag = 0;
    MPI_Status st;
    MOE_CHECK_MPI(MPI_Iprobe(MPI_ANY_SOURCE, kQueryTag, diag_, &flag, &st), "[comm] diagnosis");
    if (!flag) return;
    Query q{};
    MOE_CHECK_MPI(
        MPI_Recv(&q, sizeof(q), MPI_BYTE, st.MPI_SOURCE, kQueryTag, diag_, MPI_STATUS_IGNORE),
        "[comm] diagnosis");
    q.group[kNameLen - 1] = 0;
    PendingReply& p = replies_.emplace_back();
    p.reply = describe(q.group);
    MOE_CHECK_MPI(
        MPI_Isend(&p.reply, sizeof(Reply), MPI_BYTE, st.MPI_SOURCE, kReplyTag, diag_, &p.req),
        "[comm] diagnosis");
  }
}

void MpiContext::abort_on_timeout(const MpiCommunicator& c, const char* call, int64_t seq,
                                  const std::string& what, int peer, double waited) {
  std::vector<int> peers;  // world ranks this rank waits for
  if (peer >= 0) {
    if (peer != c.rank()) peers.push_back(c.global_ranks()[peer]);
  } else {
    for (int r = 0; r < c.size(); ++r) {
      if (r != c.rank()) peers.push_back(c.global_ranks()[r]);
    }
  }
  std::string members;
  for (int r : c.global_ranks()) {
    if (!members.empty()) members += ',';
    members += std::to_string(r);
  }
  std::vector<std::string> lines;
  lines.push_back(fmt::format(
      "[comm] timeout: world rank {} (rank {} of {} in group '{}' = world ranks [{}]) waited "
      "{:.1f} s in {} #{} on '{}' ({}), over the {:.1f} s limit (--distributed-timeout-minutes)",
      world_rank_, c.rank(), c.size(), c.name(), members, waited, call, seq, c.name(), what,
      timeout_s_));

  // Ask the others; answer their questions meanwhile (they may be stuck too).
  Query q{};
  copy_name(q.group, c.name());
  std::vector<MPI_Request> sends(peers.size(), MPI_REQUEST_NULL);
  std::map<int, Reply> answers;
  if (diag_ != MPI_COMM_NULL) {
    for (size_t i = 0; i < peers.size(); ++i) {
      MPI_Isend(&q, sizeof(q), MPI_BYTE, peers[i], kQueryTag, diag_, &sends[i]);
    }
    const double grace = std::clamp(timeout_s_ * 0.5, 0.5, 5.0);
    const auto start = Clock::now();
    while (answers.size() < peers.size() && seconds_since(start) < grace) {
      try {
        service();
      } catch (const Error&) {
      }
      int flag = 0;
      MPI_Status st;
      if (MPI_Iprobe(MPI_ANY_SOURCE, kReplyTag, diag_, &flag, &st) != MPI_SUCCESS) break;
      if (!flag) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        continue;
      }
      Reply r{};
      MPI_Recv(&r, sizeof(r), MPI_BYTE, st.MPI_SOURCE, kReplyTag, diag_, MPI_STATUS_IGNORE);
      answers[st.MPI_SOURCE] = r;
    }
  }
  for (int p : peers) {
    auto it = answers.find(p);
    if (it == answers.end()) {
      lines.push_back(fmt::format(
          "  world rank {}: no answer (busy outside moecore's communication, exited, or hung)", p));
      continue;
    }
    Reply& r = it->second;
    r.last_call[kNameLen - 1] = r.wait_call[kNameLen - 1] = r.wait_group[kNameLen - 1] = 0;
    std::string s;
    if (r.entered < seq) {
      s = fmt::format("has NOT reached {} #{} on '{}' (it entered {} call{} there)", call, seq,
                      c.name(), r.entered, r.entered == 1 ? "" : "s");
    } else if (r.entered == seq && std::string_view(r.last_call) != call) {
      s = fmt::format("called {} as #{} on '{}' where this rank called {} (mismatched calls)",
                      r.last_call, seq, c.name(), call);
    } else {
      s = fmt::format("has reached {} #{} on '{}' (entered {} calls there)", call, seq, c.name(),
                      r.entered);
    }
    if (r.waiting) {
      s += fmt::format("; it is waiting in {} #{} on '{}' for {:.1f} s", r.wait_call, r.wait_seq,
                       r.wait_group, r.wait_seconds);
    } else {
      s += "; it is not waiting in a collective";
    }
    lines.push_back(fmt::format("  world rank {}: {}", p, s));
  }
  lines.push_back(
      "  aborting the job; if this step is legitimately slow, raise "
      "--distributed-timeout-minutes");
  std::string out;
  for (const std::string& l : lines) out += fmt::format("[rank {}] error: {}\n", world_rank_, l);
  std::fputs(out.c_str(), stderr);
  std::fflush(stderr);
  std::fflush(stdout);
  MPI_Abort(MPI_COMM_WORLD, 3);
  std::abort();  // not reached
}

// A barrier over the world with the timeout, before the blocking communicator constructors.
void timed_world_barrier(double timeout_s, int rank, int size) {
  MPI_Request req;
  MOE_CHECK_MPI(MPI_Ibarrier(MPI_COMM_WORLD, &req), "[parallel] connect_communicators");
  const auto start = Clock::now();
  for (;;) {
    int flag = 0;
    MOE_CHECK_MPI(MPI_Test(&req, &flag, MPI_STATUS_IGNORE), "[parallel] connect_communicators");
    if (flag) return;
    if (seconds_since(start) > timeout_s) {
      std::fprintf(stderr,
                   "[rank %d] error: [parallel] timeout: world rank %d of %d waited %.1f s in "
                   "connect_communicators for the other ranks to build their process groups; "
                   "aborting the job\n",
                   rank, rank, size, seconds_since(start));
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 3);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

}  // namespace

std::unique_ptr<Communicator> duplicate_communicator(Communicator& group, std::string name) {
  auto* mpi = dynamic_cast<MpiCommunicator*>(&group);
  if (mpi == nullptr) {
    MOE_CHECK(group.size() == 1,
              "[comm] group '{}': a communicator of {} members that is not MPI's cannot be "
              "duplicated",
              group.name(), group.size());
    return make_local_communicator(std::move(name), group.global_ranks()[0]);
  }
  MPI_Comm dup;
  MOE_CHECK_MPI(MPI_Comm_dup(mpi->mpi_comm(), &dup), "[comm] duplicating group '{}'",
                group.name());
  return std::make_unique<MpiCommunicator>(dup, std::move(name), group.global_ranks(),
                                           mpi->context());
}

void connect_communicators(ProcessGroups& groups) {
  int inited = 0;
  MPI_Initialized(&inited);
  MOE_CHECK(inited,
            "[parallel] connect_communicators: MPI is not initialised (call "
            "runtime_init first)");
  int rank = 0, size = 0;
  MOE_CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "[parallel] connect_communicators");
  MOE_CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &size), "[parallel] connect_communicators");
  MOE_CHECK(size == groups.world_size(),
            "[parallel] the layout is for {} ranks but {} were launched: start with mpirun -np {} "
            "or change the parallel sizes",
            groups.world_size(), size, groups.world_size());
  MOE_CHECK(rank == groups.rank(), "[parallel] groups built for rank {} used on world rank {}",
            groups.rank(), rank);
  const ParallelConfig& cfg = groups.layout().config;
  double timeout_s = cfg.timeout_seconds();
  // The watchdog's tests: a limit of seconds (the flag counts whole minutes in `moecore train`).
  if (const fault::Fault* f = fault::find("comm_timeout", rank)) {
    timeout_s = static_cast<double>(f->int_arg("seconds", -1));
    MOE_CHECK(timeout_s > 0, "[fault] MOECORE_FAULT: comm_timeout needs seconds=S (S > 0)");
  }
  timed_world_barrier(timeout_s, rank, size);

  // Every rank must have been given the same layout, or the groups would not match up. (Plain
  // MPI_Allreduce: the timed barrier above proved every rank is here.)
  const Degrees& d = groups.degrees();
  const ReductionAlgo red_algo = reduction_algo_from_env();
  std::vector<int64_t> hi = {d.tp,  d.cp, d.dp,  d.pp,
                             d.etp, d.ep, d.edp, int64_t{cfg.use_tp_pp_dp_mapping},
                             static_cast<int64_t>(red_algo)};
  std::vector<int64_t> lo(hi.size());
  for (size_t i = 0; i < hi.size(); ++i) lo[i] = -hi[i];
  MOE_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, hi.data(), static_cast<int>(hi.size()), MPI_INT64_T,
                              MPI_MAX, MPI_COMM_WORLD),
                "[parallel] connect_communicators");
  MOE_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, lo.data(), static_cast<int>(lo.size()), MPI_INT64_T,
                              MPI_MAX, MPI_COMM_WORLD),
                "[parallel] connect_communicators");
  for (size_t i = 0; i < hi.size(); ++i) {
    MOE_CHECK(hi[i] == -lo[i],
              "[parallel] ranks were started with different parallel flags (tp, cp, dp, pp, etp, "
              "ep, edp, tp-pp-dp mapping, MOECORE_MPI_REDUCTIONS differ in entry {}: {} vs {}): "
              "give every rank the same command line and environment",
              i, -lo[i], hi[i]);
  }

  auto ctx = std::make_shared<MpiContext>(timeout_s, rank, red_algo);
  MPI_Comm diag;
  MOE_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &diag), "[parallel] connect_communicators");
  MOE_CHECK_MPI(MPI_Comm_set_errhandler(diag, MPI_ERRORS_RETURN), "[parallel] diagnosis comm");
  ctx->set_diag(diag);

  MPI_Comm world;
  MOE_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &world), "[parallel] connect_communicators");
  groups.world().comm =
      std::make_unique<MpiCommunicator>(world, "world", groups.world().ranks, ctx);

  for (GroupKind k : kAllGroupKinds) {
    ProcessGroup& g = groups.group(k);
    const int color = groups.layout().group_index(k, rank);
    MPI_Comm c;
    MOE_CHECK_MPI(MPI_Comm_split(MPI_COMM_WORLD, color, g.rank, &c),
                  "[parallel] creating group '{}'", g.name);
    auto comm = std::make_unique<MpiCommunicator>(c, g.name, g.ranks, ctx);
    MOE_CHECK(comm->rank() == g.rank && comm->size() == g.size(),
              "[parallel] group '{}': MPI gave rank {} of {}, the layout says {} of {}", g.name,
              comm->rank(), comm->size(), g.rank, g.size());
    g.comm = std::move(comm);
  }
}

}  // namespace moecore::parallel
