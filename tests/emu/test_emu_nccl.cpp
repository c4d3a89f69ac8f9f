// The emulated NCCL communicator (tests/emu/device/communicator_nccl_emu.cpp) under mpirun, in the
// emulated CUDA build: the NCCL call plans (ops/desc/nccl_desc.h) run over MPI on emulated device
// memory.
// - Every collective on device buffers equals the MPI communicator's on host buffers with the same
//   values, bitwise: f32, f64, i32, i64 and bf16 (reduced in f32, rounded once), sum and max,
//   even and uneven counts, zero counts, the in-place forms, all-to-all-v, every broadcast root,
//   send / recv in both directions and to itself, posted before any wait (no deadlock).
// - Several collectives in flight at once, completed in reverse order, by test() or wait_on();
//   under the sync audit, wait_on is no host sync and the communicator's work no allocation.
// - The strict rules: a kernel or copy that touches a receive buffer before the collective
//   completed is a missing wait; one that writes a send buffer is a reuse too early; a host or
//   pinned buffer handed to a collective is refused; each error names the collective and group.
// - A wait past the timeout names the group and the call and aborts (one process, its own entry).
// - Stream capture (core/stream_graph.h): collectives and a point-to-point group captured with
//   their joins replay to the eager bits, and follow new inputs; a collective not joined before
//   the capture ends, a host wait for a captured one and a join inside the capture of one issued
//   before it are refused, naming the collective and the group.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/mpi_testing.h"
#include "core/check.h"
#include "core/device.h"
#include "core/exec.h"
#include "core/fault_injection.h"
#include "core/stream_graph.h"
#include "core/sync_audit.h"
#include "emu/device_memory_emu.h"
#include "ops/cast.h"
#include "ops/memory.h"
#include "parallel/communicator_nccl.h"
#include "parallel/process_groups.h"

namespace moecore::parallel {
namespace {

Runtime g_rt;
ProcessGroups* g_groups = nullptr;
Exec g_ex;
std::unique_ptr<Communicator> g_nccl;

Communicator& mpi() {
  return g_groups->world().communicator();
}
Communicator& nccl() {
  return *g_nccl;
}
int rank() {
  return mpi().rank();
}
int size() {
  return mpi().size();
}

// A device buffer of n elements, filled and read through ops::copy / ops::read_back.
template <typename T>
struct Dev {
  explicit Dev(int64_t n_) : n(n_) {
    p = static_cast<T*>(exec_alloc(g_ex, MemSpace::Device, std::max<int64_t>(n, 1) * sizeof(T)));
  }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  ~Dev() { exec_free(g_ex, MemSpace::Device, p); }
  void put(const std::vector<T>& v) {
    EXPECT_EQ(static_cast<int64_t>(v.size()), n);
    if (n > 0) ops::copy(g_ex, DevPtr<T>(p), DevPtr<const T>(v.data()), n);
  }
  std::vector<T> get() const {
    std::vector<T> v(n);
    if (n > 0) ops::read_back(g_ex, v.data(), DevPtr<const T>(p), n);
    return v;
  }
  std::span<T> span() { return {p, static_cast<size_t>(n)}; }
  T* p = nullptr;
  int64_t n = 0;
};

// Values with fractions and varied magnitudes (sums round, so the order of the sum shows),
// different on every rank and every case.
template <typename T>
std::vector<T> values(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed * 7919 + static_cast<uint64_t>(rank()) * 104729 + 17);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<T> v(n);
  for (int64_t i = 0; i < n; ++i) {
    const double x = u(rng) * std::ldexp(1.0, static_cast<int>(rng() % 9) - 4);
    if constexpr (std::is_same_v<T, bf16>)
      v[i] = float_to_bf16(static_cast<float>(x));
    else if constexpr (std::is_integral_v<T>)
      v[i] = static_cast<T>(std::llround(x * 1000));
    else
      v[i] = static_cast<T>(x);
  }
  return v;
}

template <typename T>
void expect_bitwise(const std::vector<T>& got, const std::vector<T>& want,
                    const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      ADD_FAILURE() << what << ": element " << i << " of " << got.size() << " differs from the MPI "
                    << "communicator's on rank " << rank() << " of " << size();
      return;
    }
  }
}

