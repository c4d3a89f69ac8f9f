#include "ckpt/checkpoint_command.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <iostream>
#include <memory>
#include <set>

#include "ckpt/checkpoint_dir.h"
#include "ckpt/safetensors.h"
#include "core/check.h"

namespace moecore::ckpt {
namespace {

namespace fs = std::filesystem;

std::vector<std::byte> whole(CheckpointReader& r, const GlobalTensor& t) {
  std::vector<std::byte> out(static_cast<size_t>(t.numel()) * dtype_size(t.dtype));
  r.read(t.name, t.dtype, -1, 0, 0, out);
  return out;
}

bool skipped(const std::string& name, const std::vector<std::string>& prefixes) {
  for (const std::string& p : prefixes) {
    if (name.rfind(p, 0) == 0) return true;
  }
  return false;
}

}  // namespace

fs::path resolve_checkpoint(const fs::path& dir) {
  std::error_code ec;
  if (fs::exists(dir / kManifestFile, ec)) return dir;
  const std::optional<int64_t> it = read_tracker(dir);
  MOE_CHECK(it.has_value(),
            "[checkpoint] '{}' is neither a checkpoint (no {}) nor a --save directory (no {})",
            dir.string(), kManifestFile, kTrackerFile);
  return find_iteration_dir(dir, *it);
}

std::vector<std::string> compare_checkpoints(const fs::path& a, const fs::path& b,
                                             const std::vector<std::string>& skip_prefixes) {
  CheckpointReader ra(resolve_checkpoint(a)), rb(resolve_checkpoint(b));
  std::vector<std::string> diff;
  std::set<std::string> in_a;
  for (const GlobalTensor& t : ra.manifest().tensors) {
    if (skipped(t.name, skip_prefixes)) continue;
    in_a.insert(t.name);
    const GlobalTensor* u = rb.manifest().find(t.name);
    if (u == nullptr) {
      diff.push_back(fmt::format("'{}': only in {}", t.name, ra.dir().string()));
      continue;
    }
    if (u->dtype != t.dtype || u->shape != t.shape) {
      diff.push_back(fmt::format("'{}': {} {} and {} {}", t.name, t.dtype, format_shape(t.shape),
                                 u->dtype, format_shape(u->shape)));
      continue;
    }
    const std::vector<std::byte> x = whole(ra, t), y = whole(rb, *u);
    size_t first = 0;
    int64_t n = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      if (x[i] != y[i] && n++ == 0) first = i;
    }
    if (n > 0) {
      diff.push_back(fmt::format("'{}': {} of {} bytes differ (the first at byte {})", t.name, n,
                                 x.size(), first));
    }
  }
  for (const GlobalTensor& u : rb.manifest().tensors) {
    if (!skipped(u.name, skip_prefixes) && in_a.count(u.name) == 0)
      diff.push_back(fmt::format("'{}': only in {}", u.name, rb.dir().string()));
  }
  return diff;
}

Subcommand add_checkpoint_command(CLI::App& app) {
  CLI::App* cli = app.add_subcommand("checkpoint", "Inspect and compare checkpoints");
  cli->require_subcommand(1);
  auto dirs = std::make_shared<std::vector<std::string>>(2);
  auto weights_only = std::make_shared<bool>(false);
  CLI::App* info = cli->add_subcommand("info", "A checkpoint's iteration, layout, state, tensors");
  info->add_option("dir", (*dirs)[0], "--save directory or iter_NNNNNNN directory")->required();
  CLI::App* compare =
      cli->add_subcommand("compare", "Whether two checkpoints hold the same global tensors");
  compare->add_option("a", (*dirs)[0], "first checkpoint")->required();
  compare->add_option("b", (*dirs)[1], "second checkpoint")->required();
  compare->add_flag("--weights-only", *weights_only, "Leave the optimizer state out");
  CLI::App* recover = cli->add_subcommand(
      "recover", "Finish or undo what a crash in a save left in a --save directory");
  recover->add_option("dir", (*dirs)[0], "--save directory")->required();
  return Subcommand{
      cli, [info, recover, dirs, weights_only]() {
        if (recover->parsed()) {
          std::error_code ec;
          MOE_CHECK(fs::is_directory((*dirs)[0], ec), "[checkpoint] '{}' is not a directory",
                    (*dirs)[0]);
          const std::string did = recover_checkpoint_dir((*dirs)[0]);
          std::cout << fmt::format("[checkpoint] {}: {}\n",
                                   did.empty() ? "nothing to recover" : "recovered",
                                   did.empty() ? (*dirs)[0] : (*dirs)[0] + ": " + did);
          return 0;
        }
        if (info->parsed()) {
          CheckpointReader r(resolve_checkpoint((*dirs)[0]));
          const Manifest& m = r.manifest();
          std::string layout;
          for (const auto& [k, v] : m.layout)
            layout += fmt::format("{}{} {}", layout.empty() ? "" : ", ", k, v);
          uint64_t bytes = 0;
          for (const ShardFile& f : m.files) bytes += f.bytes;
          std::cout << fmt::format(
              "{}\n  iteration {} | world {} ({}) | {} shards, {} bytes, hashes "
              "checked\n  state {}\n",
              r.dir().string(), m.iteration, m.world_size, layout, m.files.size(), bytes,
              m.state.dump());
          for (const GlobalTensor& t : m.tensors) {
            std::cout << fmt::format("  {} {} {} in {} slice(s)\n", t.name, t.dtype,
                                     format_shape(t.shape), t.slices.size());
          }
          return 0;
        }
        const std::vector<std::string> skip =
            *weights_only ? std::vector<std::string>{"exp_avg.", "exp_avg_sq."}
                          : std::vector<std::string>{};
        std::vector<std::string> diff;
        try {
          diff = compare_checkpoints((*dirs)[0], (*dirs)[1], skip);
        } catch (const Error& e) {
          // diff's and cmp's convention: 2 is "could not compare", so a script that reads the
          // status never takes a corrupt or missing checkpoint for a difference in the values.
          std::cerr << "error: " << e.what() << "\n";
          return 2;
        }
        for (const std::string& d : diff) std::cout << d << "\n";
        std::cout << fmt::format("[checkpoint] {} and {}: {}\n", (*dirs)[0], (*dirs)[1],
                                 diff.empty() ? "the same global tensors, bytewise"
                                              : fmt::format("{} difference(s)", diff.size()));
        return diff.empty() ? 0 : 1;
      }};
}

}  // namespace moecore::ckpt
