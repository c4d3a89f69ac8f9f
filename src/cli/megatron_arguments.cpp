#include "cli/megatron_arguments.h"

#include <fmt/format.h>

#include <algorithm>
#include <unordered_map>

#include "core/check.h"

namespace moecore::cli {

namespace {

const char* kTableJson =
#include "cli/megatron_arguments.inc"
    ;

std::string json_text(const nlohmann::json& v) {
  if (v.is_null()) return "";
  if (v.is_string()) return v.get<std::string>();
  if (v.is_boolean()) return v.get<bool>() ? "true" : "false";
  if (v.is_number_integer()) return std::to_string(v.get<int64_t>());
  if (v.is_number_float()) return fmt::format("{}", v.get<double>());
  if (v.is_array()) {
    std::string out;
    for (const auto& x : v) {
      if (!out.empty()) out += ' ';
      out += json_text(x);
    }
    return out;
  }
  if (v.is_object() && v.contains("repr")) return v["repr"].get<std::string>();
  return v.dump();
}

ArgAction parse_action(const std::string& s) {
  if (s == "store") return ArgAction::Store;
  if (s == "store_true") return ArgAction::StoreTrue;
  if (s == "store_false") return ArgAction::StoreFalse;
  if (s == "other:BooleanOptionalAction") return ArgAction::BooleanOptional;
  MOE_FAIL("[flags] the Megatron flag table has an action '{}' that moecore cannot parse: "
           "extend cli/megatron_arguments.cpp",
           s);
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1])});
      diag = up;
    }
  }
  return row[b.size()];
}

MegatronArguments load_table() {
  const nlohmann::json j = nlohmann::json::parse(kTableJson);
  MegatronArguments t;
  t.source = j.at("source").get<std::string>();
  t.commit = j.at("commit").get<std::string>();
  for (const auto& e : j.at("flags")) {
    MegatronFlag f;
    f.names = e.at("names").get<std::vector<std::string>>();
    f.dest = e.at("dest").get<std::string>();
    f.action = parse_action(e.at("action").get<std::string>());
    const nlohmann::json& type = e.at("type");
    f.type_name = type.is_null() ? "" : type.get<std::string>();
    f.type = f.type_name.empty()           ? ArgType::None
             : f.type_name == "int"        ? ArgType::Int
             : f.type_name == "float"      ? ArgType::Float
             : f.type_name == "str"        ? ArgType::Str
             : f.type_name == "bool"       ? ArgType::Bool
                                           : ArgType::Other;
    const nlohmann::json& nargs = e.at("nargs");
    if (f.action == ArgAction::Store && !nargs.is_null()) {
      f.nargs = nargs.is_string() ? nargs.get<std::string>() : std::to_string(nargs.get<int>());
    }
    if (!e.at("choices").is_null()) {
      for (const auto& c : e.at("choices")) f.choices.push_back(json_text(c));
    }
    f.default_value = e.at("default");
    f.group = e.at("group").is_null() ? "" : e.at("group").get<std::string>();
    f.help = e.value("help", "");
    t.flags.push_back(std::move(f));
  }
  return t;
}

}  // namespace

const MegatronArguments& megatron_arguments() {
  static const MegatronArguments kTable = load_table();
  return kTable;
}

const MegatronFlag* MegatronArguments::find(const std::string& name) const {
  static const std::unordered_map<std::string, const MegatronFlag*> index = [this] {
    std::unordered_map<std::string, const MegatronFlag*> m;
    for (const MegatronFlag& f : flags) {
      for (const std::string& n : f.names) m.emplace(n, &f);
    }
    return m;
  }();
  auto it = index.find(name);
  return it == index.end() ? nullptr : it->second;
}

std::string MegatronArguments::nearest(const std::string& name) const {
  std::string best;
  size_t best_d = SIZE_MAX;
  for (const MegatronFlag& f : flags) {
    for (const std::string& n : f.names) {
      const size_t d = edit_distance(name, n);
      if (d < best_d) best_d = d, best = n;
    }
  }
  return best;
}

std::string default_text(const MegatronFlag& f) { return json_text(f.default_value); }

}  // namespace moecore::cli
