#include "ckpt/slice_geometry.h"

#include <algorithm>

namespace moecore::ckpt {
namespace {

// The split dimension of s along d (dim = -1 when s does not split d).
SliceDim split_of(const SliceRef& s, int d) {
  if (s.dim == d) return s.first();
  if (s.second.split() && s.second.dim == d) return s.second;
  return {};
}

int64_t product(const std::vector<int64_t>& v, size_t begin) {
  int64_t p = 1;
  for (size_t i = begin; i < v.size(); ++i) p *= v[i];
  return p;
}

// The first dimension from which neither slice splits any: the dimensions from there on are
// whole in both, so a run along the one before is contiguous in both.
int whole_tail(const SliceRef& a, const SliceRef& b, int ndim) {
  int t = 0;
  for (const SliceRef* s : {&a, &b}) {
    if (s->dim >= 0) t = std::max(t, s->dim + 1);
    if (s->second.split()) t = std::max(t, s->second.dim + 1);
  }
  return std::min(t, ndim);
}

// The global index along a dimension of local index l of split d (of extent `extent`).
int64_t global_of(const SliceDim& d, int64_t l, int64_t extent) {
  if (!d.split()) return l;
  return (l / d.length) * (extent / d.parts) + d.offset + l % d.length;
}

// The intervals both a and b hold of one dimension: {a's local index, b's local index, length}
// as Interval{global: a.local, local: b.local}. Both lists are in increasing, disjoint order
// (dim_intervals): one merge pass.
std::vector<Interval> overlaps(const std::vector<Interval>& a, const std::vector<Interval>& b) {
  std::vector<Interval> out;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const Interval &x = a[i], &y = b[j];
    const int64_t lo = std::max(x.global, y.global);
    const int64_t hi = std::min(x.global + x.length, y.global + y.length);
    if (lo < hi) out.push_back({x.local + (lo - x.global), y.local + (lo - y.global), hi - lo});
    if (x.global + x.length <= y.global + y.length) {
      ++i;
    } else {
      ++j;
    }
  }
  return out;
}

// A slice as a range [begin, end) of a box's storage: a flat slice of the whole tensor's, a
// ranged one of its base's, any other all of its own.
struct Piece {
  SliceRef box;
  int64_t begin = 0, end = 0;
};

Piece piece_of(const SliceRef& s, const std::vector<int64_t>& shape) {
  if (s.flat()) return {SliceRef{}, s.offset, s.offset + s.length};
  if (s.ranged()) return {s.base(), s.range.offset, s.range.offset + s.range.length};
  return {s, 0, box_numel(s, shape)};
}

// Both boxes without ranges: the product of the per-dimension intersections, walked run by run
// (only the shared elements are visited).
void shared_box_runs(const std::vector<int64_t>& shape, const SliceRef& want, const SliceRef& have,
                     const std::function<void(int64_t, int64_t, int64_t)>& fn) {
  const int nd = static_cast<int>(shape.size());
  const int tail = whole_tail(want, have, nd);
  const int64_t inner = product(shape, tail);
  if (tail == 0) {
    if (inner > 0) fn(0, 0, inner);
    return;
  }
  std::vector<std::vector<Interval>> ov(tail);  // {want local, have local, length}
  for (int d = 0; d < tail; ++d) {
    ov[d] = overlaps(dim_intervals(want, shape, d), dim_intervals(have, shape, d));
    if (ov[d].empty()) return;
  }
  if (inner == 0) return;
  const std::vector<int64_t> wl = box_shape(want, shape), hl = box_shape(have, shape);
  std::vector<int64_t> ws(tail), hs(tail);
  for (int d = 0; d < tail; ++d) {
    ws[d] = product(wl, d + 1);
    hs[d] = product(hl, d + 1);
  }
  const std::function<void(int, int64_t, int64_t)> walk = [&](int d, int64_t w, int64_t h) {
    for (const Interval& x : ov[d]) {
      if (d == tail - 1) {
        fn(w + x.global * ws[d], h + x.local * hs[d], x.length * inner);
        continue;
      }
      for (int64_t i = 0; i < x.length; ++i) {
        walk(d + 1, w + (x.global + i) * ws[d], h + (x.local + i) * hs[d]);
      }
    }
  };
  walk(0, 0, 0);
}

}  // namespace

std::vector<Interval> dim_intervals(const SliceRef& s, const std::vector<int64_t>& shape, int d) {
  const SliceDim sd = split_of(s, d);
  if (!sd.split()) return {Interval{0, 0, shape[d]}};
  std::vector<Interval> out;
  const int64_t chunk = shape[d] / sd.parts;
  for (int k = 0; k < sd.parts; ++k) {
    out.push_back({k * chunk + sd.offset, k * sd.length, sd.length});
  }
  return out;
}

std::vector<int64_t> box_shape(const SliceRef& s, const std::vector<int64_t>& shape) {
  std::vector<int64_t> out = shape;
  for (int d = 0; d < static_cast<int>(shape.size()); ++d) {
    const SliceDim sd = split_of(s, d);
    if (sd.split()) out[d] = sd.local_extent();
  }
  return out;
}

int64_t box_numel(const SliceRef& s, const std::vector<int64_t>& shape) {
  return product(box_shape(s, shape), 0);
}

