// A live progress line for terminals: iteration, bar, elapsed, ETA, last loss, redrawn in place.
// Log lines clear it first, so plain logs and the live line never interleave on one row.
#pragma once

#include <cstdint>
#include <iosfwd>

namespace moecore::train {

class ProgressLine {
 public:
  ProgressLine(std::ostream& out, bool enabled, int64_t total);
  void update(int64_t iteration, double elapsed_s, double loss);
  void clear();  // erase the line before printing a log line

 private:
  std::ostream& out_;
  bool enabled_;
  int64_t total_;
  bool shown_ = false;
};

}  // namespace moecore::train
