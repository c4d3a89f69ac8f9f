// The paths of tests/common/paths.h: this file alone is compiled with them (tests/CMakeLists.txt).
#include "common/paths.h"

namespace moecore::testing {

const std::string& source_dir() {
  static const std::string s = MOECORE_SOURCE_DIR;
  return s;
}

const std::string& build_dir() {
  static const std::string s = MOECORE_BUILD_DIR;
  return s;
}

std::string moecore_binary() { return build_dir() + "/moecore"; }

const std::string& mpiexec() {
  static const std::string s = MOECORE_MPIEXEC;
  return s;
}

const std::string& timeout_probe() {
  static const std::string s = MOECORE_TIMEOUT_PROBE;
  return s;
}

}  // namespace moecore::testing
