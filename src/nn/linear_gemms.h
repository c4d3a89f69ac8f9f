// A layer's dense projections, y = x w^T, in the model's precision: GEMMs in T, or under --bf16
// (the weights hold bf16 copies, T = f32) bf16 inputs with f32 accumulation on the context's bf16
// GEMM path (ops/gemm_bf16.h: native bf16 GEMMs, or the bf16 values widened to f32). The layer
// plans the bf16 paths' workspaces once, for the largest of its projections, and every
// projection of the layer runs through here, so the choice of path and its workspaces live in
// one place for the attention layers.
// Legend: M rows (tokens), N outputs, K inputs.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/arena.h"
#include "core/dtype.h"
#include "nn/param_registry.h"

namespace moecore::nn {

template <typename T>
class LinearGemms {
 public:
  struct Shape {
    int64_t M, N, K;
  };
  // Two passes like every arena user. weight: any of the layer's GEMM weights (they share the
  // registry's bf16 format); shapes: every projection the layer runs. Under --bf16 the
  // workspaces are named prefix + ".in16", ".dy16", ".ws32" (MemKind::Workspace).
  void allocate(Arena& a, const Param& weight, std::initializer_list<Shape> shapes,
                const std::string& prefix);
  // --bf16 (bf16 GEMM inputs, f32 accumulation).
  bool bf16() const { return bf16_; }
  // --bf16 on the widened GEMM path: the GEMMs read the weights' widened copies, so an input
  // that already holds bf16 values needs no rounding pass (x_rounded below).
  bool widened() const { return bf16_ && widened_; }

  // y[M, N] = x[M, K] w^T, w the rows [row0, row0 + N) of the parameter [., K] (all of it by
  // default; a row block is one output of a weight split in two, MLA's linear_kv_down_proj).
  // x_rounded: x holds bf16 values already (widened path).
  void forward(DevPtr<T> y, DevPtr<const T> x, const Param& w, int64_t M, int64_t N, int64_t K,
               bool x_rounded = false, int64_t row0 = 0) const;
  // dx[M, K] = dy w (assigned, or added with accumulate_dx), the rows' gradient += dy^T x.
  void backward(DevPtr<T> dx, DevPtr<const T> dy, DevPtr<const T> x, const Param& w, int64_t M,
                int64_t N, int64_t K, bool x_rounded = false, bool accumulate_dx = false,
                int64_t row0 = 0) const;
  // Over G column blocks of a strided input: y[M, N] = sum over g of x_g w_g^T, x_g the Kg
  // columns from g ldg of x's rows (row stride G ldg), w_g the columns [g Kg, (g + 1) Kg) of
  // w [N, G Kg] (MLA's output projection over heads padded past v_head_dim). Plan it as the
  // shape {M, N, G ldg}.
  void forward_blocks(DevPtr<T> y, DevPtr<const T> x, const Param& w, int64_t M, int64_t N,
                      int64_t G, int64_t Kg, int64_t ldg) const;
  // dx_g = dy w_g (assigned; x's columns past Kg in each block are not written), w_g's
  // gradient += dy^T x_g.
  void backward_blocks(DevPtr<T> dx, DevPtr<const T> dy, DevPtr<const T> x, const Param& w,
                       int64_t M, int64_t N, int64_t G, int64_t Kg, int64_t ldg) const;

 private:
  // The bf16 GEMMs over column blocks (G = 1: a plain backward that adds to dx), on the path of
  // the weights' copies: f32 GEMMs over the rounded inputs and the widened weights, or bf16
  // GEMMs over the cast inputs and the bf16 weights. w_off: the weight's first element.
  void forward_blocks_bf16(DevPtr<float> y, DevPtr<const float> x, const Param& w, int64_t M,
                           int64_t N, int64_t G, int64_t Kg, int64_t ldg) const;
  void backward_blocks_bf16(DevPtr<float> dx, DevPtr<const float> dy, DevPtr<const float> x,
                            const Param& w, int64_t w_off, int64_t M, int64_t N, int64_t G,
                            int64_t Kg, int64_t ldg, bool x_rounded, bool accumulate_dx) const;

  const Exec* ex_ = &cpu_exec();  // the arena's, from allocate()
  bool bf16_ = false;
  bool widened_ = false;
  DevPtr<moecore::bf16> in16_ = nullptr;  // the native path: the GEMM inputs cast to bf16
  DevPtr<moecore::bf16> dy16_ = nullptr;
  DevPtr<float> ws32_ = nullptr;  // the widened path: the GEMMs' f32 operands
};

}  // namespace moecore::nn
