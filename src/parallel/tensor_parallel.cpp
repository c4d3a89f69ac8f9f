#include "parallel/tensor_parallel.h"

#include <type_traits>

#include "core/check.h"
#include "core/dtype.h"
#include "core/profiler.h"
#include "ops/cast.h"
#include "ops/memory.h"
#include "parallel/process_groups.h"

namespace moecore::parallel {

TensorParallel::TensorParallel(const ProcessGroup* group, bool sequence_parallel)
    : group_(group),
      size_(group != nullptr ? group->size() : 1),
      rank_(group != nullptr ? group->rank : 0),
      sp_(sequence_parallel) {
  if (size_ == 1) group_ = nullptr;  // nothing to communicate
}

TensorParallel TensorParallel::attention(const ProcessGroups* groups) {
  if (groups == nullptr) return {};
  return TensorParallel(&groups->group(GroupKind::Tp), groups->layout().config.sequence_parallel);
}

TensorParallel TensorParallel::expert(const ProcessGroups* groups) {
  if (groups == nullptr) return {};
  return TensorParallel(&groups->group(GroupKind::ExptTp), false);
}

template <typename T>
DevPtr<const T> TensorParallel::enter(const Exec& ex, DevPtr<const T> x, DevPtr<T> full_nH,
                                      int64_t n, int64_t H) const {
  if (!sequence_parallel()) return x;
  all_gather(ex, x, full_nH, local_tokens(n) * H);
  return full_nH;
}

template <typename T>
DevPtr<const T> TensorParallel::enter(const Exec& ex, DevPtr<const T> x, DevPtr<T> full_nH,
                                      int64_t n, int64_t H, DevPtr<bf16> wire16) const {
  if constexpr (std::is_same_v<T, float>) {
    if (sequence_parallel() && wire16 != nullptr) {
      const int64_t count = local_tokens(n) * H;
      const DevPtr<bf16> local = wire16, full = wire16 + count;
      ops::cast_f32_to_bf16(ex, local, x, count);
      {
        ScopedPhase phase(Phase::Communication);
        group_->device_communicator()
            .all_gather_async(DevPtr<const bf16>(local), full, count, DType::BF16)
            .wait_on(ex);
      }
      ops::cast_bf16_to_f32(ex, full_nH, DevPtr<const bf16>(full), n * H);
      return full_nH;
    }
  }
  return enter(ex, x, full_nH, n, H);
}

template <typename T>
void TensorParallel::enter_backward(const Exec& ex, DevPtr<T> dfull_nH, DevPtr<T> dx, int64_t n,
                                    int64_t H) const {
  if (sequence_parallel()) {
    reduce_scatter(ex, DevPtr<const T>(dfull_nH), dx, local_tokens(n) * H);
    return;
  }
  all_reduce(ex, dfull_nH, n * H);
  if (dx != dfull_nH) ops::copy(ex, dx, DevPtr<const T>(dfull_nH), n * H);
}

template <typename T>
void TensorParallel::all_reduce(const Exec& ex, DevPtr<T> data, int64_t count) const {
  if (group_ == nullptr) return;
  ScopedPhase phase(Phase::Communication);
  group_->device_communicator()
      .all_reduce_async(data, count, DTypeOf<T>::value, ReduceOp::Sum)
      .wait_on(ex);
}

template <typename T>
void TensorParallel::all_reduce_max(const Exec& ex, DevPtr<T> data, int64_t count) const {
  if (group_ == nullptr) return;
  ScopedPhase phase(Phase::Communication);
  group_->device_communicator()
      .all_reduce_async(data, count, DTypeOf<T>::value, ReduceOp::Max)
      .wait_on(ex);
}

template <typename T>
void TensorParallel::all_gather(const Exec& ex, DevPtr<const T> local, DevPtr<T> full,
                                int64_t count) const {
  if (group_ == nullptr) {
    if (full != local) ops::copy(ex, full, local, count);
    return;
  }
  ScopedPhase phase(Phase::Communication);
  group_->device_communicator().all_gather_async(local, full, count, DTypeOf<T>::value).wait_on(ex);
}

template <typename T>
void TensorParallel::broadcast(const Exec& ex, DevPtr<T> data, int64_t count, int root) const {
  if (group_ == nullptr) return;
  ScopedPhase phase(Phase::Communication);
  group_->device_communicator().broadcast_async(data, count, DTypeOf<T>::value, root).wait_on(ex);
}

template <typename T>
void TensorParallel::reduce_scatter(const Exec& ex, DevPtr<const T> full, DevPtr<T> local,
                                    int64_t count) const {
  if (group_ == nullptr) {
    if (local != full) ops::copy(ex, local, full, count);
    return;
  }
  ScopedPhase phase(Phase::Communication);
  group_->device_communicator()
      .reduce_scatter_async(full, local, count, DTypeOf<T>::value, ReduceOp::Sum)
      .wait_on(ex);
}

#define MOECORE_TP_INSTANTIATE(T)                                                                \
  template DevPtr<const T> TensorParallel::enter<T>(const Exec&, DevPtr<const T>, DevPtr<T>,     \
                                                    int64_t, int64_t) const;                     \
  template DevPtr<const T> TensorParallel::enter<T>(const Exec&, DevPtr<const T>, DevPtr<T>,     \
                                                    int64_t, int64_t, DevPtr<bf16>) const;       \
  template void TensorParallel::enter_backward<T>(const Exec&, DevPtr<T>, DevPtr<T>, int64_t,    \
                                                  int64_t) const;                                \
  template void TensorParallel::all_reduce<T>(const Exec&, DevPtr<T>, int64_t) const;           \
  template void TensorParallel::all_reduce_max<T>(const Exec&, DevPtr<T>, int64_t) const;       \
  template void TensorParallel::all_gather<T>(const Exec&, DevPtr<const T>, DevPtr<T>, int64_t) \
      const;                                                                                     \
  template void TensorParallel::reduce_scatter<T>(const Exec&, DevPtr<const T>, DevPtr<T>,      \
                                                  int64_t) const;                                \
  template void TensorParallel::broadcast<T>(const Exec&, DevPtr<T>, int64_t, int) const;
MOECORE_TP_INSTANTIATE(float)
MOECORE_TP_INSTANTIATE(double)
#undef MOECORE_TP_INSTANTIATE

}  // namespace moecore::parallel
