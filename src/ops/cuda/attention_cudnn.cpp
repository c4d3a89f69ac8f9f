// cuDNN's fused attention (SDPA forward and backward) for a --bf16 run's attention calls
// (ops/attention.h: cuda::cudnn_attention_*), through the header-only cuDNN frontend (PyPI's
// nvidia-cudnn-frontend, pinned by scripts/setup.sh). The descriptor function
// (ops/desc/sdpa_desc.h) did the layout algebra, the mask and the refusals, tested on the CPU
// through the SDPA interpreter; this file only turns its fields into frontend graphs, caches them
// per descriptor and runs them. The op's buffers are f32 (activations stay f32 under --bf16), so
// each call casts its inputs into bf16 staging of the same [S, B, H, D] layout and widens the
// outputs back; lse is cuDNN's Stats in place (f32, same convention). One translation unit: the
// frontend's headers cost about 110 s and 2 GB to compile.
#include <cuda_runtime.h>
#include <cudnn.h>
#include <fmt/format.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include <cudnn_frontend.h>

#include "core/check.h"
#include "core/dtype.h"
#include "ops/attention.h"
#include "ops/cast.h"
#include "ops/desc/sdpa_desc.h"

namespace moecore::ops::cuda {

namespace fe = cudnn_frontend;
using desc::SdpaAlignment;
using desc::SdpaDataType;
using desc::SdpaDesc;
using desc::SdpaTensor;

namespace {

// The graph tensors' uids (the variant pack's keys).
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

#define MOE_CHECK_CUDNN_RT(expr, what)                                         \
  do {                                                                         \
    const cudaError_t moe_err_ = (expr);                                       \
    MOE_CHECK(moe_err_ == cudaSuccess, "[attention] {} failed: {}: {}", #expr, \
              cudaGetErrorString(moe_err_), what);                             \
  } while (0)

fe::DataType_t fe_type(SdpaDataType t) {
  switch (t) {
    case SdpaDataType::Bf16:
      return fe::DataType_t::BFLOAT16;
    case SdpaDataType::F32:
      return fe::DataType_t::FLOAT;
    case SdpaDataType::F64:
      return fe::DataType_t::DOUBLE;
  }
  return fe::DataType_t::NOT_SET;
}

fe::graph::Tensor_attributes tensor_attrs(const SdpaTensor& t, const char* name, int64_t uid) {
  return fe::graph::Tensor_attributes()
      .set_name(name)
      .set_uid(uid)
      .set_dim({t.dim[0], t.dim[1], t.dim[2], t.dim[3]})
      .set_stride({t.stride[0], t.stride[1], t.stride[2], t.stride[3]})
      .set_data_type(fe_type(t.type));
}

// Sets an output tensor's uid, dims, strides and type from the descriptor.
void set_output(const std::shared_ptr<fe::graph::Tensor_attributes>& x, const SdpaTensor& t,
                const char* name, int64_t uid) {
  x->set_output(true)
      .set_name(name)
      .set_uid(uid)
      .set_dim({t.dim[0], t.dim[1], t.dim[2], t.dim[3]})
      .set_stride({t.stride[0], t.stride[1], t.stride[2], t.stride[3]})
      .set_data_type(fe_type(t.type));
}

template <typename Attrs>
void set_mask(Attrs& a, const SdpaDesc& d) {
  if (!d.masked) return;
  a.set_diagonal_alignment(d.alignment == SdpaAlignment::TopLeft
                               ? fe::DiagonalAlignment_t::TOP_LEFT
                               : fe::DiagonalAlignment_t::BOTTOM_RIGHT);
  a.set_diagonal_band_right_bound(static_cast<int>(d.right_bound));
}

int64_t elems(const SdpaTensor& t) {
  return t.dim[0] * t.dim[1] * t.dim[2] * t.dim[3];
}

std::string desc_text(const SdpaDesc& d) {
  return fmt::format(
      "b {} h_q {} h_k {} s_q {} s_kv {} d_qk {} d_v {} scale {} mask {}", d.b, d.h_q, d.h_k, d.s_q,
      d.s_kv, d.d_qk, d.d_v, d.attn_scale,
      !d.masked ? std::string("none")
                : fmt::format("{} bound {}",
                              d.alignment == SdpaAlignment::TopLeft ? "top-left" : "bottom-right",
                              d.right_bound));
}

// One graph (forward or backward) of one descriptor, with its plan's workspace and the bf16
// staging of its tensors, all device memory allocated once when it is built.
struct SdpaPlan {
  bool ok = false;
  std::string why;  // when not ok: cuDNN's refusal
  std::shared_ptr<fe::graph::Graph> graph;
  void* workspace = nullptr;
  bf16 *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr;        // forward and backward
  bf16 *dout = nullptr, *dq = nullptr, *dk = nullptr, *dv = nullptr;  // backward
};

bf16* alloc_bf16(int64_t n, const char* what) {
  void* p = nullptr;
  MOE_CHECK_CUDNN_RT(cudaMalloc(&p, static_cast<size_t>(n) * sizeof(bf16)),
                     fmt::format("{} bf16 elements of {} staging", n, what));
  return static_cast<bf16*>(p);
}

// Builds the forward (backward = false) or backward graph of a descriptor; a cuDNN refusal at any
// stage comes back as !ok with its message (the call then runs the own kernel).
SdpaPlan build_plan(cudnnHandle_t handle, const SdpaDesc& d, bool backward) {
  SdpaPlan p;
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  auto Q = g->tensor(tensor_attrs(d.q, "Q", kQ));
  auto K = g->tensor(tensor_attrs(d.k, "K", kK));
  auto V = g->tensor(tensor_attrs(d.v, "V", kV));
  if (!backward) {
    auto opts = fe::graph::SDPA_attributes()
                    .set_name("sdpa_forward")
                    .set_generate_stats(true)
                    .set_attn_scale(d.attn_scale)
                    .set_stats_use_log2(d.stats_log2);
    set_mask(opts, d);
    auto [O, Stats] = g->sdpa(Q, K, V, opts);
    set_output(O, d.o, "O", kO);
    set_output(Stats, d.stats, "Stats", kStats);
  } else {
    auto O = g->tensor(tensor_attrs(d.o, "O", kO));
    auto dO = g->tensor(tensor_attrs(d.o, "dO", kDO));
    auto Stats = g->tensor(tensor_attrs(d.stats, "Stats", kStats));
    // Deterministic: the project's results are bitwise run to run (no dQ atomics).
    auto opts = fe::graph::SDPA_backward_attributes()
                    .set_name("sdpa_backward")
                    .set_attn_scale(d.attn_scale)
                    .set_deterministic_algorithm(true);
    set_mask(opts, d);
    auto [dQ, dK, dV] = g->sdpa_backward(Q, K, V, O, dO, Stats, opts);
    set_output(dQ, d.q, "dQ", kDQ);
    set_output(dK, d.k, "dK", kDK);
    set_output(dV, d.v, "dV", kDV);
  }
  auto fail = [&p](const char* stage, fe::error_t e) {
    p.ok = false;
    p.why = fmt::format("{}: {}", stage, e.get_message());
    return p;
  };
  if (auto e = g->validate(); e.is_bad()) return fail("validate", e);
  if (auto e = g->build_operation_graph(handle); e.is_bad())
    return fail("build_operation_graph", e);
  if (auto e = g->create_execution_plans({fe::HeurMode_t::A}); e.is_bad())
    return fail("create_execution_plans", e);
  if (auto e = g->check_support(handle); e.is_bad()) return fail("check_support", e);
  if (auto e = g->build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE); e.is_bad())
    return fail("build_plans", e);
  int64_t ws = 0;
  if (auto e = g->get_workspace_size(ws); e.is_bad()) return fail("get_workspace_size", e);
  if (ws > 0)
    MOE_CHECK_CUDNN_RT(cudaMalloc(&p.workspace, static_cast<size_t>(ws)),
                       fmt::format("{} bytes of cuDNN SDPA workspace", ws));
  p.q = alloc_bf16(elems(d.q), "q");
  p.k = alloc_bf16(elems(d.k), "k");
  p.v = alloc_bf16(elems(d.v), "v");
  p.o = alloc_bf16(elems(d.o), "out");
  if (backward) {
    p.dout = alloc_bf16(elems(d.o), "dout");
    p.dq = alloc_bf16(elems(d.q), "dq");
    p.dk = alloc_bf16(elems(d.k), "dk");
    p.dv = alloc_bf16(elems(d.v), "dv");
  }
  p.graph = std::move(g);
  p.ok = true;
  return p;
}

// What a plan depends on: the stream (its handle), the direction and every descriptor field.
using PlanKey = std::array<int64_t, 17>;

PlanKey plan_key(void* stream, const SdpaDesc& d, bool backward) {
  uint32_t scale_bits = 0;
  std::memcpy(&scale_bits, &d.attn_scale, sizeof scale_bits);
  return {static_cast<int64_t>(reinterpret_cast<uintptr_t>(stream)),
          backward ? 1 : 0,
          d.b,
          d.h_q,
          d.h_k,
          d.s_q,
          d.s_kv,
          d.d_qk,
          d.d_v,
          d.stats.stride[1],
          d.masked ? 1 : 0,
          static_cast<int64_t>(d.alignment),
          d.right_bound,
          static_cast<int64_t>(scale_bits),
          d.stats_log2 ? 1 : 0,
          d.q.stride[2],
          d.k.stride[2]};
}

// The process's cuDNN state: a handle per stream, the plans, the reasons already logged.
// Deliberately leaked, as the GEMM handles (destroying them after the CUDA context can crash).
struct CudnnState {
  std::mutex mutex;
  std::map<void*, cudnnHandle_t> handles;
  std::map<PlanKey, std::unique_ptr<SdpaPlan>> plans;
  std::set<std::string> logged;
};

CudnnState& state() {
  static auto* s = new CudnnState();
  return *s;
}

cudnnHandle_t handle_of(CudnnState& st, void* stream) {
  cudnnHandle_t& h = st.handles[stream];
  if (h == nullptr) {
    const cudnnStatus_t c = cudnnCreate(&h);
    MOE_CHECK(c == CUDNN_STATUS_SUCCESS, "[attention] cudnnCreate failed: {}",
              cudnnGetErrorString(c));
    const cudnnStatus_t s = cudnnSetStream(h, static_cast<cudaStream_t>(stream));
    MOE_CHECK(s == CUDNN_STATUS_SUCCESS, "[attention] cudnnSetStream failed: {}",
              cudnnGetErrorString(s));
  }
  return h;
}

void log_once(CudnnState& st, const std::string& line) {
  if (st.logged.insert(line).second) fmt::print(stderr, "{}\n", line);
}

SdpaDesc call_desc(const AttentionShape& s, const AttentionDropout* drop) {
  desc::SdpaCall call;
  call.shape = s;
  call.storage = SdpaDataType::Bf16;
  call.dropout_p = drop == nullptr ? 0.0 : drop->p;
  return desc::sdpa_desc(call);
}

// The plan of a call, built on first use; null when the call runs the own kernel (the reason
// logged once). Holds st.mutex.
SdpaPlan* plan_for(CudnnState& st, void* stream, const SdpaDesc& d, bool backward) {
  if (!d.refusal.empty()) {
    log_once(st, fmt::format("[attention] own kernel for {}: {}", desc_text(d), d.refusal));
    return nullptr;
  }
  auto& slot = st.plans[plan_key(stream, d, backward)];
  if (!slot) slot = std::make_unique<SdpaPlan>(build_plan(handle_of(st, stream), d, backward));
  if (!slot->ok) {
    log_once(st, fmt::format("[attention] own kernel for the {} of {}: cuDNN refused it ({})",
                             backward ? "backward" : "forward", desc_text(d), slot->why));
    return nullptr;
  }
  return slot.get();
}

// Runs a plan; false (logged once) when cuDNN refuses to execute it, e.g. for an operand's
// alignment: the call then runs the own kernel, which writes every output again.
bool execute(CudnnState& st, const SdpaPlan& p, cudnnHandle_t h,
             std::unordered_map<int64_t, void*>& pack, const SdpaDesc& d, const char* what) {
  fe::error_t e = p.graph->execute(h, pack, p.workspace);
  if (e.is_good()) return true;
  log_once(st, fmt::format("[attention] own kernel for the {} of {}: cuDNN did not execute it ({})",
                           what, desc_text(d), e.get_message()));
  return false;
}

}  // namespace

