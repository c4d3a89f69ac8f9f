// Steps that the ranks of a group take together and that fail together. A multi-rank checkpoint
// save or load must not leave the other ranks waiting in the next collective (until its
// timeout) when one rank's step throws: every rank learns of the failure and throws too.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "parallel/communicator.h"

namespace moecore::parallel {

// Runs `step` on this rank, then agrees with every rank of `comm` (collective; a barrier): when
// `step` threw (an exception derived from std::exception) on any rank, every rank throws
// moecore::Error with the first failing rank's message and the failing ranks named. comm null:
// one rank, `step` runs and its exceptions pass through.
void run_on_all_ranks(Communicator* comm, const std::function<void()>& step);

// Every rank's `text`, in rank order (collective).
std::vector<std::string> all_gather_strings(Communicator& comm, std::string_view text);

}  // namespace moecore::parallel
