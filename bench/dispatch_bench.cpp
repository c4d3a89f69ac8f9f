// Dispatch + combine under mpirun: time per step and bytes that leave each rank, against the
// 2 * tokens * top_k * hidden elements per layer per step of DESIGN.md (section 1). The experts
// are the identity (y = x), so only routing, permutation and communication are timed.
//   mpirun --oversubscribe --allow-run-as-root -np R -x OMP_NUM_THREADS=1 build/bench_dispatch
//       [--tokens 2048] [--hidden 512] [--experts 8] [--topk 2] [--iters 20]
// EP = R (the world); R = 1 is the local dispatcher (no communication).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/arena.h"
#include "model/config.h"
#include "moe/dispatcher.h"
#include "parallel/process_groups.h"

#include "bench_timing.h"

using namespace moecore;

namespace {

using bench_timing::median;
using bench_timing::now;

}  // namespace

int main(int argc, char** argv) {
  int64_t T = 2048, H = 512, E = 8, K = 2, iters = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const int64_t v = std::atoll(argv[i + 1]);
    if (a == "--tokens") T = v;
    else if (a == "--hidden") H = v;
    else if (a == "--experts") E = v;
    else if (a == "--topk") K = v;
    else if (a == "--iters") iters = v;
  }
  const parallel::Runtime rt = parallel::runtime_init(&argc, &argv);
  int rc = 0;
  {
    parallel::ParallelConfig pc;
    pc.ep = rt.world_size;
    parallel::ProcessGroups groups(parallel::make_layout(pc, rt.world_size), rt.rank);
    parallel::connect_communicators(groups);
    parallel::Communicator& world = groups.world().communicator();
    const int R = rt.world_size, me = rt.rank;

    // Uniform random routing: K distinct experts per token, seeded per rank.
    std::vector<int32_t> idx(T * K);
    std::mt19937 gen(42 + me);
    std::vector<int32_t> pool(E);
    for (int64_t t = 0; t < T; ++t) {
      std::iota(pool.begin(), pool.end(), 0);
      std::shuffle(pool.begin(), pool.end(), gen);
      for (int64_t k = 0; k < K; ++k) idx[t * K + k] = pool[k];
    }
    std::vector<float> x(T * H), probs(T * K, 1.0f / K), y(T * H), dx(T * H), dprobs(T * K);
    for (int64_t i = 0; i < T * H; ++i) x[i] = static_cast<float>((i * 7 + me) % 13) - 6;

    for (DispatcherType type : {DispatcherType::AlltoAll, DispatcherType::AllGather}) {
      MoeLayerConfig cfg;
      cfg.hidden = H;
      cfg.num_experts = E;
      cfg.moe.router.num_experts = E;
      cfg.moe.router.topk = K;
      cfg.moe.dispatcher_type = type;
      auto d = moe::make_dispatcher<float>(cfg, &groups);
      const int64_t N = d->max_rows(T);
      std::vector<float> x_NH(N * H), p_N(N), dy_NH(N * H);
      Arena arena;
      arena.plan([&](Arena& a) { d->allocate(a, T); });

      std::vector<double> fwd, bwd;
      double sent_bytes = 0;
      for (int64_t it = 0; it < iters + 3; ++it) {
        world.barrier();
        const double t0 = now();
        const moe::DispatchPlan& p = d->plan(idx.data(), T);
        d->dispatch(x_NH.data(), p_N.data(), x.data(), probs.data());
        d->combine(y.data(), x_NH.data());
        const double t1 = now();
        world.barrier();
        const double t2 = now();
        d->combine_backward(dy_NH.data(), y.data());
        d->dispatch_backward(dx.data(), dprobs.data(), dy_NH.data(), p_N.data());
        const double t3 = now();
        // The slowest rank decides the step.
        std::vector<double> tm = {t1 - t0, t3 - t2};
        world.all_reduce(tm, parallel::ReduceOp::Max);
        if (it >= 3) {
          fwd.push_back(tm[0]);
          bwd.push_back(tm[1]);
        }
        if (it == 0) {
          // Payload leaving this rank in the forward (dispatch + combine), in bytes.
          double elems = 0;
          for (int r = 0; r < R; ++r) {
            if (r == me || !p.send_rows_R) continue;
            if (type == DispatcherType::AlltoAll) {
              elems += p.send_rows_R[r] * (H + 1) + p.recv_rows_R[r] * H;  // rows + probs; back
            } else {
              // all-gather of x, probs, idx (i32, same size as f32) to every rank; the partial
              // sums of rank r's tokens go back to r in the reduce-scatter.
              elems += T * (H + 2 * K) + p.recv_rows_R[r] * H;
            }
          }
          sent_bytes = elems * sizeof(float);
        }
      }
      std::vector<double> b = {sent_bytes};
      world.all_reduce(b);
      const double per_rank = b[0] / R;
      const double design = 2.0 * T * K * H * sizeof(float);  // DESIGN.md volume, per rank
      if (me == 0) {
        std::printf("EP=%d %-9s T=%lld H=%lld E=%lld K=%lld  fwd(plan+dispatch+combine) %7.3f ms  "
                    "bwd %7.3f ms  off-rank bytes/rank/fwd %8.2f MiB = %.3f x 2*T*K*H*4 (%.2f MiB)  "
                    "%.2f GB/s\n",
                    R, R == 1 ? "local" : dispatcher_type_name(type), (long long)T, (long long)H,
                    (long long)E, (long long)K, 1e3 * median(fwd), 1e3 * median(bwd),
                    per_rank / (1 << 20), per_rank / design, design / (1 << 20),
                    per_rank / median(fwd) / 1e9);
      }
      if (R == 1) break;  // one rank: both types are the local dispatcher
    }
    world.barrier();
  }
  parallel::runtime_finalize();
  return rc;
}
