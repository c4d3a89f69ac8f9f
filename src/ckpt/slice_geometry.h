// The index sets of a checkpoint slice (manifest.h's SliceRef) in its global tensor: along each
// dimension a union of intervals (a dimension in `parts` chunks holds one interval of each), a
// box the product of those; its storage (row-major) a sequence of runs of the flattened tensor,
// increasing in both; a flat or ranged slice a range of a box's storage (the whole tensor's, or
// its base slice's). What the manifest's validation (in bounds, disjoint, volumes) and the
// reader's resharding (the elements a stored slice and a wanted one share, of any two forms)
// compute with.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <utility>
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
// The box's shape as stored (shape with each split dimension's local extent; a range ignored).
std::vector<int64_t> box_shape(const SliceRef& s, const std::vector<int64_t>& shape);
int64_t box_numel(const SliceRef& s, const std::vector<int64_t>& shape);
// Whether the boxes a and b (ranges ignored) share an element.
bool boxes_intersect(const SliceRef& a, const SliceRef& b, const std::vector<int64_t>& shape);
// The flattened tensor's index of element `local` of box s's storage (s not flat; a range
// ignored). Strictly increasing in `local`.
int64_t global_index(const SliceRef& s, const std::vector<int64_t>& shape, int64_t local);
// The first element of box s's storage whose global index is >= `global` (box_numel when none):
// a binary search over global_index.
int64_t first_local_at(const SliceRef& s, const std::vector<int64_t>& shape, int64_t global);
// [first, last + 1) of the flattened tensor's indices of box s's elements; {0, 0} when empty.
std::pair<int64_t, int64_t> box_span(const SliceRef& s, const std::vector<int64_t>& shape);

// Elements [global, global + count) of the flattened tensor are elements [local, local + count)
// of a slice's storage.
struct Run {
  int64_t global = 0;
  int64_t local = 0;
  int64_t count = 0;
};

// The runs of elements [begin, end) of box s's storage (s not flat; a range ignored), in
// increasing order, each as long as it is contiguous in both (adjacent runs merged): each next()
// costs O(dimensions) per row it covers.
class RunIterator {
 public:
  RunIterator(const SliceRef& s, const std::vector<int64_t>& shape, int64_t begin, int64_t end);
  // The next run; false past `end`.
  bool next(Run& r);

 private:
  // The run from local element `at` to the end of its interval of the last split dimension.
  Run raw(int64_t at) const;
  std::vector<int64_t> shape_;
  int tail_ = 0;       // the dimensions from here on are whole
  int64_t inner_ = 1;  // elements of those
  std::vector<int64_t> local_extent_, global_stride_;
  std::vector<SliceDim> split_;  // of each dimension before tail_ (dim -1: whole)
  int64_t pos_ = 0, end_ = 0;
};

// Calls fn(want_at, have_at, count) for the elements slices `want` and `have` (any forms:
// whole, of one or two dimensions, in parts, flat, ranged) share: elements [want_at, want_at +
// count) of want's stored elements are elements [have_at, have_at + count) of have's, in
// increasing order of both. Two boxes meet in the product of their per-dimension intersections,
// walked run by run; a flat or ranged slice is a range of a box's storage, whose runs are merged
// with the other's over the part of the flattened tensor both spans cover only.
void for_each_shared_run(const std::vector<int64_t>& shape, const SliceRef& want,
                         const SliceRef& have,
                         const std::function<void(int64_t, int64_t, int64_t)>& fn);
}  // namespace moecore::ckpt
