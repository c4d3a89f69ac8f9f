#include "cli/config_file.h"

#include <fmt/format.h>
#include <toml++/toml.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string_view>

#include "core/check.h"
#include "data/mapped_file.h"

namespace moecore::cli {

static std::string value_text(const toml::node& v, const std::string& path, const std::string& key) {
  if (auto s = v.value<std::string>()) return *s;
  if (auto i = v.value_exact<int64_t>()) return std::to_string(*i);
  if (auto d = v.value_exact<double>()) return fmt::format("{}", *d);
  MOE_FAIL("[config] '{}': key '{}' has a value of unsupported type (use a number, string, "
           "boolean or array of those)",
           path, key);
}

namespace {

// toml++ 3.3.0 (Debian's libtomlplusplus3) reaches __builtin_unreachable when it asks whether
// a non-ASCII code point in U+00A1..U+0499, U+2D2E..U+3127 or U+FC1A..U+FEFE (é, Greek,
// Cyrillic, kana, ...) is whitespace (marzer/tomlplusplus#295, fixed upstream by #305). It asks
// for characters outside strings and comments, and in a """string""" for the one after a
// backslash. So the text is parsed first with every non-ASCII byte replaced by '?': toml++ then
// reads only ASCII, and a '?' outside a string or comment fails to parse wherever it stands (no
// key, value or separator holds one), as does "\?" in a string. A text that parses so holds
// non-ASCII only as string or comment content, and the real parse of it is safe. The case the
// first parse cannot see, a line-ending backslash in a """string""" whose next non-blank
// character is non-ASCII (the '?' is plain content there), is refused beforehand.
toml::table parse_toml(std::string_view text, const std::string& where) {
  const auto fail = [&](const toml::parse_error& e, std::string_view hint) {
    MOE_FAIL("[config] cannot read '{}': {} (line {}){}", where, e.description(),
             e.source().begin.line, hint);
  };
  const size_t bom = text.starts_with("\xEF\xBB\xBF") ? 3 : 0;  // toml++ skips a UTF-8 BOM
  std::string ascii(text);
  bool non_ascii = false;
  for (size_t i = bom; i < ascii.size(); ++i) {
    if (static_cast<unsigned char>(ascii[i]) < 0x80) continue;
    non_ascii = true;
    ascii[i] = '?';
    size_t j = i;  // back over blanks and line breaks: a line-ending backslash before them?
    while (j > 0 && (text[j - 1] == ' ' || text[j - 1] == '\t' || text[j - 1] == '\r' ||
                     text[j - 1] == '\n')) {
      --j;
    }
    const bool line_break = text.substr(j, i - j).find('\n') != std::string_view::npos;
    MOE_CHECK(!(line_break && j > 0 && text[j - 1] == '\\'),
              "[config] cannot read '{}': a non-ASCII character follows a line-ending backslash "
              "(line {}): start the continued line with an ASCII character",
              where, 1 + std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(i), '\n'));
  }
  if (non_ascii) {
    try {
      (void)toml::parse(ascii, std::string(where));
    } catch (const toml::parse_error& e) {
      fail(e, "; non-ASCII text is read only inside strings and comments (shown as '?' here)");
    }
  }
  try {
    return toml::parse(text, std::string(where));
  } catch (const toml::parse_error& e) {
    fail(e, "");
  }
  return {};  // not reached: fail() throws
}

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
  const std::string why = data::unreadable_reason(path);
  MOE_CHECK(why.empty() || why == "is empty", "[config] --config '{}' {}: give a TOML file of flags",
            path, why);
  std::ifstream in(path, std::ios::binary);
  MOE_CHECK(in.good(), "[config] cannot read '{}': {}", path, std::strerror(errno));
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  return table_args(parse_toml(text, path), path);
}

std::vector<std::string> config_text_args(const std::string& text, const std::string& where) {
  return table_args(parse_toml(text, where), where);
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

}  // namespace moecore::cli
