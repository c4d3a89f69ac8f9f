// Megatron-LM flags that `moecore train` does not implement, so that an existing launch script
// either runs or stops with a clear reason — never silently changes meaning:
//   Ignored   — implementation details (kernel fusions, logging back-ends): accepted with a
//               one-line notice;
//   OnlyValue — accepted when the value is the one moecore implements (e.g. --normalization
//               RMSNorm), an error otherwise;
//   Rejected  — would change the model or the training math: an error naming the reason.
// docs/flags.md lists them all.
#pragma once

#include <CLI/CLI.hpp>
#include <deque>
#include <string>
#include <vector>

namespace moecore::train {

enum class CompatKind { Ignored, OnlyValue, Rejected };

struct CompatFlag {
  const char* name;     // with the leading "--"
  bool takes_value;
  CompatKind kind;
  const char* allowed;  // OnlyValue: the accepted values, comma-separated
  const char* why;
};

const std::vector<CompatFlag>& megatron_compat_flags();

class MegatronCompat {
 public:
  // Registers every flag of the table that `app` does not define itself.
  void add_to(CLI::App& app);
  // After parsing: throws moecore::Error for a rejected flag or a wrong value; returns the
  // notices for ignored flags.
  std::vector<std::string> check() const;

 private:
  struct Entry {
    const CompatFlag* flag;
    CLI::Option* opt;
    std::string* value;
  };
  std::vector<Entry> entries_;
  std::deque<std::string> values_;
};

}  // namespace moecore::train
