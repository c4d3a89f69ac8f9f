#include "core/host_memory.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>

namespace moecore {

int64_t host_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGE_SIZE);
  int64_t bytes = pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : INT64_MAX;
  // cgroup v2 ("max" when unlimited) and v1 (a huge number when unlimited).
  for (const char* f : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream in(f);
    std::string text;
    if (!(in >> text) || text.empty() || text == "max") continue;
    char* end = nullptr;
    const long long limit = std::strtoll(text.c_str(), &end, 10);
    if (end != nullptr && *end == '\0' && limit > 0) bytes = std::min<int64_t>(bytes, limit);
  }
  return bytes;
}

int64_t host_bytes_available() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return 0;
  char line[256];
  unsigned long long kib = 0;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "MemAvailable: %llu kB", &kib) == 1) break;
  }
  std::fclose(f);
  return std::min<int64_t>(static_cast<int64_t>(kib) * 1024, host_memory_bytes());
}

std::string format_bytes(double bytes) {
  constexpr double kGiB = 1024.0 * 1024 * 1024;
  if (!std::isfinite(bytes)) return fmt::format("{} bytes", bytes);
  if (bytes >= 1024 * kGiB) return fmt::format("{:.3g} TiB", bytes / (1024 * kGiB));
  if (bytes >= kGiB) return fmt::format("{:.1f} GiB", bytes / kGiB);
  if (bytes >= 1024.0 * 1024) return fmt::format("{:.1f} MiB", bytes / (1024.0 * 1024));
  return fmt::format("{:.0f} bytes", bytes);
}

}  // namespace moecore
