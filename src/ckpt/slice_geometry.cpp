#include "ckpt/slice_geometry.h"

#include <algorithm>
#include <cstring>

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

void for_each_run(const SliceRef& s, const std::vector<int64_t>& shape,
                  const std::function<void(int64_t, int64_t, int64_t)>& fn) {
  const int nd = static_cast<int>(shape.size());
  const int tail = whole_tail(s, s, nd);
  if (tail == 0) {
    fn(0, 0, product(shape, 0));
    return;
  }
  const std::vector<int64_t> local = box_shape(s, shape);
  std::vector<std::vector<Interval>> iv(tail);
  for (int d = 0; d < tail; ++d) iv[d] = dim_intervals(s, shape, d);
  const int64_t inner = product(shape, tail);  // the same locally: those dimensions are whole
  // Strides of dimension d, global and local.
  std::vector<int64_t> gs(tail), ls(tail);
  for (int d = 0; d < tail; ++d) {
    gs[d] = product(shape, d + 1);
    ls[d] = product(local, d + 1);
  }
  const std::function<void(int, int64_t, int64_t)> walk = [&](int d, int64_t g, int64_t l) {
    for (const Interval& x : iv[d]) {
      if (d == tail - 1) {
        if (x.length > 0) fn(g + x.global * gs[d], l + x.local * ls[d], x.length * inner);
        continue;
      }
      for (int64_t i = 0; i < x.length; ++i) {
        walk(d + 1, g + (x.global + i) * gs[d], l + (x.local + i) * ls[d]);
      }
    }
  };
  walk(0, 0, 0);
}

int64_t copy_intersection(const std::vector<int64_t>& shape, size_t esize, const SliceRef& want,
                          std::span<std::byte> dst, const SliceRef& have,
                          std::span<const std::byte> src) {
  const int nd = static_cast<int>(shape.size());
  const int tail = whole_tail(want, have, nd);
  const int64_t inner = product(shape, tail);
  if (tail == 0) {
    std::memcpy(dst.data(), src.data(), static_cast<size_t>(inner) * esize);
    return inner;
  }
  std::vector<std::vector<Interval>> ov(tail);  // {want local, have local, length}
  for (int d = 0; d < tail; ++d) {
    ov[d] = overlaps(dim_intervals(want, shape, d), dim_intervals(have, shape, d));
    if (ov[d].empty()) return 0;
  }
  const std::vector<int64_t> wl = box_shape(want, shape), hl = box_shape(have, shape);
  std::vector<int64_t> ws(tail), hs(tail);
  for (int d = 0; d < tail; ++d) {
    ws[d] = product(wl, d + 1);
    hs[d] = product(hl, d + 1);
  }
  int64_t copied = 0;
  const std::function<void(int, int64_t, int64_t)> walk = [&](int d, int64_t w, int64_t h) {
    for (const Interval& x : ov[d]) {
      if (d == tail - 1) {
        const int64_t n = x.length * inner;
        std::memcpy(dst.data() + static_cast<size_t>(w + x.global * ws[d]) * esize,
                    src.data() + static_cast<size_t>(h + x.local * hs[d]) * esize,
                    static_cast<size_t>(n) * esize);
        copied += n;
        continue;
      }
      for (int64_t i = 0; i < x.length; ++i) {
        walk(d + 1, w + (x.global + i) * ws[d], h + (x.local + i) * hs[d]);
      }
    }
  };
  walk(0, 0, 0);
  return copied;
}

}  // namespace moecore::ckpt
