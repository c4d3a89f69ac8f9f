#include "cli/megatron_compat.h"

#include <fmt/format.h>

#include <cstdlib>
#include <map>
#include <sstream>

#include "core/check.h"

namespace moecore::cli {

namespace {

constexpr FlagClass N = FlagClass::NoEffect;
constexpr FlagClass Y = FlagClass::NotYet;
constexpr const char* kFusion = "kernel fusion choice: moecore has its own kernels";
constexpr const char* kLogs = "logging back-end: use --metrics-file (JSON lines)";

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, sep);) out.push_back(item);
  if (!s.empty() && s.back() == sep) out.emplace_back();
  if (s.empty()) out.emplace_back();
  return out;
}

bool same_value(const MegatronFlag& f, const std::string& a, const std::string& b) {
  if (a == b) return true;
  if (f.type != ArgType::Int && f.type != ArgType::Float) return false;
  // Lists compare element by element, numbers by value ("1" == "1.0").
  std::vector<std::string> x = split(a, ' '), y = split(b, ' ');
  if (x.size() != y.size()) return false;
  for (size_t i = 0; i < x.size(); ++i) {
    char *ex = nullptr, *ey = nullptr;
    const double vx = std::strtod(x[i].c_str(), &ex), vy = std::strtod(y[i].c_str(), &ey);
    if (*ex != '\0' || *ey != '\0' || x[i].empty() || vx != vy) return false;
  }
  return true;
}

std::string issue_text(const FlagRule* r) {
  if (r == nullptr || r->issue[0] == '\0') return "not implemented yet";
  return fmt::format("not implemented yet (issue {})", r->issue);
}

}  // namespace

const std::vector<FlagRule>& megatron_flag_rules() {
  static const std::vector<FlagRule> kRules = {
      // Implementation details: the same math whatever they say.
      {"--use-mcore-models", N, "", "moecore has one model implementation", ""},
      {"--transformer-impl", N, "", "moecore has its own kernels", ""},
      {"--attention-backend", N, "", "moecore has its own attention kernel", ""},
      {"--use-flash-attn", N, "", "the attention kernel is always memory-frugal", ""},
      {"--no-masked-softmax-fusion", N, "", kFusion, ""},
      {"--no-bias-gelu-fusion", N, "", kFusion, ""},
      {"--no-bias-swiglu-fusion", N, "", kFusion, ""},
      {"--no-bias-dropout-fusion", N, "", kFusion, ""},
      {"--no-rope-fusion", N, "", kFusion, ""},
      {"--no-persist-layer-norm", N, "", kFusion, ""},
      {"--no-gradient-accumulation-fusion", N, "", kFusion, ""},
      {"--moe-permute-fusion", N, "", kFusion, ""},
      {"--moe-router-fusion", N, "", kFusion, ""},
      {"--cross-entropy-loss-fusion", N, "", "the output head and cross entropy are always fused",
       ""},
      {"--cross-entropy-fusion-impl", N, "", kFusion, ""},
      {"--moe-grouped-gemm", N, "", "experts always run as one grouped GEMM", ""},
      {"--use-cpu-initialization", N, "", "initialization is layout-independent anyway", ""},
      {"--no-create-attention-mask-in-dataloader", N, "", "masks are implicit (causal)", ""},
      {"--no-position-embedding", N, "",
       "deprecated in Megatron, whose Megatron-Core GPT model ignores it: use "
       "--position-embedding-type none",
       ""},
      {"--distributed-backend", N, "", "Open MPI on CPUs", ""},
      {"--exit-signal", N, "",
       "with --exit-signal-handler each of SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 (and mpirun "
       "ending the job) stops the run after its step",
       ""},
      {"--dataloader-type", N, "", "samples are indexed deterministically", ""},
      {"--num-workers", N, "", "data is generated or read in-process", ""},
      {"--manual-gc", N, "", "no garbage collector", ""},
      {"--manual-gc-interval", N, "", "no garbage collector", ""},
      {"--tensorboard-dir", N, "", kLogs, ""},
      {"--wandb-project", N, "", kLogs, ""},
      {"--wandb-exp-name", N, "", kLogs, ""},
      {"--log-throughput", N, "", "throughput is always logged", ""},
      {"--log-memory-to-tensorboard", N, "", "peak memory is always logged", ""},
      {"--timing-log-level", N, "", "one timing level", ""},
      {"group:logging", N, "", kLogs, ""},
      {"group:one logger", N, "", kLogs, ""},
      {"group:straggler", N, "", "straggler detection: monitoring only", ""},
      {"group:workload inspector", N, "", "monitoring only", ""},
      {"group:profiling", N, "", "profiling only", ""},
      {"group:opentelemetry", N, "", "monitoring only", ""},
      // What moecore implements only in part: the values it implements are accepted.
      {"--position-embedding-type", Y, "learned_absolute|rope|none",
       "position embeddings other than learned_absolute, rope and none", ""},
      {"--rotary-percent", Y, "1", "partial rotary embeddings", ""},
      {"--rotary-seq-len-interpolation-factor", Y, "|1", "RoPE sequence-length interpolation", ""},
      {"--hierarchical-context-parallel-sizes", Y, "",
       "hierarchical context parallelism (--cp-comm-type a2a+p2p: moecore builds p2p and "
       "allgather)", ""},
      {"--fp16", Y, "", "fp16 with loss scaling", ""},
      {"--fp8-format", Y, "", "fp8", ""},
      {"--train-samples", Y, "", "sample-based training: give --train-iters", ""},
      {"--tokenizer-type", Y,
       "|ByteLevel|NullTokenizer|GPT2BPETokenizer|HuggingFaceTokenizer|SentencePieceTokenizer|"
       "GPTSentencePieceTokenizer|Llama2Tokenizer",
       "BertWordPiece, TikTokenizer, Multimodal and SFT tokenizers", "14"},
      {"--ckpt-format", N, "", "moecore writes one format (docs/checkpoint_format.md)", ""},
      {"--use-dist-ckpt", N, "", "moecore's checkpoints are always sharded and reshardable", ""},
      {"--auto-detect-ckpt-format", N, "", "moecore reads one format", ""},
      {"--ckpt-fully-parallel-save", N, "", "every rank writes its own shards", ""},
      {"--no-ckpt-fully-parallel-save", N, "", "every rank writes its own shards", ""},
      {"--ckpt-fully-parallel-load", N, "", "every rank reads its own slices", ""},
      {"--ckpt-assume-constant-structure", N, "", "a save takes no structure cache", ""},
      {"--verify-integrity", N, "", "every shard's size and SHA-256 are always checked", ""},
      {"group:checkpointing", Y, "", "checkpointing", "13"},
      {"group:data and dataloader", Y, "", "Megatron's data pipeline", "14"},
      {"group:tokenizer", Y, "", "Megatron's tokenizers", "14"},
      {"group:validation", Y, "", "evaluation", "14"},
  };
  return kRules;
}