const CudnnAttentionProbe& cudnn_attention_probe() {
  static const CudnnAttentionProbe probe = [] {
    CudnnAttentionProbe r;
    const char* env = std::getenv("MOECORE_CUDNN_ATTENTION");
    if (env != nullptr && std::strcmp(env, "0") == 0) {
      r.text = "MOECORE_CUDNN_ATTENTION=0";
      return r;
    }
    const size_t ver = cudnnGetVersion();
    const std::string versions =
        fmt::format("cuDNN {}.{}, frontend {}.{}", ver / 10000, ver % 10000 / 100,
                    CUDNN_FRONTEND_MAJOR_VERSION, CUDNN_FRONTEND_MINOR_VERSION);
    int device = 0;
    cudaDeviceProp prop{};
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
      r.text = fmt::format("{}: no usable CUDA device", versions);
      return r;
    }
    if (prop.major < 8) {
      r.text = fmt::format("{}: sm_{}{} is older than the sm_80 cuDNN's SDPA needs", versions,
                           prop.major, prop.minor);
      return r;
    }
    // A causal GQA forward and backward at head width 128 must build on the default stream.
    AttentionShape s;
    s.S = 128;
    s.B = 1;
    s.Hq = 2;
    s.Hkv = 1;
    s.D = 128;
    s.bf16 = true;
    const SdpaDesc d = call_desc(s, nullptr);
    CudnnState& st = state();
    std::lock_guard<std::mutex> lock(st.mutex);
    try {
      cudnnHandle_t h = handle_of(st, nullptr);
      for (bool backward : {false, true}) {
        SdpaPlan p = build_plan(h, d, backward);
        if (!p.ok) {
          r.text = fmt::format("{}: a causal bf16 SDPA {} did not build: {}", versions,
                               backward ? "backward" : "forward", p.why);
          return r;
        }
        st.plans[plan_key(nullptr, d, backward)] = std::make_unique<SdpaPlan>(std::move(p));
      }
    } catch (const std::exception& e) {
      r.text = fmt::format("{}: {}", versions, e.what());
      return r;
    }
    r.available = true;
    r.text = versions;
    return r;
  }();
  return probe;
}

