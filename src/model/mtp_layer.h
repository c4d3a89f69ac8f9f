// One depth of multi-token prediction (DeepSeek-V3; Megatron-Core's MultiTokenPredictionLayer).
// At depth k the hidden state h_{k-1} of position i (the decoder's final-normed output for k = 1,
// depth k - 1's output after that) meets the embedding e of token i + k (model/mtp_block.h rolls
// the ids and looks them up in the model's own table):
//   x   = eh_proj [enorm(e) | hnorm(h_{k-1})]      eh_proj.weight [H, 2H], no bias
//   h_k = final_layernorm(transformer_layer(x))
// and the model's shared output head predicts token i + k + 1 from h_k. The concatenation is never
// formed: eh_proj's column blocks [:, 0:H) and [:, H:2H) are two GEMMs summed into x. The
// transformer layer is a TransformerBlock of the last decoder layer's kind (BlockSite::mtp), its
// rotary positions the ordinary ones.
// Tensor parallelism (the attention grid's TP group): eh_proj is column-parallel, rank r holding
// the output rows [r H/tp, (r+1) H/tp) of the weight; its input is the whole [T, 2H] (all-gathered
// with SP), its output [T, H/tp] is all-gathered into the hidden dimension (Megatron's
// gather_from_tensor_model_parallel_region) and kept on this rank's tokens (its
// scatter_to_sequence_parallel_region with SP). The gather lands rank-major ([tp, T, H/tp]); a
// row gather of H/tp-wide rows (ops::permute_rows over a map planned once) puts it token-major.
// The backward takes this rank's columns of the whole output gradient the same way. The norms
// act on the tokens a rank holds (partial gradients under SP), the block as the decoder's.
// --bf16 (f32 models): eh_proj's GEMMs take bf16 inputs (the norms' outputs and the output
// gradient cast on the way in, the weight's bf16 copy) and accumulate in f32, as the decoder's
// projections (ops::gemm_bf16 on either bf16 GEMM path).
// Legend: T tokens, H hidden, W = H / tp.
#pragma once

#include <cstdint>
#include <vector>

#include "core/arena.h"
#include "model/config.h"
#include "model/transformer_block.h"
#include "nn/norm.h"
#include "nn/param_registry.h"
#include "parallel/tensor_parallel.h"

namespace moecore::model {

template <typename T>
class MtpLayer {
 public:
  // depth: j = k - 1 in [0, D): the parameters' names mtp.layers.{j}.*.
  MtpLayer(const ModelConfig& cfg, int64_t depth, ParamRegistry& params, const ops::RopeCache& rope,
           const parallel::ProcessGroups* groups, uint64_t seed, const ops::RopeMlaCache* mla_rope);
  // S, B: the micro-batch's sequence and batch (T = S * B).
  void allocate(Arena& a, int64_t S, int64_t B);
  // out() [T_local, H] = h_k from h_prev and e [T_local, H] (both stay the caller's until the
  // backward). recompute: the block's rerun of its forward for the backward (no balancing counts).
  void forward(DevPtr<const T> h_prev, DevPtr<const T> e, bool recompute = false);
  DevPtr<const T> out() const { return out_; }
  // From dout (the gradient of out()): dh_prev and de assigned, the parameter gradients
  // accumulated. dout is not written.
  void backward(DevPtr<T> dh_prev, DevPtr<T> de, DevPtr<const T> dout, double loss_grad_scale);

  TransformerBlock<T>& block() { return block_; }
  const TransformerBlock<T>& block() const { return block_; }

 private:
  // x_ = eh_proj [en_ | hn_], and its backward from dx_ into den_ / dhn_.
  void proj_forward();
  void proj_backward();
  // eh_proj's three GEMMs on n tokens (all of them under TP): y [n, W] (ldy) = en W_e^T + hn W_h^T;
  // dw_e / dw_h += dy^T en / hn; den / dhn [n, H] = dy W_e / dy W_h (dy [n, W]). f32, or bf16
  // inputs with f32 accumulation under --bf16.
  void proj_gemms_forward(DevPtr<T> y, int64_t ldy, DevPtr<const T> en, DevPtr<const T> hn,
                          int64_t n);
  void proj_gemms_backward(DevPtr<T> den, DevPtr<T> dhn, DevPtr<const T> dy, int64_t ldy,
                           DevPtr<const T> en, DevPtr<const T> hn, int64_t n);

  const Exec* ex_ = &cpu_exec();
  parallel::TensorParallel tp_;
  int64_t H_, W_, n_tok_ = 0, n_loc_ = 0;
  nn::Norm<T> enorm_, hnorm_;
  Param* eh_proj_;  // [H, 2H]; this rank's [W, 2H] under TP
  TransformerBlock<T> block_;
  nn::Norm<T> final_norm_;
  DevPtr<const T> h_prev_ = nullptr, e_ = nullptr;  // the forward's inputs
  DevPtr<T> en_ = nullptr, hn_ = nullptr;  // [T_local, H] the norms' outputs (eh_proj's input)
  DevPtr<T> x_ = nullptr;                  // [T_local, H] the block's input
  DevPtr<T> y_ = nullptr;                  // [T_local, H] the block's output
  DevPtr<T> out_ = nullptr;                // [T_local, H] h_k
  DevPtr<T> dy_ = nullptr, dx_ = nullptr, den_ = nullptr, dhn_ = nullptr;  // [T_local, H]
  // TP only: the whole inputs [T, H] (gathered with SP; the backward gathers them again), the
  // local output columns [T, W] and its gathered blocks [tp, T, W], the input gradients' partial
  // sums [T, H] (dfull_, and gathered_ in the backward), the maps from the gathered blocks' rows to
  // this rank's token-major rows (fwd: [T_local tp]) and from the whole output gradient's rows to
  // this rank's columns (bwd: [T]), rows W wide.
  DevPtr<T> en_full_ = nullptr, hn_full_ = nullptr;
  // --bf16 with SP: en's and hn's all-gathers as bf16 and the output gradient's (only eh_proj's
  // bf16 GEMMs read them, so the gathered values are exact), one staging buffer for all three.
  DevPtr<bf16> in_wire16_ = nullptr;
  DevPtr<T> y_cols_ = nullptr, gathered_ = nullptr, dfull_ = nullptr;
  DevPtr<int32_t> fwd_map_ = nullptr, bwd_map_ = nullptr;
  std::vector<int32_t> fwd_map_host_, bwd_map_host_;  // the maps' source (copied once)
  // --bf16: an input's and the output gradient's bf16 values, and the bf16 GEMMs' f32
  // workspace (the widen path's).
  bool bf16_ = false;
  DevPtr<bf16> in16_ = nullptr, dy16_ = nullptr;
  DevPtr<float> ws32_ = nullptr;
};

}  // namespace moecore::model
