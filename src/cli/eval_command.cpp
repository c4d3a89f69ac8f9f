#include "cli/eval_command.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "parallel/device_assignment.h"
#include "parallel/process_groups.h"
#include "parallel/runtime.h"
#include "cli/train_flags.h"
#include "train/trainer.h"

namespace moecore::cli {

using train::EvalMetrics;
using train::Trainer;
namespace {

using nlohmann::json;

// Pulls "--tokens-json FILE" (or "--tokens-json=FILE") out of args.
std::string take_tokens_json(std::vector<std::string>& args) {
  std::string path;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--tokens-json") {
      MOE_CHECK(i + 1 < args.size(), "[eval] --tokens-json needs a FILE");
      path = args[i + 1];
      args.erase(args.begin() + static_cast<std::ptrdiff_t>(i),
                 args.begin() + static_cast<std::ptrdiff_t>(i) + 2);
      --i;
    } else if (args[i].rfind("--tokens-json=", 0) == 0) {
      path = args[i].substr(14);
      args.erase(args.begin() + static_cast<std::ptrdiff_t>(i));
      --i;
    }
  }
  return path;
}

}  // namespace

std::vector<std::vector<int32_t>> read_tokens_json(const std::string& path, int64_t vocab_size) {
  std::error_code ec;
  MOE_CHECK(!std::filesystem::is_directory(path, ec),
            "[eval] --tokens-json '{}' is a directory: give the JSON file of token-id lists", path);
  std::ifstream in(path);
  MOE_CHECK(in.good(), "[eval] cannot read --tokens-json '{}'", path);
  json j;
  try {
    j = json::parse(std::string(std::istreambuf_iterator<char>(in), {}));
  } catch (const json::exception& e) {
    MOE_FAIL("[eval] --tokens-json '{}' is not valid JSON: {}", path, e.what());
  }
  MOE_CHECK(j.is_array() && !j.empty(),
            "[eval] --tokens-json '{}' must be a non-empty JSON list of token-id lists", path);
  std::vector<std::vector<int32_t>> out;
  int64_t predictions = 0;
  for (size_t i = 0; i < j.size(); ++i) {
    MOE_CHECK(j[i].is_array(), "[eval] --tokens-json '{}': entry {} is {}, not a list of token ids",
              path, i, j[i].type_name());
    std::vector<int32_t> seq;
    for (const json& v : j[i]) {
      MOE_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < vocab_size,
                "[eval] --tokens-json '{}': sequence {} holds {}, not a token id in [0, {})", path,
                i, v.dump(), vocab_size);
      seq.push_back(v.get<int32_t>());
    }
    predictions += std::max<int64_t>(0, static_cast<int64_t>(seq.size()) - 1);
    out.push_back(std::move(seq));
  }
  // A mean loss of 0 over no predictions would read as a perfect score.
  MOE_CHECK(predictions > 0,
            "[eval] --tokens-json '{}': its {} sequence(s) hold nothing to score (a next-token "
            "loss needs a sequence of at least 2 tokens)",
            path, out.size());
  return out;
}

