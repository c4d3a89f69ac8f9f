// Layer placement over pipeline stages, Megatron-Core's rules (get_num_layers_to_build,
// get_transformer_layer_offset, PipelineParallelLayerLayout, and the checks of arguments.py and
// TransformerConfig): per-virtual-stage counts first, then offsets as running sums in stage
// order, so a layer can be neither dropped nor placed twice.
#include "parallel/pipeline_layout.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>

#include "core/check.h"

namespace moecore::parallel {

namespace {

constexpr const char* kLayoutFlag = "--pipeline-model-parallel-layout";
// A layout unrolls to one letter per layer; a million is far beyond any model and keeps a typo
// such as "t*99999999" from exhausting memory.
constexpr size_t kMaxLayoutLetters = size_t{1} << 20;

bool is_digit(char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; }

// Reads the repeat count at s[i] (digits), returns it and moves i past them; -1 if none.
int64_t read_count(const std::string& s, size_t& i, const std::string& layout) {
  if (i >= s.size() || !is_digit(s[i])) return -1;
  int64_t n = 0;
  for (; i < s.size() && is_digit(s[i]); ++i) {
    n = n * 10 + (s[i] - '0');
    MOE_CHECK(n <= static_cast<int64_t>(kMaxLayoutLetters),
              "[parallel] {} \"{}\": a repeat count over {} layers; write the layout of the model "
              "you train",
              kLayoutFlag, layout, kMaxLayoutLetters);
  }
  return n;
}

void append_repeated(std::string& out, const std::string& what, int64_t n,
                     const std::string& layout) {
  MOE_CHECK(out.size() + what.size() * static_cast<size_t>(n) <= kMaxLayoutLetters,
            "[parallel] {} \"{}\" unrolls to more than {} letters; write the layout of the model "
            "you train",
            kLayoutFlag, layout, kMaxLayoutLetters);
  for (int64_t k = 0; k < n; ++k) out += what;
}

// Megatron's first pattern, \(([^)]+)\)\*(\d+): a group up to the first ')' repeated n times.
std::string unroll_groups(const std::string& s, const std::string& layout) {
  std::string out;
  size_t i = 0;
  while (i < s.size()) {
    if (s[i] == '(') {
      const size_t close = s.find(')', i + 1);
      if (close != std::string::npos && close > i + 1 && close + 1 < s.size() &&
          s[close + 1] == '*') {
        size_t j = close + 2;
        const int64_t n = read_count(s, j, layout);
        if (n >= 0) {
          append_repeated(out, s.substr(i + 1, close - i - 1), n, layout);
          i = j;
          continue;
        }
      }
    }
    out += s[i++];
  }
  return out;
}

// Megatron's second pattern, (.)\*(\d+): one letter repeated n times.
std::string unroll_letters(const std::string& s, const std::string& layout) {
  std::string out;
  size_t i = 0;
  while (i < s.size()) {
    if (i + 1 < s.size() && s[i + 1] == '*' && s[i] != '\n') {
      size_t j = i + 2;
      const int64_t n = read_count(s, j, layout);
      if (n >= 0) {
        append_repeated(out, std::string(1, s[i]), n, layout);
        i = j;
        continue;
      }
    }
    out += s[i++];
  }
  return out;
}

std::string layer_range(const VirtualStage& s) {
  if (s.num_layers == 0) return "no decoder layers";
  if (s.num_layers == 1) return fmt::format("layer {}", s.first_layer);
  return fmt::format("layers {}-{}", s.first_layer, s.first_layer + s.num_layers - 1);
}

// The layout string's placement, validated as PipelineParallelLayerLayout.validate_layer_layout
// (with E and L pinned to the first and last virtual stage: the model builds the embedding and
// the loss there whatever the string says).
std::vector<VirtualStage> stages_from_layout(const ParallelConfig& cfg, int vp,
                                             int64_t num_layers, int64_t mtp_layers) {
  MOE_CHECK(cfg.first_stage_layers == 0 && cfg.last_stage_layers == 0 &&
                !cfg.account_for_embedding && !cfg.account_for_loss,
            "[parallel] {} \"{}\" places every layer itself and cannot be combined with "
            "--decoder-first-pipeline-num-layers ({}), --decoder-last-pipeline-num-layers ({}), "
            "--account-for-embedding-in-pipeline-split ({}) or "
            "--account-for-loss-in-pipeline-split ({}): drop those or the layout",
            kLayoutFlag, cfg.layout, cfg.first_stage_layers, cfg.last_stage_layers,
            cfg.account_for_embedding, cfg.account_for_loss);
  const std::vector<std::string> text = parse_pipeline_layout(cfg.layout);
  const int n = static_cast<int>(text.size());
  std::string flat;
  for (const std::string& t : text) flat += t;
  const auto count = [&](char c) { return std::count(flat.begin(), flat.end(), c); };
  MOE_CHECK(count('E') == 1 && text.front().starts_with('E'),
            "[parallel] {} \"{}\": the embedding E must appear exactly once, as the first letter "
            "of the first stage (it has {} E); write the layout as \"E...|...|...L\"",
            kLayoutFlag, cfg.layout, count('E'));
  MOE_CHECK(count('L') == 1 && text.back().ends_with('L'),
            "[parallel] {} \"{}\": the loss L must appear exactly once, as the last letter of "
            "the last stage (it has {} L); write the layout as \"E...|...|...L\"",
            kLayoutFlag, cfg.layout, count('L'));
  MOE_CHECK(count('t') == num_layers,
            "[parallel] {} \"{}\" places {} decoder layers (t) but --num-layers is {}: every "
            "layer must be placed exactly once; add or remove t's, or change --num-layers",
            kLayoutFlag, cfg.layout, count('t'), num_layers);
  MOE_CHECK(count('m') == mtp_layers,
            "[parallel] {} \"{}\" places {} MTP layers (m) but --mtp-num-layers is {}: give "
            "exactly --mtp-num-layers m's",
            kLayoutFlag, cfg.layout, count('m'), mtp_layers);
  const size_t first_m = flat.find('m');
  MOE_CHECK(first_m == std::string::npos || flat.find('t', first_m) == std::string::npos,
            "[parallel] {} \"{}\": a decoder layer (t) follows an MTP layer (m); the MTP layers "
            "come after every decoder layer",
            kLayoutFlag, cfg.layout);
  int mtp_stages = 0;
  for (int i = 0; i < n; ++i) {
    if (text[i].find('m') == std::string::npos) continue;
    ++mtp_stages;
    MOE_CHECK(i / cfg.pp == vp - 1,
              "[parallel] {} \"{}\": stage {} (rank {}, virtual stage {} of {}) holds MTP layers; "
              "Megatron places MTP only in the last virtual stage of a rank: move the m's to a "
              "stage {} or later",
              kLayoutFlag, cfg.layout, i, i % cfg.pp, i / cfg.pp, vp, (vp - 1) * cfg.pp);
  }
  MOE_CHECK(mtp_stages <= 1,
            "[parallel] {} \"{}\": the MTP layers are spread over {} stages; all of them must sit "
            "in one stage",
            kLayoutFlag, cfg.layout, mtp_stages);
  std::vector<VirtualStage> out(n);
  int64_t next = 0;
  for (int i = 0; i < n; ++i) {
    const std::string& t = text[i];
    out[i].first_layer = next;
    out[i].num_layers = std::count(t.begin(), t.end(), 't');
    out[i].num_mtp_layers = std::count(t.begin(), t.end(), 'm');
    out[i].embedding = t.find('E') != std::string::npos;
    out[i].loss = t.find('L') != std::string::npos;
    next += out[i].num_layers;
  }
  return out;
}

// Decoder layers per virtual stage (stage order) from the split flags.
std::vector<int64_t> split_counts(const ParallelConfig& cfg, int vp, int64_t num_layers) {
  const int pp = cfg.pp;
  std::vector<int64_t> per_rank(pp);
  const bool uneven = cfg.first_stage_layers != 0 || cfg.last_stage_layers != 0;
  if (uneven) {
    const int64_t first = cfg.first_stage_layers, last = cfg.last_stage_layers;
    MOE_CHECK(!cfg.account_for_embedding && !cfg.account_for_loss,
              "[parallel] --decoder-first-pipeline-num-layers ({}) / "
              "--decoder-last-pipeline-num-layers ({}) cannot be combined with "
              "--account-for-embedding-in-pipeline-split ({}) or "
              "--account-for-loss-in-pipeline-split ({}) (Megatron refuses it): size the first "
              "and last stages by hand, or drop the uneven stages",
              first, last, cfg.account_for_embedding, cfg.account_for_loss);
    MOE_CHECK(first >= 0 && last >= 0,
              "[parallel] --decoder-first-pipeline-num-layers {} and "
              "--decoder-last-pipeline-num-layers {} must be >= 1 (or unset)",
              first, last);
    MOE_CHECK(pp > 1,
              "[parallel] --decoder-first/last-pipeline-num-layers set uneven pipeline stages but "
              "--pipeline-model-parallel-size is {}: set it > 1 or drop them",
              pp);
    MOE_CHECK(first % vp == 0 && last % vp == 0,
              "[parallel] --decoder-first-pipeline-num-layers {} and "
              "--decoder-last-pipeline-num-layers {} must each be divisible by the {} virtual "
              "stages per rank (--num-virtual-stages-per-pipeline-rank): every chunk of a rank "
              "holds as many layers",
              first, last, vp);
    const int64_t middle_layers = num_layers - first - last;
    const int middle_stages = pp - (first > 0) - (last > 0);
    MOE_CHECK(middle_layers >= 0,
              "[parallel] --decoder-first-pipeline-num-layers {} + "
              "--decoder-last-pipeline-num-layers {} take more than --num-layers {}: lower them",
              first, last, num_layers);
    MOE_CHECK((middle_layers == 0) == (middle_stages == 0),
              "[parallel] uneven stages leave {} layers for {} middle pipeline stages "
              "(--num-layers {} - --decoder-first-pipeline-num-layers {} - "
              "--decoder-last-pipeline-num-layers {}, --pipeline-model-parallel-size {}): a middle "
              "stage cannot be empty and no layer may be left out; adjust the first/last counts",
              middle_layers, middle_stages, num_layers, first, last, pp);
    int64_t per_middle = 0;
    if (middle_stages > 0) {
      MOE_CHECK(middle_layers % middle_stages == 0,
                "[parallel] uneven stages leave {} layers for the {} middle pipeline stages "
                "(--num-layers {} - --decoder-first-pipeline-num-layers {} - "
                "--decoder-last-pipeline-num-layers {}): they must split evenly; adjust the "
                "first/last counts",
                middle_layers, middle_stages, num_layers, first, last);
      per_middle = middle_layers / middle_stages;
      MOE_CHECK(per_middle % vp == 0,
                "[parallel] each middle pipeline stage holds {} layers, not divisible by the {} "
                "virtual stages per rank (--num-virtual-stages-per-pipeline-rank): adjust "
                "--decoder-first/last-pipeline-num-layers or the virtual stages",
                per_middle, vp);
    }
    std::fill(per_rank.begin(), per_rank.end(), per_middle);
    if (first > 0) per_rank.front() = first;
    if (last > 0) per_rank.back() = last;
  } else {
    const int64_t counted = num_layers + cfg.account_for_embedding + cfg.account_for_loss;
    const std::string accounted =
        counted == num_layers
            ? std::string()
            : fmt::format(" (+{} for --account-for-embedding/loss-in-pipeline-split)",
                          counted - num_layers);
    MOE_CHECK(counted % pp == 0,
              "[parallel] --num-layers {}{} is not divisible by --pipeline-model-parallel-size "
              "{}: change either, or give uneven stages with --decoder-first-pipeline-num-layers "
              "/ --decoder-last-pipeline-num-layers or a --pipeline-model-parallel-layout",
              num_layers, accounted, pp);
    MOE_CHECK((counted / pp) % vp == 0,
              "[parallel] each pipeline rank holds {} layers (--num-layers {}{} / "
              "--pipeline-model-parallel-size {}), not divisible by the {} virtual stages per "
              "rank (--num-virtual-stages-per-pipeline-rank / "
              "--num-layers-per-virtual-pipeline-stage): change the virtual stages or the layers",
              counted / pp, num_layers, accounted, pp, vp);
    std::fill(per_rank.begin(), per_rank.end(), counted / pp);
  }
  std::vector<int64_t> counts(static_cast<size_t>(pp) * vp);
  for (int c = 0; c < vp; ++c) {
    for (int r = 0; r < pp; ++r) counts[c * pp + r] = per_rank[r] / vp;
  }
  // The embedding / loss stand in for one layer of the first / last virtual stage.
  if (!uneven && cfg.account_for_embedding) counts.front() -= 1;
  if (!uneven && cfg.account_for_loss) counts.back() -= 1;
  return counts;
}

}  // namespace

std::vector<std::string> parse_pipeline_layout(const std::string& layout) {
  MOE_CHECK(!layout.empty(), "[parallel] {} is empty: give the stages, e.g. \"Ett|tt|ttL\"",
            kLayoutFlag);
  std::string s;
  for (char c : layout) {
    if (c != ',') s += c;  // commas are cosmetic
  }
  s = unroll_letters(unroll_groups(s, layout), layout);
  std::vector<std::string> stages(1);
  for (char c : s) {
    if (c == '|') {
      stages.emplace_back();
      continue;
    }
    MOE_CHECK(c == 'E' || c == 't' || c == 'm' || c == 'L',
              "[parallel] {} \"{}\": invalid character '{}' (unrolled: \"{}\"); the letters are E "
              "(embedding), t (decoder layer), m (MTP layer), L (loss), '|' between stages, "
              "\"(...)*n\" or \"x*n\" to repeat, ',' as a separator",
              kLayoutFlag, layout, c, s);
    stages.back() += c;
  }
  return stages;
}

int ParallelConfig::vp(int64_t num_layers) const {
  const int given = int{layers_per_vp_stage != 0} + int{vp_stages != 0} + int{!layout.empty()};
  MOE_CHECK(given <= 1,
            "[parallel] at most one of --num-layers-per-virtual-pipeline-stage ({}), "
            "--num-virtual-stages-per-pipeline-rank ({}) and --pipeline-model-parallel-layout "
            "(\"{}\") may be given: keep one",
            layers_per_vp_stage, vp_stages, layout);
  MOE_CHECK(pp >= 1, "[parallel] --pipeline-model-parallel-size {} must be >= 1", pp);
  int v = 1;
  if (!layout.empty()) {
    const int64_t n = static_cast<int64_t>(parse_pipeline_layout(layout).size());
    MOE_CHECK(n % pp == 0,
              "[parallel] {} \"{}\" has {} stages, not a multiple of "
              "--pipeline-model-parallel-size {}: stage i runs on rank i % pp as its virtual "
              "stage i / pp; give {} or {} stages",
              kLayoutFlag, layout, n, pp, n / pp * pp, (n / pp + 1) * pp);
    v = static_cast<int>(n / pp);
  } else if (vp_stages != 0) {
    MOE_CHECK(vp_stages >= 1, "[parallel] --num-virtual-stages-per-pipeline-rank {} must be >= 1",
              vp_stages);
    v = vp_stages;
  } else if (layers_per_vp_stage != 0) {
    MOE_CHECK(layers_per_vp_stage >= 1,
              "[parallel] --num-layers-per-virtual-pipeline-stage {} must be >= 1",
              layers_per_vp_stage);
    MOE_CHECK(first_stage_layers == 0 && last_stage_layers == 0,
              "[parallel] --num-layers-per-virtual-pipeline-stage {} with uneven stages "
              "(--decoder-first-pipeline-num-layers {}, --decoder-last-pipeline-num-layers {}): "
              "give the virtual stages with --num-virtual-stages-per-pipeline-rank instead",
              layers_per_vp_stage, first_stage_layers, last_stage_layers);
    const int64_t counted = num_layers + account_for_embedding + account_for_loss;
    MOE_CHECK(counted % pp == 0,
              "[parallel] --num-layers {} (+{} for --account-for-embedding/loss-in-pipeline-"
              "split) is not divisible by --pipeline-model-parallel-size {}, so "
              "--num-layers-per-virtual-pipeline-stage {} cannot set the virtual stages",
              num_layers, counted - num_layers, pp, layers_per_vp_stage);
    MOE_CHECK((counted / pp) % layers_per_vp_stage == 0,
              "[parallel] each pipeline rank holds {} layers, not divisible by "
              "--num-layers-per-virtual-pipeline-stage {}: pick a divisor of {}",
              counted / pp, layers_per_vp_stage, counted / pp);
    v = static_cast<int>(counted / pp / layers_per_vp_stage);
  }
  // Megatron runs virtual stages only in the interleaved schedule, which needs pp > 1.
  MOE_CHECK(v == 1 || pp > 1,
            "[parallel] {} virtual stages per rank need --pipeline-model-parallel-size > 1 (got "
            "{}): the interleaved schedule runs them; drop the virtual-stage flag or raise pp",
            v, pp);
  return v;
}

PipelineLayout pipeline_layout(const ParallelConfig& cfg, int64_t num_layers, int64_t mtp_layers) {
  MOE_CHECK(num_layers >= 1, "[parallel] --num-layers {} must be >= 1", num_layers);
  MOE_CHECK(mtp_layers >= 0, "[parallel] --mtp-num-layers {} must be >= 0", mtp_layers);
  PipelineLayout out;
  out.vp = cfg.vp(num_layers);
  out.pp = cfg.pp;
  if (!cfg.layout.empty()) {
    out.stages = stages_from_layout(cfg, out.vp, num_layers, mtp_layers);
  } else {
    const std::vector<int64_t> counts = split_counts(cfg, out.vp, num_layers);
    out.stages.resize(counts.size());
    int64_t next = 0;
    for (size_t i = 0; i < counts.size(); ++i) {
      out.stages[i].first_layer = next;
      out.stages[i].num_layers = counts[i];
      next += counts[i];
    }
    out.stages.front().embedding = true;
    out.stages.back().loss = true;
    out.stages.back().num_mtp_layers = mtp_layers;
  }
  // Every virtual stage after the MTP layers' receives their hidden states with the decoder's.
  bool after_mtp = false;
  for (VirtualStage& s : out.stages) {
    s.mtp_before = after_mtp;
    after_mtp = after_mtp || s.num_mtp_layers > 0;
  }
  // The guard of Megatron's issues #1304 / #1778: whatever the flags, the stages hold the model.
  int64_t placed = 0;
  for (const VirtualStage& s : out.stages) {
    MOE_CHECK(s.num_layers >= 0 && s.first_layer == placed,
              "[parallel] internal: pipeline stages not contiguous ({})", out.describe());
    placed += s.num_layers;
  }
  MOE_CHECK(placed == num_layers,
            "[parallel] internal: the pipeline stages hold {} of --num-layers {} ({})", placed,
            num_layers, out.describe());
  return out;
}

std::vector<int> word_table_ranks(const PipelineLayout& layout, bool tie_embeddings) {
  std::vector<int> ranks;
  bool mtp = false;
  for (const VirtualStage& s : layout.stages) mtp = mtp || s.num_mtp_layers > 0;
  if (!tie_embeddings && !mtp) return ranks;  // the table is the embedding's alone
  for (size_t i = 0; i < layout.stages.size(); ++i) {
    const VirtualStage& s = layout.stages[i];
    if (s.embedding || s.num_mtp_layers > 0 || (s.loss && tie_embeddings))
      ranks.push_back(static_cast<int>(i) % layout.pp);
  }
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  return ranks;
}

std::string PipelineLayout::describe() const {
  std::string out;
  for (size_t i = 0; i < stages.size(); ++i) {
    const VirtualStage& s = stages[i];
    out += fmt::format("virtual stage {} (rank {}, chunk {}): {}", i, static_cast<int>(i) % pp,
                       static_cast<int>(i) / pp, layer_range(s));
    if (s.num_mtp_layers > 0) out += fmt::format(", {} MTP", s.num_mtp_layers);
    if (s.mtp_before) out += ", the MTP hidden states";
    if (s.embedding) out += ", embedding";
    if (s.loss) out += ", loss";
    out += "\n";
  }
  return out;
}

}  // namespace moecore::parallel
