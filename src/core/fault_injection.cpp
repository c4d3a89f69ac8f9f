#include "core/fault_injection.h"

#include <signal.h>

#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdlib>
#include <thread>

#include "core/check.h"

namespace moecore::fault {
namespace {

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  size_t start = 0;
  for (;;) {
    const size_t end = s.find(sep, start);
    out.push_back(s.substr(start, end == std::string_view::npos ? end : end - start));
    if (end == std::string_view::npos) return out;
    start = end + 1;
  }
}

}  // namespace

std::optional<std::string> Fault::arg(std::string_view key) const {
  for (const auto& [k, v] : args) {
    if (k == key) return v;
  }
  return std::nullopt;
}

int64_t Fault::int_arg(std::string_view key, int64_t fallback) const {
  const std::optional<std::string> v = arg(key);
  if (!v) return fallback;
  int64_t out = 0;
  const auto [end, ec] = std::from_chars(v->data(), v->data() + v->size(), out);
  MOE_CHECK(ec == std::errc() && end == v->data() + v->size(),
            "[fault] MOECORE_FAULT: {}'s {}='{}' is not an integer", kind, key, *v);
  return out;
}

bool Fault::matches(int rank, int64_t iteration) const {
  const int64_t r = int_arg("rank", -1);
  const int64_t it = int_arg("iter", -1);
  return (r < 0 || r == rank) && (it < 0 || it == iteration);
}

std::vector<Fault> parse(std::string_view spec) {
  std::vector<Fault> out;
  if (spec.empty()) return out;
  for (std::string_view item : split(spec, ';')) {
    const std::vector<std::string_view> parts = split(item, ':');
    MOE_CHECK(!parts[0].empty(), "[fault] MOECORE_FAULT='{}': an empty fault kind", spec);
    Fault f;
    f.kind = parts[0];
    for (size_t i = 1; i < parts.size(); ++i) {
      const size_t eq = parts[i].find('=');
      MOE_CHECK(eq != std::string_view::npos && eq > 0,
                "[fault] MOECORE_FAULT='{}': '{}' is not key=value", spec, parts[i]);
      f.args.emplace_back(std::string(parts[i].substr(0, eq)),
                          std::string(parts[i].substr(eq + 1)));
    }
    f.matches(-1, -1);  // rank and iter, when given, must be integers
    out.push_back(std::move(f));
  }
  return out;
}

namespace {

std::vector<Fault>& faults() {
  static std::vector<Fault> f = [] {
    const char* v = std::getenv("MOECORE_FAULT");
    return parse(v != nullptr ? v : "");
  }();
  return f;
}

}  // namespace

const std::vector<Fault>& injected() { return faults(); }

void inject_for_test(std::string_view spec) { faults() = parse(spec); }

const Fault* find(std::string_view kind, int rank, int64_t iteration) {
  for (const Fault& f : injected()) {
    if (f.kind == kind && f.matches(rank, iteration)) return &f;
  }
  return nullptr;
}

namespace {
std::atomic<int64_t> g_iteration{-1};
}  // namespace

void set_iteration(int64_t iteration) {
  g_iteration.store(iteration, std::memory_order_relaxed);
}

int64_t iteration() {
  return g_iteration.load(std::memory_order_relaxed);
}

void sleep_point(std::string_view point, int rank) {
  for (const Fault& f : injected()) {
    if (f.kind == "sleep" && f.arg("in") == point && f.matches(rank, iteration())) {
      const int64_t seconds = f.int_arg("seconds", -1);
      MOE_CHECK(seconds >= 0, "[fault] MOECORE_FAULT: sleep in {} needs seconds=S (S >= 0)", point);
      std::this_thread::sleep_for(std::chrono::seconds(seconds));
    }
  }
}

void kill_point(std::string_view point, int rank) {
  for (const Fault& f : injected()) {
    if (f.kind == "kill" && f.arg("at") == point && f.matches(rank, -1)) ::raise(SIGKILL);
  }
}

}  // namespace moecore::fault