// The host's view of the device buffer's range [off, off + n).
template <typename T>
std::vector<T> slice(const std::vector<T>& v, int64_t off, int64_t n) {
  return std::vector<T>(v.begin() + off, v.begin() + off + n);
}

std::string label(const char* call, DType dt, ReduceOp op, bool in_place, int64_t n) {
  return fmt::format("{} {} {} {}{} (world {})", call, dtype_name(dt), reduce_op_name(op),
                     in_place ? "in place " : "", n, size());
}

// Counts per rank with zeros and odd sizes, different per seed.
std::vector<int64_t> uneven_counts(uint64_t seed) {
  std::vector<int64_t> c(size());
  for (int r = 0; r < size(); ++r) c[r] = static_cast<int64_t>((r * 5 + seed * 3) % 7);
  c[seed % size()] = 0;
  return c;
}

int64_t sum(const std::vector<int64_t>& c) {
  int64_t t = 0;
  for (int64_t x : c) t += x;
  return t;
}

template <typename T>
void check_all_reduce(int64_t n, ReduceOp op, uint64_t seed) {
  const DType dt = DTypeOf<T>::value;
  const std::vector<T> x = values<T>(n, seed);
  std::vector<T> want = x;
  mpi().all_reduce(want, op);
  Dev<T> d(n);
  d.put(x);
  nccl().all_reduce(d.span(), op);
  expect_bitwise(d.get(), want, label("all_reduce", dt, op, true, n));
}

template <typename T>
void check_all_gather(const std::vector<int64_t>& counts, bool equal, bool in_place,
                      uint64_t seed) {
  const DType dt = DTypeOf<T>::value;
  const int64_t mine = counts[rank()], total = sum(counts);
  int64_t off = 0;
  for (int r = 0; r < rank(); ++r) off += counts[r];
  const std::vector<T> x = values<T>(mine, seed);
  std::vector<T> want(total);
  if (equal)
    mpi().all_gather(x, want);
  else
    mpi().all_gather_v(x, want, counts);
  Dev<T> recv(total);
  Dev<T> send(mine);
  std::vector<T> init = values<T>(total, seed + 1000);  // garbage the gather overwrites
  if (in_place) {
    for (int64_t i = 0; i < mine; ++i) init[off + i] = x[i];
  }
  recv.put(init);
  send.put(x);
  const std::span<T> s = in_place ? recv.span().subspan(off, mine) : send.span();
  if (equal)
    nccl().all_gather(s, recv.span());
  else
    nccl().all_gather_v(s, recv.span(), counts);
  expect_bitwise(recv.get(), want,
                 label(equal ? "all_gather" : "all_gather_v", dt, ReduceOp::Sum, in_place, total));
}

template <typename T>
void check_reduce_scatter(const std::vector<int64_t>& counts, bool equal, bool in_place,
                          ReduceOp op, uint64_t seed) {
  const DType dt = DTypeOf<T>::value;
  const int64_t mine = counts[rank()], total = sum(counts);
  int64_t off = 0;
  for (int r = 0; r < rank(); ++r) off += counts[r];
  const std::vector<T> x = values<T>(total, seed);
  std::vector<T> want(mine);
  if (equal)
    mpi().reduce_scatter(x, want, op);
  else
    mpi().reduce_scatter_v(x, want, counts, op);
  Dev<T> send(total);
  Dev<T> recv(mine);
  send.put(x);
  recv.put(values<T>(mine, seed + 1000));
  const std::span<T> r = in_place ? send.span().subspan(off, mine) : recv.span();
  if (equal)
    nccl().reduce_scatter(send.span(), r, op);
  else
    nccl().reduce_scatter_v(send.span(), r, counts, op);
  const std::vector<T> got = in_place ? slice(send.get(), off, mine) : recv.get();
  expect_bitwise(got, want,
                 label(equal ? "reduce_scatter" : "reduce_scatter_v", dt, op, in_place, total));
}

