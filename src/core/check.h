// Checked errors: every failure names the component, the values and the fix, and records the
// failed expression with file:line. Errors are exceptions so the command line can print them
// cleanly and tests can assert on them. Users read the message alone: the source location is
// kept in the error (where()) and appended to the message only with MOECORE_DEBUG_ERRORS=1 in
// the environment (a path of the machine that built the binary means nothing to them).
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>
#include <utility>

namespace moecore {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg, std::string where = {})
      : std::runtime_error(msg), where_(std::move(where)) {}
  // "check `expr` failed at file:line" (empty for an Error made without a location).
  const std::string& where() const { return where_; }

 private:
  std::string where_;
};

// Whether MOECORE_DEBUG_ERRORS is set (to anything but "" or "0"): messages carry their source
// location.
bool debug_errors();

// Throws moecore::Error with "<msg>", plus " (check `expr` failed at file:line)" under
// debug_errors().
[[noreturn]] void fail(const char* expr, const char* file, int line, const std::string& msg);

}  // namespace moecore

// MOE_CHECK(cond, "[router] top_k={} > num_experts={}: lower --moe-router-topk", k, e);
#define MOE_CHECK(cond, ...)                                                        \
  do {                                                                              \
    if (!(cond)) ::moecore::fail(#cond, __FILE__, __LINE__, fmt::format(__VA_ARGS__)); \
  } while (0)

#define MOE_FAIL(...) ::moecore::fail(nullptr, __FILE__, __LINE__, fmt::format(__VA_ARGS__))
