#include "parallel/agree.h"

#include <cstring>
#include <exception>

#include "core/check.h"

namespace moecore::parallel {

std::vector<std::string> all_gather_strings(Communicator& comm, std::string_view text) {
  const int n = comm.size();
  std::vector<int64_t> lengths(static_cast<size_t>(n));
  comm.all_gather(std::vector<int64_t>{static_cast<int64_t>(text.size())}, lengths);
  // The communicators move typed elements: the text travels as int32 words.
  const auto words = [](int64_t bytes) { return (bytes + 3) / 4; };
  std::vector<int32_t> mine(static_cast<size_t>(words(static_cast<int64_t>(text.size()))), 0);
  if (!text.empty()) std::memcpy(mine.data(), text.data(), text.size());
  std::vector<int64_t> counts(static_cast<size_t>(n));
  int64_t total = 0;
  for (int r = 0; r < n; ++r) total += counts[r] = words(lengths[r]);
  std::vector<int32_t> all(static_cast<size_t>(total));
  comm.all_gather_v(mine, all, counts);
  std::vector<std::string> out(static_cast<size_t>(n));
  int64_t at = 0;
  for (int r = 0; r < n; ++r) {
    out[r].assign(reinterpret_cast<const char*>(all.data() + at), static_cast<size_t>(lengths[r]));
    at += counts[r];
  }
  return out;
}

void run_on_all_ranks(Communicator* comm, const std::function<void()>& step) {
  if (comm == nullptr || comm->size() == 1) {
    step();
    return;
  }
  std::string error;  // empty: this rank's step succeeded
  try {
    step();
  } catch (const std::exception& e) {
    error = e.what();
    if (error.empty()) error = "an error without a message";
  }
  std::vector<int64_t> failed = {error.empty() ? 0 : 1};
  comm->all_reduce(failed, ReduceOp::Sum);
  if (failed[0] == 0) return;
  const std::vector<std::string> errors = all_gather_strings(*comm, error);
  int first = -1;
  std::string ranks;
  for (int r = 0; r < comm->size(); ++r) {
    if (errors[r].empty()) continue;
    if (first < 0) first = r;
    ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  }
  throw Error(fmt::format("{} (failed on {} {} of group '{}'{})", errors[first],
                          failed[0] == 1 ? "rank" : "ranks", ranks, comm->name(),
                          errors[comm->rank()].empty() ? "; this rank waited for it" : ""));
}

}  // namespace moecore::parallel