template <typename T>
void check_all_to_all(uint64_t seed) {
  const int g = size(), me = rank();
  // Rank r sends (r + 2 q + seed) % 5 elements to rank q (zeros included).
  const auto count = [&](int from, int to) {
    return static_cast<int64_t>((from + 2 * to + seed) % 5);
  };
  std::vector<int64_t> sc(g), rc(g);
  for (int q = 0; q < g; ++q) {
    sc[q] = count(me, q);
    rc[q] = count(q, me);
  }
  const std::vector<T> x = values<T>(sum(sc), seed);
  std::vector<T> want(sum(rc));
  mpi().all_to_all_v(x, sc, want, rc);
  Dev<T> send(sum(sc));
  Dev<T> recv(sum(rc));
  send.put(x);
  nccl().all_to_all_v(send.span(), sc, recv.span(), rc);
  expect_bitwise(recv.get(), want,
                 label("all_to_all_v", DTypeOf<T>::value, ReduceOp::Sum, false, sum(rc)));
}

template <typename T>
void check_broadcast(int64_t n, int root, uint64_t seed) {
  const std::vector<T> x = values<T>(n, seed);
  std::vector<T> want = x;
  mpi().broadcast(want, root);
  Dev<T> d(n);
  d.put(x);
  nccl().broadcast(d.span(), root);
  expect_bitwise(d.get(), want,
                 label("broadcast", DTypeOf<T>::value, ReduceOp::Sum, true, n) + " root " +
                     std::to_string(root));
}

template <typename T>
void check_every_collective(uint64_t seed) {
  const int g = size();
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max}) {
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{64}, int64_t{1001}})
      check_all_reduce<T>(n, op, seed + n);
    for (bool in_place : {false, true}) {
      for (int64_t c : {int64_t{0}, int64_t{3}, int64_t{17}})
        check_reduce_scatter<T>(std::vector<int64_t>(g, c), true, in_place, op, seed + c);
      for (uint64_t k = 0; k < 3; ++k)
        check_reduce_scatter<T>(uneven_counts(seed + k), false, in_place, op, seed + 50 + k);
    }
  }
  for (bool in_place : {false, true}) {
    for (int64_t c : {int64_t{0}, int64_t{5}, int64_t{33}})
      check_all_gather<T>(std::vector<int64_t>(g, c), true, in_place, seed + c);
    for (uint64_t k = 0; k < 3; ++k)
      check_all_gather<T>(uneven_counts(seed + k), false, in_place, seed + 70 + k);
  }
  for (uint64_t k = 0; k < 3; ++k) check_all_to_all<T>(seed + k);
  for (int root = 0; root < g; ++root) {
    check_broadcast<T>(0, root, seed + root);
    check_broadcast<T>(9, root, seed + root);
  }
}

TEST(EmuNccl, CollectivesF32EqualMpiBitwise) {
  check_every_collective<float>(1);
}
TEST(EmuNccl, CollectivesF64EqualMpiBitwise) {
  check_every_collective<double>(2);
}
TEST(EmuNccl, CollectivesI32EqualMpiBitwise) {
  check_every_collective<int32_t>(3);
}
TEST(EmuNccl, CollectivesI64EqualMpiBitwise) {
  check_every_collective<int64_t>(4);
}
// bf16 reductions staged: widened to f32, reduced, rounded once (the MPI communicator's semantics).
TEST(EmuNccl, CollectivesBf16EqualMpiBitwise) {
  check_every_collective<bf16>(5);
}

// Point to point: each rank sends to its successor and its predecessor and to itself, and
// receives from both and from itself, every message posted before any wait (the pipeline's and the
// context-parallel ring's pairs); two messages to the same peer arrive in posting order.
TEST(EmuNccl, SendRecvBothDirectionsPostedBeforeWaiting) {
  const int g = size(), me = rank();
  const int next = (me + 1) % g, prev = (me + g - 1) % g;
  const int64_t n = 13;
  std::vector<std::vector<float>> sent;
  std::vector<std::unique_ptr<Dev<float>>> out, in;
  std::vector<CommHandle> handles;
  // Per message k: to `next` (k = 0, 1), to `prev` (k = 2), to itself (k = 3).
  const int dst[4] = {next, next, prev, me};
  const int src[4] = {prev, prev, next, me};
  for (int k = 0; k < 4; ++k) {
    out.push_back(std::make_unique<Dev<float>>(n + k));
    in.push_back(std::make_unique<Dev<float>>(n + k));
    sent.push_back(values<float>(n + k, 900 + k));
    out[k]->put(sent[k]);
  }
  for (int k = 0; k < 4; ++k) {
    handles.push_back(nccl().send_async(out[k]->span(), dst[k]));
    handles.push_back(nccl().recv_async(in[k]->span(), src[k]));
  }
  for (auto it = handles.rbegin(); it != handles.rend(); ++it) it->wait();
  // What rank `from` sent as its message k (the same values() on that rank).
  for (int k = 0; k < 4; ++k) {
    std::vector<float> want(n + k);
    std::vector<CommHandle> h;
    h.push_back(mpi().send_async(sent[k], dst[k], k));
    h.push_back(mpi().recv_async(want, src[k], k));
    for (auto& x : h) x.wait();
    expect_bitwise(in[k]->get(), want, "send/recv message " + std::to_string(k));
  }
}

