// The tensor tables of docs/hf_interop.md (section 2) as data: for every moecore tensor of an
// HF model, the HF tensors it is made of and how (fused QKV interleaved per query group, fc1 =
// [gate; up], experts stacked into [E, ...]). Both directions read the same table: import
// concatenates the HF tensors' row blocks into the moecore tensor, export cuts the moecore
// tensor into the same blocks, so one is the other's inverse by construction.
// DeepSeek-V3 adds multi-latent attention's projections (whose rotary rows are permuted when
// the checkpoint pairs them half-split), the routers' expert bias, and the MTP layers with their
// copies of the embedding and head.
// Legend: V vocab (Vp: moecore's rows), H hidden, D head dim, Hq / Hkv query / KV heads,
// qpg = Hq / Hkv, F expert ffn, E experts, S shared expert ffn; MLA: ql / kl the q / kv LoRA
// ranks, qk / pe / dv the un-rotated, rotated and value parts of a head.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "convert/hf_config.h"

namespace moecore::convert {

struct HfTensor {
  std::string name;
  std::vector<int64_t> shape;  // as stored in the file
  // GPT-2's Conv1D stores a weight [in, out], the transpose of nn.Linear's [out, in]: its rows
  // (below) are those of the [out, in] matrix, i.e. the stored columns.
  bool transposed = false;
};
// The shape whose rows the blocks count: `shape`, or its two dimensions swapped when transposed.
std::vector<int64_t> row_shape(const HfTensor& h);

// Rows [hf_row, hf_row + rows) of HF tensor `hf` (its index in TensorMapping::hf): the next
// `rows` rows of the moecore tensor. A tensor's rows are its first dimension, or the first two
// of a stacked [E, rows, cols] expert tensor, each row the last dimension (1 element for a
// bias).
struct RowBlock {
  int hf = 0;
  int64_t hf_row = 0;
  int64_t rows = 0;
};

struct TensorMapping {
  std::string moecore;           // the global parameter name
  std::vector<int64_t> shape;    // its global shape
  std::vector<HfTensor> hf;      // the HF tensors it is made of
  std::vector<RowBlock> blocks;  // in the moecore tensor's row order, covering every row
};

struct HfTensorMap {
  std::vector<TensorMapping> tensors;  // moecore's parameters, in the model's order
  // HF tensors without a moecore tensor: a Qwen2-MoE without a shared expert still holds
  // zero-row shared-expert tensors and a gate (Qwen2MoeSparseMoeBlock.__init__ always builds
  // them): import checks their shapes and drops them, export writes them (the gate as zeros).
  std::vector<HfTensor> empty_shared_expert;
  // A tied model's lm_head.weight: absent from HF's files (_tied_weights_keys); import accepts
  // one equal to the embedding (HF tensor `embedding`), export writes none.
  std::optional<HfTensor> tied_head;
  std::string embedding;
  // HF tensors that repeat another HF tensor of the map (DeepSeek-V3's MTP layers store copies
  // of the embedding and the head): import checks them equal to `of` and reads them once, export
  // writes `of`'s values under their name.
  struct Copy {
    HfTensor tensor;
    std::string of;
  };
  std::vector<Copy> copies;
};

// The table of `s` (DeepSeek-V3: of s.deepseek, the MTP layers and FP8 scales included: each
// FP8 weight's `_scale_inv` is read with it, HfWeights). The vocabulary tables are [V, H] on both
// sides: a moecore checkpoint holds the model's rows, never the padding of the TP size that wrote
// it (train::checkpoint_shape).
HfTensorMap hf_tensor_map(const HfModelSpec& s);

// Elements per row of a tensor (its last dimension; 1 for a 1-D tensor).
int64_t row_width(const std::vector<int64_t>& shape);
int64_t numel(const std::vector<int64_t>& shape);

// "'a', 'b', 'c' and 5 more": tensor names for messages.
std::string name_list(const std::vector<std::string>& names, size_t max = 8);

// The moecore tensor from its HF tensors (hf[i] the values of t.hf[i] as stored).
std::vector<float> to_moecore(const TensorMapping& t, const std::vector<std::vector<float>>& hf);
// The HF tensors from the moecore tensor, as stored.
std::vector<std::vector<float>> to_hf(const TensorMapping& t, std::span<const float> m);

}  // namespace moecore::convert
