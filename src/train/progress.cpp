#include "train/progress.h"

#include <fmt/format.h>

#include <ostream>
#include <string>

namespace moecore::train {

static std::string hms(double s) {
  int64_t t = static_cast<int64_t>(s + 0.5);
  return fmt::format("{:02}:{:02}:{:02}", t / 3600, (t / 60) % 60, t % 60);
}

ProgressLine::ProgressLine(std::ostream& out, bool enabled, int64_t total)
    : out_(out), enabled_(enabled), total_(total) {}

void ProgressLine::update(int64_t iteration, double elapsed_s, double loss) {
  if (!enabled_) return;
  if (iteration != total_ && last_draw_ >= 0 && elapsed_s - last_draw_ < 0.2) return;
  last_draw_ = elapsed_s;
  constexpr int kWidth = 30;
  int filled = static_cast<int>(kWidth * iteration / total_);
  double eta = iteration > 0 ? elapsed_s / iteration * (total_ - iteration) : 0.0;
  out_ << fmt::format("\r[{}{}] {}/{} elapsed {} ETA {} lm loss {:.4f}\x1b[K",
                      std::string(filled, '='), std::string(kWidth - filled, ' '), iteration,
                      total_, hms(elapsed_s), hms(eta), loss)
       << std::flush;
  shown_ = true;
}

void ProgressLine::clear() {
  if (!enabled_ || !shown_) return;
  out_ << "\r\x1b[K" << std::flush;
  shown_ = false;
}

}  // namespace moecore::train