// The context-parallel ring's exchange: each rank posts a send to its successor, then a receive
// from its predecessor, and only then waits (the send first). On GPUs a send issued alone blocks
// the communicator's stream until the peer posts the receive, which every peer has queued
// behind its own send: it waits for ever (here too: sends rendezvous and a communicator's
// operations run in order). Issued together as one group, both complete. A communicator of its
// own with a short timeout, so that a regression reports (and ends the run) within seconds.
TEST(EmuNccl, SendThenRecvOnARingCompletesAsOneGroup) {
  const int g = size(), me = rank();
  const int next = (me + 1) % g, prev = (me + g - 1) % g;
  auto ring = make_nccl_communicator(mpi(), g_ex, 10.0);
  const int64_t n = 1 << 16;
  const auto message = [n](int from) {
    std::vector<float> v(n);
    for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(from * 100000 + i % 9973) * 0.5f;
    return v;
  };
  Dev<float> out(n), in(n);
  out.put(message(me));
  CommHandle hs = ring->send_async(out.span(), next);
  CommHandle hr = ring->recv_async(in.span(), prev);
  hs.wait();
  hr.wait();
  expect_bitwise(in.get(), message(prev), "the ring's message from the predecessor");
  // A collective after the pair issues it too, and completes after it.
  CommHandle hs2 = ring->send_async(out.span(), next);
  CommHandle hr2 = ring->recv_async(in.span(), prev);
  ring->barrier();
  EXPECT_TRUE(hs2.test());
  EXPECT_TRUE(hr2.test());
}

// Several collectives in flight at once on device buffers, completed in reverse order, by
// polling test(), and by wait_on(): each equals its blocking form.
TEST(EmuNccl, ManyInFlightCompletedInAnyOrder) {
  const int g = size();
  const int64_t n = 101;
  const std::vector<float> a = values<float>(n, 31), b = values<float>(n * g, 32);
  std::vector<float> want_a = a, want_b(n), want_c(n * g);
  mpi().all_reduce(want_a);
  mpi().reduce_scatter(b, want_b);
  const std::vector<float> c = values<float>(n, 33);
  mpi().all_gather(c, want_c);
  Dev<float> da(n), db(n * g), dbr(n), dc(n), dcr(n * g);
  da.put(a);
  db.put(b);
  dc.put(c);
  CommHandle ha = nccl().all_reduce_async(da.span());
  CommHandle hb = nccl().reduce_scatter_async(db.span(), dbr.span());
  CommHandle hc = nccl().all_gather_async(dc.span(), dcr.span());
  CommHandle hbar = nccl().barrier_async();
  hbar.wait();
  hc.wait_on(g_ex);
  while (!hb.test()) {
  }
  ha.wait();
  expect_bitwise(da.get(), want_a, "all_reduce in flight");
  expect_bitwise(dbr.get(), want_b, "reduce_scatter in flight");
  expect_bitwise(dcr.get(), want_c, "all_gather in flight");
}

// Under the sync audit a collective completed by wait_on is neither an allocation nor a host
// sync (as on a GPU, where the reader's stream waits for it; the emulated NCCL's own work is the
// device's); wait() is a host sync, which the audit reports.
TEST(EmuNccl, WaitOnIsNoHostSyncForTheAudit) {
  const int64_t n = 32;
  Dev<float> d(n);
  d.put(values<float>(n, 71));
  nccl().all_reduce(d.span());  // the transport's request pool warmed, as after a first step
  SyncAudit& audit = SyncAudit::instance();
  audit.begin_step();
  {
    CommHandle h = nccl().all_reduce_async(d.span());
    h.wait_on(g_ex);
  }
  EXPECT_NO_THROW(audit.end_step());
  EXPECT_EQ(audit.allocations(), 0);
  // Not even the MPI backend's documented host wait: on a GPU the stream waits, not the host.
  EXPECT_EQ(audit.documented_syncs().count(SyncAudit::kHostCommWait), 0u);
  audit.begin_step();
  {
    CommHandle h = nccl().all_reduce_async(d.span());
    h.wait();
  }
  EXPECT_THROW(audit.end_step(), Error);
}

