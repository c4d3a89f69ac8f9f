// The figures docs/plan.md publishes for the planner, pinned: each is checked against what the
// planner computes now, within half a unit of the last digit the document prints
// (kPlanDocumentedHalfUnits, docs/numerics.md), and the document must still print it on the line
// the test names, so a formula that changes fails here until the figure and its text agree again.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <sstream>
#include <string>

#include "common/paths.h"
#include "common/tolerances.h"

namespace moecore::plan {

inline const std::string& docs_plan_md() {
  static const std::string text = [] {
    std::ifstream in(::moecore::testing::source_dir() + "/docs/plan.md");
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }();
  return text;
}

// `printed`: the figure as docs/plan.md prints it ("69.9", "1,313,792"); `line`: a fragment of
// the document holding it (the table row or sentence), which must be found there verbatim.
inline ::testing::AssertionResult documented(double planned, const std::string& printed,
                                             const std::string& line) {
  if (line.find(printed) == std::string::npos) {
    return ::testing::AssertionFailure() << "'" << printed << "' is not in '" << line << "'";
  }
  if (docs_plan_md().find(line) == std::string::npos) {
    return ::testing::AssertionFailure() << "docs/plan.md no longer says '" << line << "'";
  }
  std::string digits;
  for (char c : printed) {
    if (c != ',') digits += c;
  }
  const size_t dot = digits.find('.');
  const int decimals = dot == std::string::npos ? 0 : static_cast<int>(digits.size() - dot - 1);
  const double unit = std::pow(10.0, -decimals), value = std::stod(digits);
  // The slack covers the binary representation of the printed decimal (5.3 is not 5.3 exactly).
  const double allowed = testing::kPlanDocumentedHalfUnits * unit * (1 + 1e-9);
  if (std::abs(planned - value) <= allowed) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "the planner gives " << planned << ", docs/plan.md prints " << printed << " (+-"
         << testing::kPlanDocumentedHalfUnits * unit << ") in '" << line << "'";
}

}  // namespace moecore::plan