void cudnn_attention_prepare(void* stream, const AttentionShape& s, const AttentionDropout* drop) {
  if (!s.bf16 || !cudnn_attention_probe().available) return;
  const SdpaDesc d = call_desc(s, drop);
  if (d.empty) return;
  CudnnState& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  plan_for(st, stream, d, false);
  plan_for(st, stream, d, true);
}

bool cudnn_attention_forward(void* stream, float* out, float* lse, const float* q, const float* k,
                             const float* v, const AttentionShape& s,
                             const AttentionDropout* drop) {
  if (!s.bf16 || !cudnn_attention_probe().available) return false;
  check_attention_shape(s, "attention_forward");
  check_attention_dropout(drop, "attention_forward");
  const SdpaDesc d = call_desc(s, drop);
  if (d.empty && d.refusal.empty()) return true;
  CudnnState& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  SdpaPlan* p = plan_for(st, stream, d, false);
  if (p == nullptr) return false;
  cast_f32_to_bf16(stream, p->q, q, elems(d.q));
  cast_f32_to_bf16(stream, p->k, k, elems(d.k));
  cast_f32_to_bf16(stream, p->v, v, elems(d.v));
  std::unordered_map<int64_t, void*> pack = {
      {kQ, p->q}, {kK, p->k}, {kV, p->v}, {kO, p->o}, {kStats, lse}};
  if (!execute(st, *p, handle_of(st, stream), pack, d, "forward")) return false;
  cast_bf16_to_f32(stream, out, p->o, elems(d.o));
  return true;
}