// ---- the strict rules ----

// Runs f, which must throw moecore::Error with every one of `parts` in its message.
void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts,
                  const std::string& what) {
  try {
    f();
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const std::string& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << what << ": '" << p << "' not in: " << msg;
    return;
  }
  ADD_FAILURE() << what << ": no error";
}

// A kernel reading the receive buffer of a collective in flight is a missing wait; so are a copy
// from it, a copy or a set into it; after the wait the same kernel runs.
TEST(EmuNcclStrict, MissingWaitIsAnError) {
  const int64_t n = 64;
  Dev<float> data(n);
  Dev<bf16> y(n);
  data.put(values<float>(n, 41));
  CommHandle h = nccl().all_reduce_async(data.span());
  const std::vector<std::string> parts = {"missing wait", "all_reduce on group 'world'"};
  expect_error(
      [&] { ops::cast_f32_to_bf16(g_ex, DevPtr<bf16>(y.p), DevPtr<const float>(data.p), n); },
      parts, "a kernel reading the receive buffer");
  expect_error(
      [&] {
        ops::cast_f32_to_bf16(g_ex, DevPtr<bf16>(y.p), DevPtr<const float>(data.p + 9), n - 9);
      },
      parts, "a kernel reading inside the receive buffer");
  expect_error([&] { data.get(); }, parts, "a read-back of the receive buffer");
  expect_error([&] { ops::zero(g_ex, DevPtr<float>(data.p + 10), 4); }, parts,
               "a set inside the receive buffer");
  h.wait_on(g_ex);
  EXPECT_NO_THROW(ops::cast_f32_to_bf16(g_ex, DevPtr<bf16>(y.p), DevPtr<const float>(data.p), n));
}

// A kernel writing the send buffer of a collective in flight reuses it too early; reading it is
// fine; a test() that returned true completes the collective.
TEST(EmuNcclStrict, EarlySendBufferReuseIsAnError) {
  const int g = size();
  const int64_t n = 40;
  Dev<float> send(n);
  Dev<float> recv(n * g);
  Dev<bf16> y(n);
  send.put(values<float>(n, 51));
  CommHandle h = nccl().all_gather_async(send.span(), recv.span());
  const std::vector<std::string> parts = {"send buffer reused before the collective completed",
                                          "all_gather on group 'world'"};
  expect_error(
      [&] { ops::cast_bf16_to_f32(g_ex, DevPtr<float>(send.p), DevPtr<const bf16>(y.p), n); },
      parts, "a kernel writing the send buffer");
  expect_error([&] { send.put(values<float>(n, 52)); }, parts, "a copy into the send buffer");
  EXPECT_NO_THROW(ops::cast_f32_to_bf16(g_ex, DevPtr<bf16>(y.p), DevPtr<const float>(send.p), n));
  expect_error([&] { recv.get(); }, {"missing wait", "all_gather on group 'world'"},
               "a read-back of the receive buffer");
  while (!h.test()) {
  }
  EXPECT_NO_THROW(ops::cast_bf16_to_f32(g_ex, DevPtr<float>(send.p), DevPtr<const bf16>(y.p), n));
  EXPECT_NO_THROW(recv.get());
}

// A recv's buffer is inaccessible until the message is waited for; a send's read-only.
TEST(EmuNcclStrict, PointToPointBuffersArePending) {
  const int g = size(), me = rank();
  const int64_t n = 8;
  Dev<float> out(n), in(n);
  out.put(values<float>(n, 61));
  CommHandle hr = nccl().recv_async(in.span(), (me + g - 1) % g);
  CommHandle hs = nccl().send_async(out.span(), (me + 1) % g);
  expect_error([&] { in.get(); }, {"missing wait", "recv on group 'world'"}, "recv buffer read");
  expect_error([&] { ops::zero(g_ex, DevPtr<float>(out.p), n); },
               {"send buffer reused before the collective completed", "send on group 'world'"},
               "send buffer zeroed");
  hs.wait();
  hr.wait();
  EXPECT_NO_THROW(in.get());
}