Subcommand add_eval_command(CLI::App& app) {
  CLI::App* cli = app.add_subcommand(
      "eval",
      "Evaluate a checkpoint (--load DIR with the model's flags or --use-checkpoint-args; "
      "--tokens-json FILE)");
  cli->prefix_command();
  cli->set_help_flag();
  cli->allow_extras();
  return Subcommand{
      cli, [cli]() {
        std::vector<std::string> args = cli->remaining();
        const std::string tokens_json = take_tokens_json(args);
        // What training needs and eval does not, unless given: eval runs no step.
        const std::vector<std::string>& no_step = no_step_placeholder_args();
        args.insert(args.begin(), no_step.begin(), no_step.end());
        TrainFlags flags;
        try {
          flags = parse_train_args(args);
        } catch (const CLI::CallForHelp&) {
          std::cout << "moecore eval --load DIR <the model's train flags, or "
                       "--use-checkpoint-args> [--tokens-json FILE]\n\n"
                    << train_help();
          return 0;
        } catch (const CLI::ParseError& e) {
          std::cerr << "error: [flags] " << e.what() << "\n";
          return 2;
        }
        const CheckpointConfig& ck = flags.train.ckpt;
        MOE_CHECK(!ck.load.empty(),
                  "[eval] give the checkpoint to evaluate: --load DIR (a --save "
                  "directory, or `moecore convert`'s output)");
        for (const std::string& n : flags.notices) std::cout << n << "\n";
        TrainConfig tc = flags.train;
        tc.ckpt = CheckpointConfig{};  // eval loads below and never saves
        const parallel::Runtime rt = parallel::runtime_init(nullptr, nullptr);
        // Each process's GPU, before anything creates a CUDA context.
        parallel::select_device(rt, parse_device(flags.train.device), std::cout);
        parallel::ProcessGroups groups =
            parallel::init_process_groups(flags.parallel, rt, model_dims(flags.model));
        Trainer trainer(flags.model, tc, &groups);
        Trainer::LoadOptions opt;
        opt.optim = false;
        opt.iteration = ck.ckpt_step;
        const std::optional<int64_t> it = trainer.load_checkpoint(ck.load, opt);
        MOE_CHECK(it.has_value(), "[eval] --load '{}' holds no checkpoint (no {})", ck.load,
                  "latest_checkpointed_iteration.txt");
        const bool print = groups.rank() == 0;
        if (print) {
          std::cout << fmt::format("[eval] iteration {} of {}\n", *it, ck.load);
        }
        if (tokens_json.empty()) {
          MOE_CHECK(trainer.has_eval_data(data::Split::Valid),
                    "[eval] nothing to evaluate on: give --tokens-json FILE, or "
                    "--data-path with a validation split (--split) and "
                    "--eval-iters > 0");
          const EvalMetrics r = trainer.evaluate(data::Split::Valid);
          if (print) {
            std::cout << fmt::format(
                "[eval] validation loss over {} global batches | lm loss value: "
                "{:.6E} | lm loss PPL: {:.6E}\n",
                tc.eval_iters, r.lm_loss, r.ppl);
          }
          return 0;
        }
        const auto seqs = read_tokens_json(tokens_json, flags.model.vocab_size);
        const int64_t S = flags.model.seq_length;
        for (size_t i = 0; i < seqs.size(); ++i) {
          MOE_CHECK(static_cast<int64_t>(seqs[i].size()) <= S,
                    "[eval] --tokens-json sequence {} has {} tokens, more than "
                    "--seq-length {}: raise --seq-length or split it",
                    i, seqs[i].size(), S);
        }
        // Each sequence alone in a micro-batch, through the evaluation's forward in this layout
        // (Trainer::score_sequences): device memory, pipeline stages and CP chunks alike.
        const std::vector<double> sums = trainer.score_sequences(seqs);
        double sum = 0;
        int64_t n = 0;
        for (size_t i = 0; i < seqs.size(); ++i) {
          const int64_t predictions =
              std::max<int64_t>(0, static_cast<int64_t>(seqs[i].size()) - 1);
          sum += sums[i];
          n += predictions;
          if (print) {
            std::cout << (predictions > 0
                              ? fmt::format("[eval] sequence {}: {} tokens | mean next-token loss "
                                            "{:.9f}\n",
                                            i, seqs[i].size(),
                                            sums[i] / static_cast<double>(predictions))
                              : fmt::format("[eval] sequence {}: {} token(s) | nothing to score\n",
                                            i, seqs[i].size()));
          }
        }
        if (print) {
          std::cout << fmt::format(
              "[eval] {} sequences, {} predictions | mean next-token loss {:.9f}\n", seqs.size(), n,
              n > 0 ? sum / static_cast<double>(n) : 0.0);
        }
        return 0;
      }};
}

}  // namespace moecore::cli
