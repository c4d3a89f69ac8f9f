// The harness's staging of host buffers into the backend's memory (backend_case.h, Staging).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>

#include "backend_case.h"
#include "core/check.h"
#include "ops/memory.h"

namespace moecore::backend_test {

namespace {
const unsigned char* bytes(const void* p) {
  return static_cast<const unsigned char*>(p);
}

constexpr uint64_t kFnvBasis = 1469598103934665603ull;
uint64_t g_outputs_digest = kFnvBasis;

void fold(const void* p, int64_t n) {
  const unsigned char* b = bytes(p);
  for (int64_t i = 0; i < n; ++i) g_outputs_digest = (g_outputs_digest ^ b[i]) * 1099511628211ull;
}
}  // namespace

uint64_t outputs_digest() { return g_outputs_digest; }
void reset_outputs_digest() { g_outputs_digest = kFnvBasis; }

void* Staging::stage(const void* host, int64_t n_bytes, void* writeback) {
  if (host == nullptr) {
    MOE_CHECK(n_bytes == 0, "[staging] a null host buffer of {} bytes", n_bytes);
    return nullptr;
  }
  if (n_bytes == 0) {  // an empty buffer: a valid backend address, nothing to copy
    void* dev = exec_alloc(ex_, MemSpace::Device, 1);
    buffers_.push_back(Buffer{host, nullptr, dev, 0});
    return dev;
  }
  const unsigned char* lo = bytes(host);
  const unsigned char* hi = lo + n_bytes;
  for (Buffer& b : buffers_) {
    const unsigned char* blo = bytes(b.host);
    const unsigned char* bhi = blo + b.bytes;
    if (b.bytes == 0 || hi <= blo || lo >= bhi) continue;  // disjoint
    MOE_CHECK(lo >= blo && hi <= bhi,
              "[staging] host bytes [{}, {}) overlap a staged buffer without lying inside it: "
              "stage a written buffer with out() before passing it to in()",
              static_cast<const void*>(lo), static_cast<const void*>(hi));
    MOE_CHECK(writeback == nullptr || b.writeback != nullptr,
              "[staging] out() of a buffer staged by in() before: stage it with out() first");
    return static_cast<unsigned char*>(b.dev) + (lo - blo);
  }
  void* dev = exec_alloc(ex_, MemSpace::Device, static_cast<size_t>(n_bytes));
  buffers_.push_back(Buffer{host, writeback, dev, n_bytes});
  ops::copy<unsigned char>(ex_, static_cast<unsigned char*>(dev), lo, n_bytes);
  return dev;
}

void Staging::back() {
  exec_synchronize(ex_);
  for (const Buffer& b : buffers_) {
    if (b.writeback == nullptr) continue;
    ops::read_back<unsigned char>(ex_, static_cast<unsigned char*>(b.writeback),
                                  static_cast<const unsigned char*>(b.dev), b.bytes);
    fold(b.writeback, b.bytes);
  }
}

Staging::~Staging() {
  exec_synchronize(ex_);  // nothing may still read or write a buffer being freed
  for (const Buffer& b : buffers_) exec_free(ex_, MemSpace::Device, b.dev);
}

}  // namespace moecore::backend_test
