// Run under mpirun -np 4: rank 3 skips the second all-reduce on 'world' and waits in a barrier
// on its 'tp' group instead. Ranks 0-2 must time out after 5 s with a diagnostic naming the
// group, the call and rank 3's whereabouts, and abort the job (tests/parallel/test_launch.cpp)
// before rank 3's own 120 s timeout, which would print a diagnostic of rank 3's.
// With the argument "pp", under mpirun -np 2: two pipeline stages; the first hangs (a barrier on
// 'world' instead of sending its activation), and the second, waiting for the activation on
// 'pp', must time out naming the pipeline group and the first stage's whereabouts.
#include <cstdio>
#include <string>
#include <vector>

#include "parallel/process_groups.h"

int main(int argc, char** argv) {
  using namespace moecore::parallel;
  const Runtime rt = runtime_init(&argc, &argv);
  if (argc > 1 && std::string(argv[1]) == "pp") {
    ParallelConfig cfg;
    cfg.pp = 2;
    cfg.timeout_minutes = (rt.rank == 0 ? 120.0 : 5.0) / 60.0;
    ProcessGroups groups(make_layout(cfg, rt.world_size), rt.rank);
    connect_communicators(groups);
    std::vector<float> activation(16, 1.0f);
    if (rt.rank == 0) {
      groups.world().communicator().barrier();  // a hung first stage: never sends
    } else {
      groups.pp().communicator().recv_async(activation.data(), 16, moecore::DType::F32, 0).wait();
    }
    std::printf("probe: not reached on rank %d\n", rt.rank);
    runtime_finalize();
    return 0;
  }
  ParallelConfig cfg;
  cfg.tp = 2;
  // Rank 3 waits longer, so the diagnostic comes from the ranks it left waiting. 5 s, not less:
  // the same limit bounds connecting the groups and the first all-reduce, which rank 3 must reach
  // in time even on a loaded, oversubscribed machine.
  cfg.timeout_minutes = (rt.rank == 3 ? 120.0 : 5.0) / 60.0;
  ProcessGroups groups(make_layout(cfg, rt.world_size), rt.rank);
  connect_communicators(groups);
  Communicator& world = groups.world().communicator();
  std::vector<float> x(10, 1.0f);
  world.all_reduce(x);
  if (rt.rank != 3) {
    world.all_reduce(x);
  } else {
    groups.tp().communicator().barrier();
  }
  std::printf("probe: not reached on rank %d\n", rt.rank);
  runtime_finalize();
  return 0;
}
