#include "cli/megatron_argv.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>

#include "core/check.h"

namespace moecore::cli {

namespace {

bool is_number(const std::string& s) {
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size();
}

// argparse: a token starting with '-' is an option unless it reads as a negative number
// (Megatron defines no option that looks like one).
bool looks_like_option(const std::string& s) {
  return s.size() > 1 && s[0] == '-' && !is_number(s);
}

bool valid_int(const std::string& s) {
  if (s.empty()) return false;
  char* end = nullptr;
  std::strtoll(s.c_str(), &end, 10);
  return end == s.c_str() + s.size();
}

void check_value(const MegatronFlag& f, const std::string& v,
                 const std::vector<std::string>& extra_choices) {
  MOE_CHECK(f.type != ArgType::Int || valid_int(v), "[flags] argument {}: invalid int value: '{}'",
            f.name(), v);
  MOE_CHECK(f.type != ArgType::Float || is_number(v),
            "[flags] argument {}: invalid float value: '{}'", f.name(), v);
  if (f.choices.empty()) return;
  for (const std::string& c : f.choices) {
    if (c == v || (f.type != ArgType::Str && is_number(c) && is_number(v) &&
                   std::strtod(c.c_str(), nullptr) == std::strtod(v.c_str(), nullptr))) {
      return;
    }
  }
  for (const std::string& e : extra_choices) {
    if (e == f.name() + "=" + v) return;
  }
  std::string list;
  for (const std::string& c : f.choices) list += (list.empty() ? "" : ", ") + c;
  MOE_FAIL("[flags] argument {}: invalid choice: '{}' (choose from {})", f.name(), v, list);
}

}  // namespace

std::string GivenFlag::value_text() const {
  if (megatron != nullptr) {
    switch (megatron->action) {
      case ArgAction::StoreTrue: return "true";
      case ArgAction::StoreFalse: return "false";
      case ArgAction::BooleanOptional: return name.starts_with("--no-") ? "false" : "true";
      case ArgAction::Store: break;
    }
  } else if (values.empty()) {
    return "true";
  }
  std::string out;
  for (const std::string& v : values) out += (out.empty() ? "" : " ") + v;
  return out;
}

const GivenFlag* ParsedArgs::find_dest(const std::string& dest) const {
  for (const GivenFlag& g : flags) {
    if (g.megatron != nullptr && g.megatron->dest == dest) return &g;
  }
  return nullptr;
}

ParsedArgs parse_megatron_argv(const std::vector<std::string>& args,
                               const std::vector<OwnFlag>& own,
                               const std::vector<std::string>& extra_choices) {
  const MegatronArguments& table = megatron_arguments();
  ParsedArgs out;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-h" || a == "--help") {
      out.help = true;
      continue;
    }
    MOE_CHECK(looks_like_option(a),
              "[flags] unrecognized argument '{}': every value follows its flag (--flag value "
              "or --flag=value)",
              a);
    std::string name = a;
    std::vector<std::string> values;
    bool explicit_value = false;
    if (const size_t eq = a.find('='); eq != std::string::npos) {
      name = a.substr(0, eq);
      values.push_back(a.substr(eq + 1));
      explicit_value = true;
    }
    GivenFlag g;
    g.name = name;
    g.megatron = table.find(name);
    int min_values = 0, max_values = 0;
    if (g.megatron != nullptr) {
      const MegatronFlag& f = *g.megatron;
      if (f.takes_values()) {
        const std::string& n = f.nargs;
        min_values = n == "" ? 1 : n == "?" || n == "*" ? 0 : n == "+" ? 1 : std::stoi(n);
        max_values = n == "" || n == "?" ? 1 : n == "*" || n == "+" ? -1 : std::stoi(n);
      }
    } else {
      auto it = std::find_if(own.begin(), own.end(),
                             [&](const OwnFlag& o) { return o.name == name; });
      MOE_CHECK(it != own.end(),
                "[flags] unrecognized argument {}: neither Megatron-LM (arguments.py at {}) nor "
                "moecore has this flag; the nearest Megatron flag is {}",
                name, table.commit.substr(0, 12), table.nearest(name));
      min_values = it->min_values;
      max_values = it->max_values;
    }
    if (explicit_value) {
      MOE_CHECK(max_values != 0, "[flags] argument {}: ignored explicit argument '{}'", name,
                values[0]);
    } else {
      while (i + 1 < args.size() && !looks_like_option(args[i + 1]) &&
             (max_values < 0 || static_cast<int>(values.size()) < max_values)) {
        values.push_back(args[++i]);
      }
    }
    if (static_cast<int>(values.size()) < min_values) {
      MOE_FAIL("[flags] argument {}: expected {}", name,
               min_values == 1 && max_values == 1 ? std::string("one argument")
               : max_values < 0                   ? std::string("at least one argument")
                                                  : fmt::format("{} arguments", min_values));
    }
    if (g.megatron != nullptr) {
      for (const std::string& v : values) check_value(*g.megatron, v, extra_choices);
    }
    g.values = std::move(values);
    // The last occurrence of a dest wins; it takes its place in the order.
    std::erase_if(out.flags, [&](const GivenFlag& prev) {
      return g.megatron != nullptr ? prev.megatron != nullptr && prev.megatron->dest == g.megatron->dest
                                   : prev.megatron == nullptr && prev.name == g.name;
    });
    out.flags.push_back(std::move(g));
  }
  return out;
}

}  // namespace moecore::cli