// NCCL pairs two ranks' messages in the order each posts them: a pair posted in different orders
// (or with other sizes) swaps the messages, or fails, on GPUs. Here a send's header and its
// receive's answer (bytes, the caller's tag) must agree, else the wait of the send and the wait
// of the receive fail, each naming both sides; the ranks stay in step (the next pairs run).
TEST(EmuNcclStrict, MismatchedPairsAreErrorsOnBothSides) {
  const int g = size(), me = rank(), peer = me ^ 1;
  const bool sender = me % 2 == 0;
  const int64_t n = 8;
  Dev<float> a(n), b(n), x(n), y(n), big(n + 2);
  const std::vector<float> va = values<float>(n, 71), vb = values<float>(n, 72);
  a.put(va);
  b.put(vb);
  const auto names = [&](int64_t my_bytes, int my_tag, int64_t their_bytes, int their_tag) {
    return std::vector<std::string>{
        "group 'world' (emulated NCCL)",
        fmt::format("rank {}'s {} rank {} ({} bytes, tag {}) matched rank {}'s {} ({} bytes, tag {})",
                    me, sender ? "send to" : "receive from", peer, my_bytes, my_tag, peer,
                    sender ? "receive" : "send", their_bytes, their_tag),
        "in its sender's order"};
  };
  if (peer < g) {  // pairs (0, 1), (2, 3), ...
    // Other sizes: 8 floats sent, 10 received.
    if (sender) {
      CommHandle h = nccl().send_async(a.span(), peer);
      expect_error([&] { h.wait(); }, names(32, 0, 40, 0), "a send of other bytes");
    } else {
      CommHandle h = nccl().recv_async(big.span(), peer);
      expect_error([&] { h.wait(); }, names(40, 0, 32, 0), "a receive of other bytes");
    }
    // The same sizes posted in other orders: the sender's tag 1 then 2, the receiver's 2 then 1.
    if (sender) {
      CommHandle h1 = nccl().send_async(a.span(), peer, 1);
      CommHandle h2 = nccl().send_async(b.span(), peer, 2);
      expect_error([&] { h1.wait(); }, names(32, 1, 32, 2), "the first send, crossed");
      expect_error([&] { h2.wait(); }, names(32, 2, 32, 1), "the second send, crossed");
    } else {
      CommHandle h2 = nccl().recv_async(y.span(), peer, 2);
      CommHandle h1 = nccl().recv_async(x.span(), peer, 1);
      expect_error([&] { h2.wait(); }, names(32, 2, 32, 1), "the first receive, crossed");
      expect_error([&] { h1.wait(); }, names(32, 1, 32, 2), "the second receive, crossed");
    }
    // In one order: delivered.
    if (sender) {
      CommHandle h1 = nccl().send_async(a.span(), peer, 1);
      CommHandle h2 = nccl().send_async(b.span(), peer, 2);
      h1.wait();
      h2.wait();
      mpi().send(va, peer, 1);  // what was sent, for the receiver to compare
      mpi().send(vb, peer, 2);
    } else {
      CommHandle h1 = nccl().recv_async(x.span(), peer, 1);
      CommHandle h2 = nccl().recv_async(y.span(), peer, 2);
      h1.wait();
      h2.wait();
      std::vector<float> want_a(n), want_b(n);
      mpi().recv(want_a, peer, 1);
      mpi().recv(want_b, peer, 2);
      expect_bitwise(x.get(), want_a, "the first message");
      expect_bitwise(y.get(), want_b, "the second message");
    }
  }
  nccl().barrier();
}

// Host and pinned host buffers are refused, naming the collective, the group and the argument;
// nothing was posted, so the ranks stay in step.
TEST(EmuNcclStrict, HostBuffersAreRefused) {
  const int g = size();
  std::vector<float> host(8 * g, 1.0f);
  expect_error([&] { nccl().all_reduce(host); },
               {"all_reduce on group 'world'", "argument 'data'", "host memory"},
               "a host buffer to all_reduce");
  Dev<float> dev(8);
  expect_error([&] { nccl().all_gather(dev.span(), std::span<float>(host)); },
               {"all_gather on group 'world'", "argument 'recv'", "host memory"},
               "a host recv buffer to all_gather");
  float* pinned = static_cast<float*>(exec_alloc(g_ex, MemSpace::PinnedHost, 8 * sizeof(float)));
  expect_error([&] { nccl().broadcast(std::span<float>(pinned, 8), 0); },
               {"broadcast on group 'world'", "argument 'data'", "pinned host memory"},
               "a pinned buffer to broadcast");
  exec_free(g_ex, MemSpace::PinnedHost, pinned);
  // The same calls on device buffers still run in step on every rank.
  nccl().barrier();
}