bool boxes_intersect(const SliceRef& a, const SliceRef& b, const std::vector<int64_t>& shape) {
  for (int d = 0; d < static_cast<int>(shape.size()); ++d) {
    if (overlaps(dim_intervals(a, shape, d), dim_intervals(b, shape, d)).empty()) return false;
  }
  return true;
}

int64_t global_index(const SliceRef& s, const std::vector<int64_t>& shape, int64_t local) {
  // Row-major decomposition of `local` over the box's shape, each index mapped to its global one.
  const std::vector<int64_t> l = box_shape(s, shape);
  int64_t g = 0, stride = 1;
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    const int64_t i = l[d] > 0 ? local % l[d] : 0;
    local = l[d] > 0 ? local / l[d] : 0;
    g += global_of(split_of(s, d), i, shape[d]) * stride;
    stride *= shape[d];
  }
  return g;
}

int64_t first_local_at(const SliceRef& s, const std::vector<int64_t>& shape, int64_t global) {
  int64_t lo = 0, hi = box_numel(s, shape);
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (global_index(s, shape, mid) < global) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

std::pair<int64_t, int64_t> box_span(const SliceRef& s, const std::vector<int64_t>& shape) {
  const int64_t n = box_numel(s, shape);
  if (n == 0) return {0, 0};
  return {global_index(s, shape, 0), global_index(s, shape, n - 1) + 1};
}

RunIterator::RunIterator(const SliceRef& s, const std::vector<int64_t>& shape, int64_t begin,
                         int64_t end)
    : shape_(shape), pos_(begin), end_(end) {
  const int nd = static_cast<int>(shape.size());
  tail_ = whole_tail(s, s, nd);
  inner_ = product(shape, tail_);
  const std::vector<int64_t> local = box_shape(s, shape);
  local_extent_.assign(local.begin(), local.begin() + tail_);
  for (int d = 0; d < tail_; ++d) {
    global_stride_.push_back(product(shape, d + 1));
    split_.push_back(split_of(s, d));
  }
  if (inner_ == 0 ||
      std::any_of(local_extent_.begin(), local_extent_.end(), [](int64_t e) { return e == 0; })) {
    end_ = pos_;  // no elements
  }
}

Run RunIterator::raw(int64_t at) const {
  if (tail_ == 0) return {at, at, end_ - at};  // the whole tensor: one run
  const int last = tail_ - 1;
  const int64_t row_len = local_extent_[last] * inner_;  // local elements per row of `last`
  int64_t row = at / row_len;
  const int64_t within = at % row_len;
  const int64_t j = within / inner_;  // local index along `last`
  const SliceDim& sd = split_[last];
  // The interval of `last` holding j: to its end the run is contiguous in both.
  const int64_t len = sd.split() ? sd.length : local_extent_[last];
  const int64_t interval_end = (j / len + 1) * len;  // local index along `last`
  int64_t g = global_of(sd, j, shape_[last]) * global_stride_[last] + within % inner_;
  for (int d = last - 1; d >= 0; --d) {
    g += global_of(split_[d], row % local_extent_[d], shape_[d]) * global_stride_[d];
    row /= local_extent_[d];
  }
  const int64_t stop = std::min(end_, at - within + interval_end * inner_);
  return {g, at, stop - at};
}

bool RunIterator::next(Run& r) {
  if (pos_ >= end_) return false;
  r = raw(pos_);
  pos_ += r.count;
  while (pos_ < end_) {  // the next run continues this one in the flattened tensor too
    const Run q = raw(pos_);
    if (q.global != r.global + r.count) break;
    r.count += q.count;
    pos_ += q.count;
  }
  return true;
}

void for_each_shared_run(const std::vector<int64_t>& shape, const SliceRef& want,
                         const SliceRef& have,
                         const std::function<void(int64_t, int64_t, int64_t)>& fn) {
  const Piece w = piece_of(want, shape), h = piece_of(have, shape);
  if (w.begin >= w.end || h.begin >= h.end) return;
  if (!boxes_intersect(w.box, h.box, shape)) return;
  if (!want.flat() && !want.ranged() && !have.flat() && !have.ranged()) {
    shared_box_runs(shape, want, have, fn);
    return;
  }
  // The part of the flattened tensor both spans cover; each side's runs from its first element
  // there, merged in increasing global order.
  const int64_t lo =
      std::max(global_index(w.box, shape, w.begin), global_index(h.box, shape, h.begin));
  const int64_t hi =
      std::min(global_index(w.box, shape, w.end - 1), global_index(h.box, shape, h.end - 1)) + 1;
  if (lo >= hi) return;
  RunIterator iw(w.box, shape, std::max(w.begin, first_local_at(w.box, shape, lo)), w.end);
  RunIterator ih(h.box, shape, std::max(h.begin, first_local_at(h.box, shape, lo)), h.end);
  Run a, b;
  bool more = iw.next(a) && ih.next(b);
  while (more && a.global < hi && b.global < hi) {
    const int64_t s = std::max(a.global, b.global);
    const int64_t e = std::min(a.global + a.count, b.global + b.count);
    if (s < e) fn(a.local + (s - a.global) - w.begin, b.local + (s - b.global) - h.begin, e - s);
    const int64_t ae = a.global + a.count, be = b.global + b.count;
    if (ae <= be) more = iw.next(a);
    if (more && be <= ae) more = ih.next(b);
  }
}

}  // namespace moecore::ckpt