const std::vector<std::string>& moecore_extra_choices() {
  // Megatron's --exit-signal takes a signal's name (signal.Signals[name]); the table records the
  // enum's values. The names of the signals the handler catches are taken.
  static const std::vector<std::string> kExtra = {
      "--tokenizer-type=ByteLevel", "--exit-signal=SIGTERM", "--exit-signal=SIGINT",
      "--exit-signal=SIGHUP", "--exit-signal=SIGUSR1", "--exit-signal=SIGUSR2"};
  return kExtra;
}

const FlagRule* find_rule(const MegatronFlag& f) {
  for (const FlagRule& r : megatron_flag_rules()) {
    for (const std::string& n : f.names) {
      if (n == r.name) return &r;
    }
  }
  return nullptr;
}

static const FlagRule* find_group_rule(const MegatronFlag& f) {
  for (const FlagRule& r : megatron_flag_rules()) {
    if (std::string(r.name) == "group:" + f.group) return &r;
  }
  return nullptr;
}

static const FlagRule* rule_for(const MegatronFlag& f, bool bound) {
  if (const FlagRule* r = find_rule(f)) return r;
  if (bound) return nullptr;
  return find_group_rule(f);
}

FlagClass flag_class(const MegatronFlag& f, bool bound) {
  if (const FlagRule* r = rule_for(f, bound)) return r->cls;
  return bound ? FlagClass::Implemented : FlagClass::NotYet;
}

std::vector<std::string> accepted_values(const MegatronFlag& f) {
  const FlagRule* r = find_rule(f);
  if (r == nullptr || r->accepted[0] == '\0') return {default_text(f)};
  std::vector<std::string> out = split(r->accepted, '|');
  return out;
}

static std::string shown(const std::string& v) { return v.empty() ? "None" : v; }

