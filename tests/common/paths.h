// Where a test finds the checkout (fixtures, configs, docs) and this build's binaries. The paths
// are compiled into tests/common/paths.cpp alone, so no other test object depends on where the
// tree or the build directory lies: ccache serves them to every build directory and clone.
#pragma once

#include <string>

namespace moecore::testing {

const std::string& source_dir();  // the checkout's root
const std::string& build_dir();   // this build's directory
std::string moecore_binary();     // this build's moecore
// Open MPI's launcher and the collective-timeout probe (tests/parallel/mpi/timeout_probe.cpp);
// empty in a build without MPI (MOECORE_HAVE_MPI undefined).
const std::string& mpiexec();
const std::string& timeout_probe();

}  // namespace moecore::testing
