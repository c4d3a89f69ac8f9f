#include "core/check.h"

namespace moecore {

void fail(const char* expr, const char* file, int line, const std::string& msg) {
  if (expr != nullptr) {
    throw Error(fmt::format("{} (check `{}` failed at {}:{})", msg, expr, file, line));
  }
  throw Error(fmt::format("{} (at {}:{})", msg, file, line));
}

}  // namespace moecore
