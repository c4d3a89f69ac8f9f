// A live progress line for terminals: iteration, bar, elapsed, ETA, last loss, redrawn in place.
// Log lines clear it first, so plain logs and the live line never interleave on one row.
// Redrawn at most every 0.2 s, so fast iterations do not flood the terminal.
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
  double last_draw_ = -1.0;  // elapsed seconds at the last redraw
};

}  // namespace moecore::train
