#include "train/config_file.h"

#include <fmt/format.h>
#include <toml++/toml.h>

#include "core/check.h"

namespace moecore::train {

static std::string value_text(const toml::node& v, const std::string& path, const std::string& key) {
  if (auto s = v.value<std::string>()) return *s;
  if (auto i = v.value_exact<int64_t>()) return std::to_string(*i);
  if (auto d = v.value_exact<double>()) return fmt::format("{}", *d);
  MOE_FAIL("[config] '{}': key '{}' has a value of unsupported type (use a number, string, "
           "boolean or array of those)",
           path, key);
}

namespace {

std::vector<std::string> table_args(const toml::table& tbl, const std::string& path) {
  std::vector<std::string> out;
  for (const auto& [k, v] : tbl) {
    std::string key(k.str());
    for (char& c : key) c = c == '_' ? '-' : c;
    const std::string flag = "--" + key;
    MOE_CHECK(!v.is_table(), "[config] '{}': sections ([{}]) are not supported; use top-level "
              "flag names",
              path, key);
    if (auto b = v.value_exact<bool>()) {
      if (*b) out.push_back(flag);
    } else if (const toml::array* arr = v.as_array()) {
      out.push_back(flag);
      for (const auto& item : *arr) out.push_back(value_text(item, path, key));
    } else {
      out.push_back(flag);
      out.push_back(value_text(v, path, key));
    }
  }
  return out;
}

}  // namespace

std::vector<std::string> config_file_args(const std::string& path) {
  MOE_CHECK(!(path.ends_with(".yaml") || path.ends_with(".yml")),
            "[config] '{}': YAML configs are not supported, write the same keys as TOML", path);
  toml::table tbl;
  try {
    tbl = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    MOE_FAIL("[config] cannot read '{}': {} (line {})", path, e.description(),
             e.source().begin.line);
  }
  return table_args(tbl, path);
}

std::vector<std::string> config_text_args(const std::string& text, const std::string& where) {
  toml::table tbl;
  try {
    tbl = toml::parse(text, where);
  } catch (const toml::parse_error& e) {
    MOE_FAIL("[config] cannot read '{}': {} (line {})", where, e.description(),
             e.source().begin.line);
  }
  return table_args(tbl, where);
}

std::vector<std::string> expand_config_files(const std::vector<std::string>& args) {
  std::vector<std::string> rest, from_files;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (i > 0 && a == "--config") {
      MOE_CHECK(i + 1 < args.size(), "[config] --config needs a file name");
      auto f = config_file_args(args[++i]);
      from_files.insert(from_files.end(), f.begin(), f.end());
    } else if (i > 0 && a.starts_with("--config=")) {
      auto f = config_file_args(a.substr(9));
      from_files.insert(from_files.end(), f.begin(), f.end());
    } else {
      rest.push_back(a);
    }
  }
  if (rest.empty()) return from_files;
  std::vector<std::string> out = {rest[0]};
  out.insert(out.end(), from_files.begin(), from_files.end());
  out.insert(out.end(), rest.begin() + 1, rest.end());
  return out;
}

}  // namespace moecore::train