bool cudnn_attention_backward(void* stream, float* dq, float* dk, float* dv, const float* dout,
                              const float* q, const float* k, const float* v, const float* out,
                              const float* lse, const AttentionShape& s,
                              const AttentionDropout* drop) {
  if (!s.bf16 || !cudnn_attention_probe().available) return false;
  check_attention_shape(s, "attention_backward");
  check_attention_dropout(drop, "attention_backward");
  const SdpaDesc d = call_desc(s, drop);
  if (d.empty && d.refusal.empty()) return true;
  CudnnState& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  SdpaPlan* p = plan_for(st, stream, d, true);
  if (p == nullptr) return false;
  cast_f32_to_bf16(stream, p->q, q, elems(d.q));
  cast_f32_to_bf16(stream, p->k, k, elems(d.k));
  cast_f32_to_bf16(stream, p->v, v, elems(d.v));
  cast_f32_to_bf16(stream, p->o, out, elems(d.o));
  cast_f32_to_bf16(stream, p->dout, dout, elems(d.o));
  std::unordered_map<int64_t, void*> pack = {
      {kQ, p->q},   {kK, p->k},     {kV, p->v},
      {kO, p->o},   {kDO, p->dout}, {kStats, const_cast<float*>(lse)},
      {kDQ, p->dq}, {kDK, p->dk},   {kDV, p->dv}};
  if (!execute(st, *p, handle_of(st, stream), pack, d, "backward")) return false;
  cast_bf16_to_f32(stream, dq, p->dq, elems(d.q));
  cast_bf16_to_f32(stream, dk, p->dk, elems(d.k));
  cast_bf16_to_f32(stream, dv, p->dv, elems(d.v));
  return true;
}

}  // namespace moecore::ops::cuda
