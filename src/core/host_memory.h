// The host's memory, for checking a size against it before allocating: a size given or implied
// by an input (samples to index, a model to convert) is refused with its bytes named, rather
// than ending in an out-of-memory error or the kernel's OOM killer.
#pragma once

#include <cstdint>
#include <string>

namespace moecore {

// Physical memory of this machine in bytes (sysconf), or of the cgroup when a smaller limit is
// set (a container's memory.max).
int64_t host_memory_bytes();

// What the kernel can still give this process without swapping: /proc/meminfo's MemAvailable
// (at most host_memory_bytes()); 0 when it cannot tell. A block above it would be granted
// (overcommit) and then killed by the OOM killer when zeroed: a SIGKILL with no message.
int64_t host_bytes_available();

// "12.3 GiB" (or MiB / bytes for small sizes): bytes as a person reads them.
std::string format_bytes(double bytes);

}  // namespace moecore
