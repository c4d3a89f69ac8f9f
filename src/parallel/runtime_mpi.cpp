// Open MPI runtime.
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "parallel/mpi_check.h"
#include "parallel/runtime.h"

namespace moecore::parallel {

namespace {

// A process started without a launcher (a singleton: `moecore train` without mpirun) gets its own
// Open MPI session directory base. Open MPI 4.1 creates the shared top-level session directory
// (<tmp>/ompi.<host>.<uid>) with a stat then a mkdir, and removes it when the last job on the
// host finishes, so two singletons starting at the same moment can both see it missing and one
// fails MPI_Init with "mkdir ... File exists". A private base takes singletons out of that race.
std::string g_private_session_base;

void remove_private_session_base() {
  if (g_private_session_base.empty()) return;
  std::error_code ec;
  std::filesystem::remove_all(g_private_session_base, ec);  // best effort: leftovers are debris
  g_private_session_base.clear();
}

void use_private_session_base() {
  if (started_by_launcher()) return;
  const char* base = std::getenv("OMPI_MCA_orte_tmpdir_base");
  if (base == nullptr || *base == '\0') base = std::getenv("TMPDIR");
  if (base == nullptr || *base == '\0') base = "/tmp";
  std::string tmpl = std::string(base) + "/moecore-mpi-XXXXXX";
  std::vector<char> path(tmpl.begin(), tmpl.end());
  path.push_back('\0');
  if (::mkdtemp(path.data()) == nullptr) return;  // Open MPI's default base, as before
  g_private_session_base = path.data();
  ::setenv("OMPI_MCA_orte_tmpdir_base", g_private_session_base.c_str(), 1);
  std::atexit(remove_private_session_base);
}

}  // namespace

bool mpi_available() { return true; }

Runtime runtime_init(int* argc, char*** argv) {
  int inited = 0;
  MPI_Initialized(&inited);
  if (!inited) {
    use_private_session_base();
    int provided = 0;
    MOE_CHECK_MPI(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided),
                  "[runtime] MPI_Init_thread");
    // Errors come back as codes so MOE_CHECK_MPI can say which call on which group failed.
    MOE_CHECK_MPI(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN),
                  "[runtime] MPI_Comm_set_errhandler");
  }
  Runtime rt;
  MOE_CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &rt.rank), "[runtime] MPI_Comm_rank");
  MOE_CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &rt.world_size), "[runtime] MPI_Comm_size");
  return rt;
}

void runtime_finalize() {
  int inited = 0, finalized = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (inited && !finalized) MPI_Finalize();
  if (inited) remove_private_session_base();
}

void runtime_abort(const Runtime& rt, int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  int inited = 0, finalized = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (rt.world_size > 1 && inited && !finalized) {
    // Ranks failing together (the same bad flag everywhere) each get a moment to print their
    // own error before the first abort kills them.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    MPI_Abort(MPI_COMM_WORLD, code);
  }
  runtime_finalize();
  std::exit(code);
}

void runtime_exit_without_finalize(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  remove_private_session_base();
  std::_Exit(code);  // no atexit handlers: Open MPI's would talk to the launcher too
}

}  // namespace moecore::parallel
