// The range of every numeric flag of `moecore train` / `moecore eval`, checked on the values the
// user gave (command line, --config file, --use-checkpoint-args) before anything is built: a size
// is >= 1, a probability in [0, 1), every float finite. One table, so a value out of range stops
// with the same kind of message whatever the flag, instead of reaching a default (0 read as
// "unset") or failing steps later.
#pragma once

#include <string>
#include <vector>

#include "cli/megatron_argv.h"

namespace moecore::cli {

struct FlagRange {
  const char* flag;  // the name moecore binds (a Megatron alias is matched too)
  double lo;
  bool lo_open;  // lo itself is refused
  double hi;
  bool hi_open;
  const char* why;  // what the bound protects, for the message ("" when obvious)
};

// The table (for the tests, which try each bound).
const std::vector<FlagRange>& flag_ranges();

// Throws naming the flag, the value, the range and why, for the first given value out of its
// range; every given float flag must be finite. A value that is not a number is left to the
// parser's own message.
void check_flag_ranges(const ParsedArgs& given);

}  // namespace moecore::cli
