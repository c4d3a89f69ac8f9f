// Checked errors: every failure names the component, the values and the fix, and records the
// failed expression with file:line. Errors are exceptions so the command line can print them
// cleanly and tests can assert on them.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace moecore {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Throws moecore::Error with "<msg> (check `expr` failed at file:line)".
[[noreturn]] void fail(const char* expr, const char* file, int line, const std::string& msg);

}  // namespace moecore

// MOE_CHECK(cond, "[router] top_k={} > num_experts={}: lower --moe-router-topk", k, e);
#define MOE_CHECK(cond, ...)                                                        \
  do {                                                                              \
    if (!(cond)) ::moecore::fail(#cond, __FILE__, __LINE__, fmt::format(__VA_ARGS__)); \
  } while (0)

#define MOE_FAIL(...) ::moecore::fail(nullptr, __FILE__, __LINE__, fmt::format(__VA_ARGS__))
