#include "core/check.h"

#include <cstdlib>

namespace moecore {

bool debug_errors() {
  static const bool on = [] {
    const char* v = std::getenv("MOECORE_DEBUG_ERRORS");
    return v != nullptr && v[0] != '\0' && std::string(v) != "0";
  }();
  return on;
}

void fail(const char* expr, const char* file, int line, const std::string& msg) {
  std::string where = expr != nullptr ? fmt::format("check `{}` failed at {}:{}", expr, file, line)
                                      : fmt::format("at {}:{}", file, line);
  std::string text = debug_errors() ? fmt::format("{} ({})", msg, where) : msg;
  throw Error(text, std::move(where));
}

}  // namespace moecore