// A wait past the timeout names the group, the call, the limit and what the running group
// waits for (the pair: here its receive from itself), and ends the process: a receive from
// itself that no send matches, on a communicator of one bootstrapped by a local one (one
// process: the ctest entry emu_nccl_timeout runs this case alone, without mpirun).
void wait_past_the_timeout() {
  auto boot = make_local_communicator("pp", 0);
  auto comm = make_nccl_communicator(*boot, g_ex, 0.3);
  Dev<float> in(4);
  comm->recv(in.span(), 0);
}

TEST(EmuNcclTimeout, AWaitPastTheTimeoutNamesTheGroupAndTheCall) {
  EXPECT_DEATH(wait_past_the_timeout(),
               "timeout: rank 0 of 1 in group 'pp' \\(world rank 0\\) waited 0\\.[3-9] s in recv "
               "on the emulated NCCL, over the 0\\.3 s limit \\(--distributed-timeout-minutes\\); "
               "its running group waits on: its receive from itself \\(world rank 0; 16 bytes, "
               "tag 0\\) not sent; aborting");
}

// The destructor's wait for the communicator's stream is bounded as a handle's is: a stream that
// never drains (MOECORE_FAULT=stream_hang, planted in the dying child) is reported naming the group
// and the wait, and the process ends after the group's timeout instead of hanging.
void destroy_with_a_hung_stream() {
  auto boot = make_local_communicator("ep", 0);
  auto comm = make_nccl_communicator(*boot, g_ex, 0.3);
  fault::inject_for_test("stream_hang");
  comm.reset();
}

TEST(EmuNcclTimeout, TheDestructorsWaitForTheStreamIsBoundedAndNamed) {
  EXPECT_DEATH(destroy_with_a_hung_stream(),
               "timeout: rank 0 of 1 in group 'ep' \\(world rank 0\\) waited 0\\.[3-9] s in the "
               "destructor's wait for the communicator's stream on the emulated NCCL, over the "
               "0\\.3 s limit");
}

// Send and recv may overlap only in NCCL's in-place forms: anything else is undefined on NCCL
// and refused before anything is posted (so the ranks stay in step).
TEST(EmuNcclStrict, OverlapOutsideTheInPlaceFormsIsRefused) {
  const int g = size();
  const int64_t n = 6;
  Dev<float> buf(n * g + 1);
  const std::span<float> all = buf.span();
  // all-gather: send one element past this rank's slot.
  expect_error([&] { nccl().all_gather(all.subspan(rank() * n + 1, n), all.subspan(0, n * g)); },
               {"all_gather on group 'world'", "overlap outside NCCL's in-place form",
                "send = recv + this rank's offset"},
               "all_gather shifted by one");
  // reduce-scatter: recv one element past this rank's slot of send.
  expect_error(
      [&] { nccl().reduce_scatter(all.subspan(0, n * g), all.subspan(rank() * n + 1, n)); },
      {"reduce_scatter on group 'world'", "overlap outside NCCL's in-place form",
       "recv = send + this rank's offset"},
      "reduce_scatter shifted by one");
  const std::vector<int64_t> counts(g, 1);
  expect_error([&] { nccl().all_to_all_v(all.subspan(0, g), counts, all.subspan(1, g), counts); },
               {"all_to_all_v on group 'world'", "no overlap at all"}, "all_to_all_v overlapping");
  nccl().barrier();
}

// ---- stream capture ----

