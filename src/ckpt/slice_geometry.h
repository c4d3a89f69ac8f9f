// The index sets of a checkpoint slice (manifest.h's SliceRef, not flat) in its global tensor:
// along each dimension a union of intervals (a dimension in `parts` chunks holds one interval of
// each), the slice the product of those. What the manifest's validation (in bounds, disjoint,
// volumes) and the reader's resharding (the intersection of a stored slice and a wanted one,
// the contiguous runs a slice covers of the flattened tensor) compute with.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "ckpt/manifest.h"

namespace moecore::ckpt {

// Indices [global, global + length) of a dimension, at local index `local` in the slice.
struct Interval {
  int64_t global = 0;
  int64_t local = 0;
  int64_t length = 0;
};

// The intervals of dimension d that slice s holds in a tensor of `shape` (one, the whole
// extent, when s does not split d). s is in bounds (validate_manifest, or the reader's check).
std::vector<Interval> dim_intervals(const SliceRef& s, const std::vector<int64_t>& shape, int d);
// The slice's shape as stored (shape with each split dimension's local extent).
std::vector<int64_t> box_shape(const SliceRef& s, const std::vector<int64_t>& shape);
int64_t box_numel(const SliceRef& s, const std::vector<int64_t>& shape);
// Whether slices a and b share an element.
bool boxes_intersect(const SliceRef& a, const SliceRef& b, const std::vector<int64_t>& shape);
// Calls fn(global, local, count) for the runs of the flattened global tensor that slice s holds:
// elements [global, global + count) of the tensor are elements [local, local + count) of the
// slice's row-major storage. In increasing order of both.
void for_each_run(const SliceRef& s, const std::vector<int64_t>& shape,
                  const std::function<void(int64_t, int64_t, int64_t)>& fn);
// Copies the elements slice `have` (stored in `src`) shares with slice `want` (stored in `dst`)
// into their places in dst; returns how many.
int64_t copy_intersection(const std::vector<int64_t>& shape, size_t esize, const SliceRef& want,
                          std::span<std::byte> dst, const SliceRef& have,
                          std::span<const std::byte> src);

}  // namespace moecore::ckpt
