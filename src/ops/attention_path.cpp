// The start-up line naming the attention path of a run (ops/attention.h).
#include <fmt/format.h>

#include <string>

#include "ops/attention.h"

namespace moecore::ops {

std::string attention_path_line(const Exec& ex, bool bf16, double attention_dropout) {
  if (ex.on_cpu()) return "[attention] own kernel (CPU)";
  if (!bf16) return "[attention] own kernel (f32/f64 run: cuDNN's fused attention takes bf16 only)";
  if (attention_dropout != 0.0)
    return fmt::format(
        "[attention] own kernel (attention dropout {}: its keep bits are drawn "
        "from global indices, cuDNN's are not)",
        attention_dropout);
  const cuda::CudnnAttentionProbe& p = cuda::cudnn_attention_probe();
  if (!p.available) return fmt::format("[attention] own kernel ({})", p.text);
  return fmt::format(
      "[attention] cuDNN fused (SDPA, {}); a shape cuDNN cannot take runs the own "
      "kernel, logged once",
      p.text);
}

}  // namespace moecore::ops
