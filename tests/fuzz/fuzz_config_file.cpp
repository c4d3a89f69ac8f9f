// libFuzzer target for `--config FILE`, the TOML flags file (src/cli/config_file.cpp): any
// bytes, read from a file as `moecore train --config` reads it, either give command-line
// arguments (each flag "--name", its values after it) or fail with moecore::Error.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/check.h"
#include "fuzz_common.h"
#include "cli/config_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moecore::cli;
  const std::string path = moecore::fuzz::write_file("flags.toml", data, size);
  try {
    const std::vector<std::string> args = config_file_args(path);
    FUZZ_EXPECT(args.empty() || args[0].starts_with("--"));
    // As `moecore train --config FILE --seed 1` expands it: the file's arguments after the
    // subcommand, the command line's last.
    const std::vector<std::string> expanded =
        expand_config_files({"train", "--config", path, "--seed", "1"});
    FUZZ_EXPECT(expanded.size() == args.size() + 3 && expanded.front() == "train" &&
                expanded.back() == "1");
  } catch (const moecore::Error&) {
    // rejected with a message: fine
  }
  return 0;
}