// One step's communication: an all-reduce, a reduce-scatter and a ring's send / recv group, each
// joined onto the stream (wait_on), as the trainer's captured region issues them.
struct CommStep {
  static constexpr int64_t n = 37;
  Dev<float> a{n}, b{n * 4}, br{n}, out{n}, in{n};
  void issue(Communicator& c) {
    const int g = c.size(), me = c.rank();
    CommHandle ha = c.all_reduce_async(a.span());
    CommHandle hb = c.reduce_scatter_async(std::span<float>(b.p, static_cast<size_t>(n * g)),
                                           br.span());
    CommHandle hs = c.send_async(out.span(), (me + 1) % g);
    CommHandle hr = c.recv_async(in.span(), (me + g - 1) % g);
    ha.wait_on(g_ex);
    hb.wait_on(g_ex);
    hs.wait_on(g_ex);
    hr.wait_on(g_ex);
  }
  void put(uint64_t seed) {
    a.put(values<float>(n, seed));
    b.put(values<float>(n * 4, seed + 1));
    out.put(values<float>(n, seed + 2));
  }
  std::vector<std::vector<float>> get() const { return {a.get(), br.get(), in.get()}; }
};

TEST(EmuNcclCapture, ReplaysEqualTheEagerCallsAndFollowNewInputs) {
  ASSERT_LE(size(), 4);
  CommStep eager, graphed;
  const std::string region = "the communication of a test step";
  graphed.put(1);
  StreamGraph g = StreamGraph::capture(g_ex, region, [&] { graphed.issue(nccl()); });
  EXPECT_EQ(g.operations(), 8);  // four calls and four joins, the sends' group among them
  // Nothing ran at the capture: the inputs are as they were put.
  expect_bitwise(graphed.a.get(), values<float>(CommStep::n, 1), "a after the capture");
  for (uint64_t seed : {11, 23}) {
    eager.put(seed);
    eager.issue(nccl());
    graphed.put(seed);
    g.launch();
    const auto want = eager.get(), got = graphed.get();
    expect_bitwise(got[0], want[0], "captured all_reduce");
    expect_bitwise(got[1], want[1], "captured reduce_scatter");
    expect_bitwise(got[2], want[2], "captured ring send / recv");
  }
}

TEST(EmuNcclCapture, ACollectiveNotJoinedBeforeTheCaptureEndsIsRefused) {
  Dev<float> d(8);
  d.put(values<float>(8, 5));
  CommHandle h;
  expect_error(
      [&] {
        StreamGraph g = StreamGraph::capture(g_ex, "a test region",
                                             [&] { h = nccl().all_reduce_async(d.span()); });
      },
      {"never joined back to the captured stream", "all_reduce on group 'world'"},
      "an unjoined captured all_reduce");
  h = CommHandle();  // nothing for the host to wait for: the recording was discarded
  nccl().barrier();
}

TEST(EmuNcclCapture, AHostWaitForACapturedCollectiveIsRefused) {
  Dev<float> d(8);
  d.put(values<float>(8, 6));
  expect_error(
      [&] {
        StreamGraph::capture(g_ex, "a test region", [&] {
          CommHandle h = nccl().all_reduce_async(d.span());
          h.wait();
        });
      },
      {"a host sync inside the captured a test region", "CommHandle::wait"},
      "a host wait inside the capture");
  nccl().barrier();
}

TEST(EmuNcclCapture, ACollectiveIssuedBeforeTheCaptureIsNotJoinedInsideIt) {
  Dev<float> d(8);
  d.put(values<float>(8, 7));
  CommHandle h = nccl().all_reduce_async(d.span());
  expect_error([&] { StreamGraph::capture(g_ex, "a test region", [&] { h.wait_on(g_ex); }); },
               {"all_reduce on group 'world'", "issued before the capture began"},
               "an eager collective joined inside the capture");
  h.wait();
  nccl().barrier();
}

}  // namespace
}  // namespace moecore::parallel

int main(int argc, char** argv) {
  using namespace moecore;
  using namespace moecore::parallel;
  return moecore::testing::run_mpi_tests(argc, argv, &g_rt, [](ProcessGroups* groups) {
    g_groups = groups;
    if (groups != nullptr) {
      g_ex = make_cuda_exec();
      MOE_CHECK(emu::device_memory_mode() == emu::DeviceMemoryMode::Strict,
                "[test_emu_nccl] the emulated device memory must be strict "
                "(MOECORE_EMU_DEVICE_MEMORY unset)");
      g_nccl = make_nccl_communicator(groups->world().communicator(), g_ex, 60.0);
    } else {
      g_nccl.reset();
    }
  });
}