std::vector<std::string> check_megatron_flags(
    const ParsedArgs& given, const std::function<bool(const MegatronFlag&)>& bound) {
  std::vector<std::string> notices;
  std::vector<std::string> refused;
  for (const MegatronFlag& f : megatron_arguments().flags) {
    const bool is_bound = bound(f);
    const FlagClass cls = flag_class(f, is_bound);
    const GivenFlag* g = given.find_dest(f.dest);
    // A store_true / store_false pair shares its dest: judge the flag that was given.
    if (g != nullptr && g->megatron != &f) continue;
    if (cls == FlagClass::NoEffect && g != nullptr) {
      notices.push_back(fmt::format("[flags] {} accepted without effect: {}", g->name,
                                    rule_for(f, is_bound)->why));
    }
    if (cls != FlagClass::NotYet) continue;
    const FlagRule* r = rule_for(f, is_bound);
    const std::string value = g != nullptr ? g->value_text() : default_text(f);
    bool ok = false;
    for (const std::string& a : accepted_values(f)) ok |= same_value(f, value, a);
    if (ok) continue;
    const std::string what = r != nullptr ? r->why : f.dest;
    std::string fix;
    const std::vector<std::string> acc = accepted_values(f);
    if (f.action != ArgAction::Store) {
      fix = g != nullptr ? fmt::format("remove {}", g->name) : fmt::format("add {}", f.name());
    } else if (acc.size() == 1 && acc[0].empty()) {
      fix = fmt::format("remove {}", f.name());
    } else {
      std::string list;
      for (const std::string& a : acc) list += (list.empty() ? "" : " or ") + shown(a);
      fix = fmt::format("moecore implements {} {}", f.name(), list);
    }
    if (g != nullptr) {
      refused.push_back(fmt::format(
          "{}{}{}: {} is {}; {}", g->name, g->values.empty() ? "" : " ",
          g->value_text() == "true" || g->value_text() == "false" ? "" : g->value_text(), what,
          issue_text(r), fix));
    } else if (f.action != ArgAction::Store) {
      refused.push_back(
          fmt::format("{} is absent: {} is {}; {}", f.name(), what, issue_text(r), fix));
    } else {
      refused.push_back(fmt::format("{} is absent, so Megatron's default {} applies: {} is {}; {}",
                                    f.name(), shown(value), what, issue_text(r), fix));
    }
  }
  // Every refusal in one error, so a pasted command line is fixed in one go.
  if (refused.size() == 1) MOE_FAIL("[flags] {}", refused[0]);
  if (!refused.empty()) {
    std::string list;
    for (const std::string& line : refused) list += "\n  " + line;
    MOE_FAIL("[flags] {} flags ask for what moecore does not implement yet:{}", refused.size(),
             list);
  }
  return notices;
}

std::string megatron_flags_markdown(const std::function<bool(const MegatronFlag&)>& bound,
                                    const std::function<std::string(const MegatronFlag&)>& help) {
  const MegatronArguments& t = megatron_arguments();
  std::map<FlagClass, std::vector<const MegatronFlag*>> by_class;
  for (const MegatronFlag& f : t.flags) by_class[flag_class(f, bound(f))].push_back(&f);
  auto names = [](const MegatronFlag& f) {
    std::string s;
    for (const std::string& n : f.names) s += (s.empty() ? "" : ", ") + ("`" + n + "`");
    return s;
  };
  auto cell = [](std::string s) {
    for (char& c : s) c = c == '|' ? '/' : c;
    return s;
  };
  std::string out = fmt::format(
      "Generated from `src/cli/megatron_arguments.json` ({} at commit `{}`) by `moecore "
      "train --flags-markdown`; a test checks it is current. {} flags: {} implemented, {} "
      "accepted without effect, {} not implemented yet.\n",
      t.source, t.commit, t.flags.size(), by_class[FlagClass::Implemented].size(),
      by_class[FlagClass::NoEffect].size(), by_class[FlagClass::NotYet].size());
  out += "\n### Implemented\n\n| flag | Megatron group | default | meaning in moecore |\n"
         "| --- | --- | --- | --- |\n";
  for (const MegatronFlag* f : by_class[FlagClass::Implemented]) {
    out += fmt::format("| {} | {} | {} | {} |\n", names(*f), f->group,
                       cell(shown(default_text(*f))), cell(help(*f)));
  }
  out += "\n### Accepted without effect (a one-line notice says why)\n\n| flag | why |\n"
         "| --- | --- |\n";
  for (const MegatronFlag* f : by_class[FlagClass::NoEffect]) {
    out += fmt::format("| {} | {} |\n", names(*f), cell(rule_for(*f, bound(*f))->why));
  }
  out += "\n### Not implemented yet (refused unless the value is one moecore implements)\n\n"
         "| flag | Megatron group | accepted values | not implemented yet | issue |\n"
         "| --- | --- | --- | --- | --- |\n";
  for (const MegatronFlag* f : by_class[FlagClass::NotYet]) {
    const FlagRule* r = rule_for(*f, bound(*f));
    std::string acc;
    for (const std::string& a : accepted_values(*f)) acc += (acc.empty() ? "" : ", ") + shown(a);
    out += fmt::format("| {} | {} | {} | {} | {} |\n", names(*f), f->group, cell(acc),
                       r != nullptr ? cell(r->why) : "", r != nullptr && r->issue[0] ? r->issue : "");
  }
  return out;
}

}  // namespace moecore::cli
