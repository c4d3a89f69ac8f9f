// The EP dispatchers in one process: with an EP group of one they must be bitwise the local
// dispatcher (dropless, dropped slots, padding), and make_dispatcher picks the local one for
// EP = 1 and refuses layouts it cannot serve with messages that name the numbers.
// Under mpirun with EP = 2 and 4: tests/moe/mpi/test_ep_dispatch_mpi.cpp.
#include <gtest/gtest.h>

#include "common/layer_testing.h"
#include "core/check.h"
#include "moe/allgather_dispatcher.h"
#include "moe/alltoall_dispatcher.h"
#include "moe/experts.h"
#include "parallel/process_groups.h"
#include "plan/sizing_groups.h"

namespace moecore::moe {
namespace {

using testing::random_vec;

struct Out {
  std::vector<double> x_NH, p_N, y, dy_NH, dx, dprobs;
  std::vector<int64_t> per_expert;
};

Out run(TokenDispatcher<double>& d, const std::vector<int32_t>& idx, int64_t n_tok, int64_t K,
        int64_t H, int64_t pad) {
  Arena arena;
  arena.plan([&](Arena& a) { d.allocate(a, n_tok); });
  const DispatchPlan& p = d.plan(idx.data(), n_tok, pad);
  const int64_t N = p.n_rows;
  Out o;
  o.per_expert.assign(raw_ptr(p.tokens_per_expert_L),
                      raw_ptr(p.tokens_per_expert_L) + d.num_local_experts());
  auto x = random_vec<double>(n_tok * H, 1), probs = random_vec<double>(n_tok * K, 2);
  auto dy = random_vec<double>(n_tok * H, 3), dp = random_vec<double>(N, 4);
  o.x_NH.resize(N * H), o.p_N.resize(N), o.y.resize(n_tok * H), o.dy_NH.resize(N * H);
  o.dx.resize(n_tok * H), o.dprobs.resize(n_tok * K);
  d.dispatch(o.x_NH.data(), o.p_N.data(), x.data(), probs.data());
  d.combine(o.y.data(), o.x_NH.data());
  d.combine_backward(o.dy_NH.data(), dy.data());
  d.dispatch_backward(o.dx.data(), o.dprobs.data(), o.dy_NH.data(), dp.data());
  return o;
}

// The local dispatcher dispatches all T * K rows (the dropped slots' rows, zero, after the kept
// ones); a one-rank EP dispatcher the rows it received. The rows they share are the same.
Out first_rows(const Out& local, const Out& ep, int64_t H) {
  const size_t N = ep.p_N.size();
  Out o = local;
  for (size_t i = N; i < local.p_N.size(); ++i) EXPECT_EQ(local.p_N[i], 0.0) << "row " << i;
  for (size_t i = N * H; i < local.x_NH.size(); ++i) {
    EXPECT_EQ(local.x_NH[i], 0.0) << "element " << i;
    EXPECT_EQ(local.dy_NH[i], 0.0) << "element " << i;
  }
  o.x_NH.resize(N * H), o.p_N.resize(N), o.dy_NH.resize(N * H);
  return o;
}

void expect_same(const Out& a, const Out& b) {
  EXPECT_EQ(a.per_expert, b.per_expert);
  EXPECT_EQ(a.x_NH, b.x_NH);
  EXPECT_EQ(a.p_N, b.p_N);
  EXPECT_EQ(a.y, b.y);
  EXPECT_EQ(a.dy_NH, b.dy_NH);
  EXPECT_EQ(a.dx, b.dx);
  EXPECT_EQ(a.dprobs, b.dprobs);
}

TEST(EpDispatchers, GroupOfOneIsBitwiseTheLocalDispatcher) {
  const int64_t n_tok = 9, E = 5, K = 2, H = 4;
  // Expert 4 never chosen, expert 0 by every token, two dropped slots.
  std::vector<int32_t> idx(n_tok * K);
  for (int64_t t = 0; t < n_tok; ++t) {
    idx[t * K] = 0;
    idx[t * K + 1] = static_cast<int32_t>(1 + t % 3);
  }
  idx[3] = -1;
  idx[10] = -1;
  for (int64_t pad : {int64_t{0}, int64_t{n_tok + 1}}) {
    SCOPED_TRACE(::testing::Message() << "pad " << pad);
    const double cf = pad ? 4.0 : 0.0;  // planned capacity ceil(9 * 2 / 5 * 4) = 15 >= pad
    LocalDispatcher<double> local(E, K, H, cf);
    auto comm = parallel::make_local_communicator("ep", 0);
    AlltoAllDispatcher<double> a2a(E, K, H, {cf}, *comm);
    AllGatherDispatcher<double> ag(E, K, H, {cf}, *comm);
    const Out ref = run(local, idx, n_tok, K, H, pad);
    const Out from_a2a = run(a2a, idx, n_tok, K, H, pad), from_ag = run(ag, idx, n_tok, K, H, pad);
    expect_same(from_a2a, first_rows(ref, from_a2a, H));
    expect_same(from_ag, first_rows(ref, from_ag, H));
    EXPECT_EQ(a2a.max_rows(n_tok), local.max_rows(n_tok));
  }
}

// The planned rows of an EP rank: dropless, every token of every EP rank (R T K); padded, exactly
// R x L x capacity, whatever the routing (Qwen3-30B-A3B's EP 8: capacity factor 1 is the
// balanced load T K, 8 times below the dropless worst case; a factor 2 twice that).
TEST(EpDispatchers, PaddedRowsAreExactlyTheCapacityBlocks) {
  EXPECT_EQ(ep_max_rows(8, 4096, 8, 128, {0.0}), 8 * 4096 * 8);
  EXPECT_EQ(ep_max_rows(8, 4096, 8, 128, {1.0}), 4096 * 8);
  EXPECT_EQ(ep_max_rows(8, 4096, 8, 128, {2.0}), 2 * 4096 * 8);
  EXPECT_EQ(ep_max_rows(2, 9, 2, 4, {1.0}), 2 * 2 * expert_capacity(9, 2, 4, 1.0));
  EXPECT_EQ(ep_max_rows(2, 9, 2, 4, {16.0}), 2 * 2 * expert_capacity(9, 2, 4, 16.0));  // > R T K
}

// --moe-expert-rank-capacity-factor: dropless rows up to ceil(factor x T x K), the balanced load
// times the headroom, never more than the dropless worst case R T K.
TEST(EpDispatchers, RankCapacityFactorBoundsTheDroplessRows) {
  EXPECT_EQ(ep_max_rows(8, 4096, 8, 128, {0.0, 1.5}), 3 * 4096 * 4);
  EXPECT_EQ(ep_max_rows(8, 4096, 8, 128, {0.0, 1.0}), 4096 * 8);
  EXPECT_EQ(ep_max_rows(4, 9, 2, 4, {0.0, 1.3}), 24);         // ceil(23.4)
  EXPECT_EQ(ep_max_rows(4, 9, 2, 4, {0.0, 7.0}), 4 * 9 * 2);  // capped at R T K
  EXPECT_EQ(ep_max_rows(4, 9, 2, 4, {0.0, 0.0}), 4 * 9 * 2);
  // Expert TP: the rows of the ETP x EP group, ETP times each bound.
  EXPECT_EQ(ep_max_rows(2, 9, 2, 4, {0.0}, 2), 2 * 2 * 9 * 2);
  EXPECT_EQ(ep_max_rows(2, 9, 2, 4, {0.0, 1.5}, 2), 54);  // ceil(1.5 * 2 * 9 * 2)
  EXPECT_EQ(ep_max_rows(2, 9, 2, 4, {1.0}, 2), 2 * 2 * 2 * expert_capacity(9, 2, 4, 1.0));
}

// Expert TP 2 x EP 2 (every rank of the 4 sized here, on sizing groups): the all-to-all's
// receive buffers hold this rank's ETP slice, the rows of its R = 2 sources at most: N / ETP
// (dropless worst case R T K, padded R L capacity; with a rank capacity factor the smaller of
// the factor's bound and R T K); the ETP gather's buffers hold all N. The arena's workspace is
// exactly the local permutation's, the send rows, the receive slice and the gathered rows
// (each a buffer of rows x H and one of their probs).
TEST(EpDispatchers, EtpReceiveBuffersArePlannedForOneEtpSlice) {
  const int64_t E = 8, K = 2, H = 6, T = 5, R = 2, P = 2, L = E / R;
  parallel::ParallelConfig pc;
  pc.etp = P;
  pc.ep = R;
  const parallel::Layout layout = parallel::make_layout(pc, 4);
  struct Case {
    const char* what;
    EpRowBudget budget;
    int64_t N, recv;
  };
  const int64_t cap = expert_capacity(T, K, E, 1.0);
  const std::vector<Case> cases = {
      {"dropless", {0.0, 0.0}, P * R * T * K, R * T * K},
      {"padded", {1.0, 0.0}, P * R * L * cap, R * L * cap},
      {"rank capacity 1.5", {0.0, 1.5}, 3 * T * K, R * T * K},  // ceil(1.5 x P T K) = 30
      {"rank capacity 0.5", {0.0, 0.5}, T * K, T * K},          // below one slice's worst case
  };
  for (int rank = 0; rank < 4; ++rank) {
    const auto groups = plan::sizing_groups(layout, rank);
    ASSERT_EQ(groups->group(parallel::GroupKind::ExptTp).size(), P);
    for (const Case& c : cases) {
      SCOPED_TRACE(::testing::Message() << c.what << ", rank " << rank);
      AlltoAllDispatcher<float> d(E, K, H, c.budget,
                                  groups->group(parallel::GroupKind::Ep).communicator(),
                                  &groups->group(parallel::GroupKind::ExptTp).communicator());
      EXPECT_EQ(d.max_rows(T), c.N);
      EXPECT_EQ(d.recv_max_rows(T), c.recv);
      LocalDispatcher<float> local(E, K, H, c.budget.pad_capacity_factor);
      Arena a, b;
      a.size_only([&](Arena& x) { d.allocate(x, T); });
      b.size_only([&](Arena& x) { local.allocate(x, T); });
      // Rows and probs of the send side, the receive slice and the gather, each buffer rounded
      // up to the arena's alignment.
      const auto bytes = [](int64_t n) {
        const int64_t b = n * static_cast<int64_t>(sizeof(float)), al = Arena::kAlign;
        return (b + al - 1) / al * al;
      };
      int64_t want = static_cast<int64_t>(b.bytes_of(MemKind::Workspace));
      for (int64_t rows : {local.max_rows(T), c.recv, c.N}) want += bytes(rows * H) + bytes(rows);
      EXPECT_EQ(static_cast<int64_t>(a.bytes_of(MemKind::Workspace)), want);
    }
  }
  // With ETP 1 the receive side is all N, as before.
  parallel::ParallelConfig one;
  one.ep = 4;
  const auto groups = plan::sizing_groups(parallel::make_layout(one, 4), 1);
  AlltoAllDispatcher<float> d(E, K, H, {}, groups->group(parallel::GroupKind::Ep).communicator());
  EXPECT_EQ(d.recv_max_rows(T), d.max_rows(T));
  EXPECT_EQ(d.max_rows(T), 4 * T * K);
}

void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "accepted; expected an error containing " << parts[0];
  } catch (const Error& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

MoeLayerConfig moe_config(int64_t E) {
  MoeLayerConfig cfg;
  cfg.num_experts = E;
  cfg.moe.router.num_experts = E;
  cfg.moe.ffn_hidden = 4;
  return cfg;
}

TEST(EpDispatchers, FactoryPicksLocalForOneRankAndRejectsBadLayouts) {
  EXPECT_NE(dynamic_cast<LocalDispatcher<double>*>(make_dispatcher<double>(moe_config(8), nullptr).get()),
            nullptr);
  parallel::ParallelConfig one;
  parallel::ProcessGroups g1(parallel::make_layout(one, 1), 0);
  EXPECT_NE(dynamic_cast<LocalDispatcher<double>*>(make_dispatcher<double>(moe_config(8), &g1).get()),
            nullptr);
  // Pure layouts (no communicators): the checks come before any communication.
  parallel::ParallelConfig ep4;
  ep4.ep = 4;
  parallel::ProcessGroups g4(parallel::make_layout(ep4, 4), 1);
  expect_error([&] { make_dispatcher<double>(moe_config(6), &g4); },
               {"[dispatcher]", "--num-experts 6", "--expert-model-parallel-size 4"});
  // Expert tensor parallelism splits each expert's ffn width: ETP must divide it.
  ParamRegistry params(DType::F64);
  expect_error(
      [&] {
        GroupedExperts<double>(8, 0, 4, nn::MlpShape{4, 3}, 0.1, 0.1, params, "l", TpShard{1, 2});
      },
      {"[experts]", "--moe-ffn-hidden-size 3", "--expert-tensor-parallel-size 2"});
  auto comm = parallel::make_local_communicator("ep", 0);
  expect_error([&] { AlltoAllDispatcher<double>(6, 2, 4, {}, *comm).plan(nullptr, 5); },
               {"5 tokens > planned maximum 0"});
}

}  // namespace
}  // namespace moecore::moe
