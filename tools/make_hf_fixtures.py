#!/usr/bin/env python3
"""Tiny HuggingFace checkpoints (MoE, and GPT-2) and the logits HuggingFace `transformers` computes for them,
the reference of moecore's HF import and export (docs/hf_interop.md has the mapping).

Writes tests/fixtures/hf/<case>/: the model as `save_pretrained` writes it (config.json,
generation_config.json, safetensors; a sharded one with model.safetensors.index.json) and
reference.json with a few token sequences, the logits of each (every position, every vocabulary
entry), its mean next-token cross entropy, and the experts each token chose in each MoE layer.

Cases:
  deepseek_v3
             DeepseekV3ForCausalLM: multi-latent attention (q_lora_rank 16, kv_lora_rank 16,
             qk_nope 8 + qk_rope 4, v 8), YaRN RoPE (factor 4, mscale 1, mscale_all_dim 1),
             rope_interleave, first_k_dense_replace 1 (layer 0 dense, 1 and 2 MoE), sigmoid router
             with a non-zero e_score_correction_bias, group-limited routing (2 groups of 4
             experts, the best 1 kept), top-2 of 8 experts (num_experts_per_tok = 2 x topk_group,
             as DeepSeek-V3's 8 and 4: transformers scores a group by its top 2 biased scores,
             Megatron by its top num_experts_per_tok / topk_group, the same then; a group's top 2
             of 4 is neither its best score nor its sum, and the top 2 of the kept group's 4 is
             a real choice), one shared expert, norm_topk_prob, routed_scaling_factor 2.5,
             untied, float32, one file; and the multi-token-prediction layer that transformers
             neither builds nor saves, drawn here and stored as DeepSeek's checkpoints name it:
             model.layers.{num_hidden_layers}.{enorm, hnorm, eh_proj, embed_tokens,
             shared_head.norm, shared_head.head} and a whole MoE decoder layer. The reference is
             computed in float64 (the float32 weights widened) and covers the main model only.
  deepseek_v3_no_q_lora
             deepseek_v3 with q_lora_rank null (q_proj straight from the hidden state), and
             routed top-4 in 4 groups of 2 keeping 2 (several groups kept; num_experts_per_tok
             = 2 x topk_group again).
  deepseek_v3_fp8
             deepseek_v3's weights as DeepSeek's FP8 release stores them: every linear weight
             of attention, MLP and experts (not the router, norms, embedding or heads) as
             float8_e4m3fn codes with a float32 `<name>_scale_inv` per 16 x 16 block
             (quantization_config.weight_block_size [16, 16]: 128 would cover the tiny tensors
             in one block; the kv_a_proj_with_mqa rows, 20, end in a partial block), scale_inv =
             amax(|block|) / 448; dequantized.safetensors holds codes x scale_inv in float32
             (what an importer must read), and reference.json the logits of that dequantized model.
  mixtral    MixtralForCausalLM: GQA, untied embeddings, top-2 of 4 experts, float32, one file.
  qwen2_moe  Qwen2MoeForCausalLM: q/k/v bias, shared expert with its sigmoid gate,
             norm_topk_prob false, decoder_sparse_step 2 (layers 1 and 3 MoE, 0 and 2 dense),
             tied embeddings, top-3 of 8 experts, float32, one file.
  qwen3_moe  Qwen3MoeForCausalLM: q/k RMSNorm, head_dim 16 != hidden / heads = 8,
             norm_topk_prob true, mlp_only_layers [1] (layers 0 and 2 MoE), untied, top-2 of 8
             experts; saved in bfloat16 and sharded into several files.
  gpt2       GPT2LMHeadModel: LayerNorm (weight and bias), learned absolute positions,
             gelu_new (tanh) MLP of n_inner = 4 n_embd (None in config.json), biases on every
             linear layer, Conv1D weights stored [in, out], tied embeddings, float32, one file.
  gpt2_published
             GPT-2 as its checkpoints are published (openai-community/gpt2, distilgpt2): the
             weights of the base GPT2Model, keys without the `transformer.` prefix, with each
             layer's `attn.bias` buffer (the causal mask, float32 [1, 1, n_positions,
             n_positions], ones on and below the diagonal) and `attn.masked_bias` (float32
             scalar -1e4) that older transformers saved, and activation_function
             gelu_pytorch_tanh (torch's tanh GeLU). transformers loads it into GPT2LMHeadModel
             (it adds the prefix, ignores attn.bias and reports masked_bias as unexpected, unused).

The weights are drawn from torch.Generator(seed) in the order of named_parameters(), normal
with standard deviation 1/sqrt(fan_in) for linear layers, experts, the shared expert gate and
lm_head, 2/sqrt(hidden) for the router (so that routing is decisive), 0.5 for the embedding,
0.2 for biases, and 1 + 0.2 N(0, 1) for every RMSNorm and LayerNorm weight (so that a norm mapped
to the wrong place shows); GPT-2's position table like the embedding (0.5), its Conv1D weights
([in, out]) with 1/sqrt(in): large enough that the logits depend clearly on which experts a token takes (the
transformers default, std 0.02, would make every routing look alike). A seed is redrawn (seed + 1, ...) until no
token of the reference inputs sits near a routing tie (MoE cases): in every MoE layer the k-th and
(k+1)-th largest softmax router probabilities differ by more than MARGIN, because moecore sums
in another order than torch.

The reference is computed by the checkpoint as written, loaded back with from_pretrained in
float32 (eager attention, eager experts, eval mode, no attention mask, each sequence alone as a
batch of one); for the bfloat16 case that is the bf16 weights widened exactly to float32. The
script checks that the loaded model equals the one it saved and that the two sequences run as one
batch give the same logits.

Regenerate (needs a network for pip; the run itself is offline, CPU, a few seconds):

    python3 -m venv /tmp/hfenv && /tmp/hfenv/bin/pip install torch==2.15.0 \
        transformers==5.24.0 safetensors==0.8.0 numpy==2.4.6
    /tmp/hfenv/bin/python tools/make_hf_fixtures.py [--out tests/fixtures/hf] [--cases gpt2 ...]

Generated with torch 2.15.0 (the PyPI wheel, 2.15.0+cu132, run on the CPU) and transformers
5.24.0, with numpy 2.4.6 and safetensors 0.8.0. The files are byte-identical from run to run
(one torch thread) on one machine; on a CPU with other float kernels (AVX-512 BF16 or not) the
weights files are still identical but reference.json's logits may differ in the last bits, so
regenerate only the cases that change (--cases). gpt2_published was made on another machine
than the other cases (the others' reference.json differ there by a few ulps; their weights not). tools/check_hf_mapping.py checks docs/hf_interop.md's mapping on them. Another transformers may write config.json keys of its
own era (4.x writes rope_theta at the top level and torch_dtype; 5.x rope_parameters and dtype),
which is why the versions are recorded in each reference.json. The deepseek_v3 cases were made
with the same versions (torch's PyPI wheel without its CUDA libraries loaded: CPU only); their
reference.json is written by json (float64 text that reads back exactly), not by dump().
"""
import argparse
import json
import math
import os
import shutil
import sys

import numpy as np
import torch
import transformers
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, GPT2Config, GPT2LMHeadModel, MixtralConfig, MixtralForCausalLM,
                          Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)
from safetensors.torch import load_file, save_file
from transformers.pytorch_utils import Conv1D

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "hf")
MARGIN = 1e-3  # minimum gap between the k-th and (k+1)-th router probability of any token
NUM_SEQUENCES = 2
SEQ_LEN = 8
TF_MAJOR = int(transformers.__version__.split(".")[0])


def rope(theta):
    """RoPE settings under the attribute names of the installed transformers."""
    if TF_MAJOR >= 5:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    return {"rope_theta": theta, "rope_scaling": None}


# Options every case sets, so that nothing moecore must match is left to a default.
COMMON = dict(
    hidden_act="silu",
    attention_dropout=0.0,
    max_position_embeddings=32,
    output_router_logits=False,
    router_aux_loss_coef=0.01,
    initializer_range=0.02,  # unused: the script draws every weight itself
    use_cache=False,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)

CASES = [
    dict(
        name="mixtral",
        model=MixtralForCausalLM,
        config=MixtralConfig,
        seed=1,
        dtype=torch.float32,
        max_shard_size=None,
        kwargs=dict(COMMON, vocab_size=96, hidden_size=32, intermediate_size=24,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=None, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    sliding_window=None, num_local_experts=4, num_experts_per_tok=2,
                    router_jitter_noise=0.0, **rope(1e6)),
    ),
    dict(
        name="qwen2_moe",
        model=Qwen2MoeForCausalLM,
        config=Qwen2MoeConfig,
        seed=101,
        dtype=torch.float32,
        max_shard_size=None,
        kwargs=dict(COMMON, vocab_size=80, hidden_size=24, intermediate_size=32,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                    sliding_window=None, max_window_layers=4, num_experts=8,
                    num_experts_per_tok=3, moe_intermediate_size=12,
                    shared_expert_intermediate_size=24, norm_topk_prob=False,
                    decoder_sparse_step=2, mlp_only_layers=[], qkv_bias=True, **rope(10000.0)),
    ),
    dict(
        name="qwen3_moe",
        model=Qwen3MoeForCausalLM,
        config=Qwen3MoeConfig,
        seed=201,
        dtype=torch.bfloat16,
        max_shard_size="48KB",
        kwargs=dict(COMMON, vocab_size=112, hidden_size=32, intermediate_size=48,
                    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=False,
                    attention_bias=False, use_sliding_window=False, sliding_window=None,
                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                    **rope(1e6)),
    ),
    dict(
        name="gpt2",
        model=GPT2LMHeadModel,
        config=GPT2Config,
        seed=301,
        dtype=torch.float32,
        max_shard_size=None,
        # Every option moecore must match set explicitly (not COMMON: GPT-2 has its own names).
        kwargs=dict(vocab_size=88, n_positions=32, n_embd=32, n_layer=2, n_head=4, n_inner=None,
                    activation_function="gelu_new", layer_norm_epsilon=1e-5, resid_pdrop=0.0,
                    embd_pdrop=0.0, attn_pdrop=0.0, scale_attn_weights=True,
                    scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                    tie_word_embeddings=True, initializer_range=0.02, use_cache=False,
                    bos_token_id=None, eos_token_id=None, pad_token_id=None),
    ),
    dict(
        name="gpt2_published",
        model=GPT2LMHeadModel,
        config=GPT2Config,
        seed=401,
        dtype=torch.float32,
        max_shard_size=None,
        published=True,  # rewrite_as_published() below
        kwargs=dict(vocab_size=72, n_positions=16, n_embd=24, n_layer=2, n_head=3, n_inner=None,
                    activation_function="gelu_pytorch_tanh", layer_norm_epsilon=1e-5,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, scale_attn_weights=True,
                    scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                    tie_word_embeddings=True, initializer_range=0.02, use_cache=False,
                    bos_token_id=None, eos_token_id=None, pad_token_id=None),
    ),
]


def rewrite_as_published(out, cfg):
    """model.safetensors of `out` in the layout GPT-2's checkpoints are published in: GPT2Model's
    keys (no `transformer.` prefix; tied, so no lm_head), plus every layer's attn.bias (the causal
    mask) and attn.masked_bias buffers, as older transformers saved them."""
    path = os.path.join(out, "model.safetensors")
    tensors = load_file(path)
    published = {}
    for name, t in tensors.items():
        assert name.startswith("transformer."), name
        published[name[len("transformer."):]] = t
    P = cfg.n_positions
    for i in range(cfg.n_layer):
        published[f"h.{i}.attn.bias"] = torch.tril(torch.ones(P, P)).view(1, 1, P, P)
        published[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(published, path, metadata={"format": "pt"})


def make_config(case):
    kwargs = dict(case["kwargs"])
    if TF_MAJOR < 5 and case["name"] == "qwen2_moe":
        kwargs.pop("qkv_bias")  # 4.x: q/k/v always carry a bias
    return case["config"](**kwargs)


def load_kwargs():
    """from_pretrained options: float32, the plain-loop attention and experts."""
    kw = {"attn_implementation": "eager"}
    if TF_MAJOR >= 5:
        kw.update(dtype=torch.float32, experts_implementation="eager")
    else:
        kw.update(torch_dtype=torch.float32)
    return kw


def init_weights(model, seed):
    """Every parameter drawn from one generator, in named_parameters() order."""
    g = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    conv1d = {n + ".weight" for n, m in model.named_modules() if isinstance(m, Conv1D)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                std = 0.2
            elif p.dim() == 1:  # RMSNorm and LayerNorm weights
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
                continue
            elif "embed_tokens" in name or name.endswith(("wte.weight", "wpe.weight")):
                std = 0.5
            elif name.endswith("mlp.gate.weight"):  # the router
                std = 2.0 / math.sqrt(hidden)
            elif name in conv1d:  # GPT-2's Conv1D: [in, out]
                std = 1.0 / math.sqrt(p.shape[0])
            else:  # linear layers, experts ([E, out, in]), lm_head, the shared expert gate
                std = 1.0 / math.sqrt(p.shape[-1])
            p.copy_(std * torch.randn(p.shape, generator=g))


def moe_routers(model):
    """(layer index, router module) of the MoE layers, in layer order (none for GPT-2)."""
    out = []
    for i, layer in enumerate(getattr(getattr(model, "model", None), "layers", [])):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(layer.mlp, "experts"):
            out.append((i, gate))
    return out


def run(model, ids_BS):
    """Logits [B, S, V] and, per MoE layer, the router logits [B*S, E] of one forward."""
    captured = {}
    hooks = []
    for i, gate in moe_routers(model):
        def hook(_m, _inp, out, i=i):
            captured[i] = out[0].detach().clone()
        hooks.append(gate.register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = model(input_ids=ids_BS, labels=ids_BS, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return out, captured


def routing(router_logits, k):
    """Top-k experts and their weights as HF applies them, and the smallest top-k gap."""
    p = torch.softmax(router_logits.float(), dim=-1)
    s = torch.sort(p, dim=-1, descending=True).values
    gap = (s[:, k - 1] - s[:, k]).min().item() if k < p.shape[1] else math.inf
    return p, gap


def mean_ce_f64(logits_SV, ids_S):
    """Mean next-token cross entropy in float64 from the float32 logits."""
    x = logits_SV[:-1].double()
    lse = torch.logsumexp(x, dim=-1)
    return (lse - x.gather(1, ids_S[1:, None]).squeeze(1)).mean().item()


def f32(x):
    """A float32 as the shortest decimal that reads back to the same float32."""
    v = np.float32(x)
    assert np.isfinite(v), x
    return str(v)


def dump(obj, indent=0):
    """JSON with one line per innermost list, floats given as f32() text."""
    pad = " " * indent
    if isinstance(obj, dict):
        items = [f'{pad} {json.dumps(k)}: {dump(v, indent + 1).lstrip()}' for k, v in obj.items()]
        return pad + "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list):
        if all(not isinstance(v, (dict, list)) for v in obj):
            return pad + "[" + ",".join(dump(v) for v in obj) + "]"
        return pad + "[\n" + ",\n".join(dump(v, indent + 1) for v in obj) + "\n" + pad + "]"
    if isinstance(obj, (float, np.floating)):
        return f32(obj)
    return json.dumps(obj)


def draw_model(case):
    """The case's model with its first seed at or after case['seed'] whose routing of the inputs
    has no near-tie; returns (model in float32 holding the saved values, ids, seed, gap)."""
    cfg = make_config(case)
    k = getattr(cfg, "num_experts_per_tok", 0)
    for seed in range(case["seed"], case["seed"] + 100):
        torch.manual_seed(seed)
        model = case["model"](cfg).eval()
        init_weights(model, seed)
        if case["dtype"] != torch.float32:
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.to(case["dtype"]).float())
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, cfg.vocab_size, (NUM_SEQUENCES, SEQ_LEN), generator=g)
        gap = math.inf
        for b in range(NUM_SEQUENCES):
            _, rl = run(model, ids[b:b + 1])
            for logits in rl.values():
                gap = min(gap, routing(logits, k)[1])
        print(f"{case['name']}: seed {seed} min top-k gap {gap:.3g}", file=sys.stderr)
        if gap > MARGIN:
            return model, ids, seed, gap
    raise RuntimeError(f"{case['name']}: no seed without routing near-ties")


def write_case(case, out_root):
    model, ids, seed, gap = draw_model(case)
    out = os.path.join(out_root, case["name"])
    if os.path.isdir(out):
        shutil.rmtree(out)
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.to(case["dtype"])
    save_kw = {} if case["max_shard_size"] is None else {"max_shard_size": case["max_shard_size"]}
    model.save_pretrained(out, **save_kw)
    if case.get("published"):
        rewrite_as_published(out, model.config)

    ref, info = case["model"].from_pretrained(out, output_loading_info=True, **load_kwargs())
    ref.eval()
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        found = set(info.get(key) or [])
        if case.get("published") and key == "unexpected_keys":  # loaded, unused
            found -= {f"h.{i}.attn.masked_bias" for i in range(model.config.n_layer)}
            found -= {f"transformer.h.{i}.attn.masked_bias" for i in range(model.config.n_layer)}
        assert not found, (case["name"], key, found)
    for n, p in ref.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, saved[n]), (case["name"], n)

    cfg = ref.config
    k = getattr(cfg, "num_experts_per_tok", 0)
    moe_layers = [i for i, _ in moe_routers(ref)]
    sequences, min_gap, losses, single = [], math.inf, [], []
    for b in range(NUM_SEQUENCES):
        o, rl = run(ref, ids[b:b + 1])
        logits = o.logits[0]
        assert logits.dtype == torch.float32
        loss = o.loss.item()
        assert abs(loss - mean_ce_f64(logits, ids[b])) < 1e-5, (loss, mean_ce_f64(logits, ids[b]))
        layers = []
        for i in moe_layers:
            p, g = routing(rl[i], k)
            min_gap = min(min_gap, g)
            top_p, top_i = torch.topk(p, k, dim=-1)
            if getattr(cfg, "norm_topk_prob", True):  # Mixtral always renormalises
                top_p = top_p / top_p.sum(dim=-1, keepdim=True)
            layers.append({"layer": i,
                           "experts": top_i.tolist(),
                           "weights": [[float(v) for v in row] for row in top_p]})
        sequences.append({"input_ids": ids[b].tolist(),
                          "loss": loss,
                          "routing": layers,
                          "logits": [[float(v) for v in row] for row in logits]})
        losses.append(loss)
        single.append(logits)
    assert min_gap > MARGIN and (min_gap == gap or abs(min_gap - gap) < 1e-6), (min_gap, gap)
    batch_out, _ = run(ref, ids)
    batch_diff = (batch_out.logits - torch.stack(single)).abs().max().item()
    assert batch_diff < 1e-5, batch_diff

    weights = "bfloat16" if case["dtype"] == torch.bfloat16 else "float32"
    compute = ("float32: the checkpoint loaded with from_pretrained(dtype=float32), eval mode, "
               "eager attention and experts, no attention mask, each sequence alone (batch 1)")
    if weights == "bfloat16":
        compute += ("; the weights are stored as bfloat16 and widened exactly to float32, so these "
                    "are float32 logits of the bf16-rounded weights (not a bf16 forward)")
    shards = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    reference = {
        "format": "moecore-hf-reference",
        "version": 1,
        "case": case["name"],
        "architecture": type(ref).__name__,
        "generator": {"script": "tools/make_hf_fixtures.py", "torch": torch.__version__,
                      "transformers": transformers.__version__, "seed": seed},
        "weights_dtype": weights,
        "safetensors_files": shards,
        "compute": compute,
        "moe_layers": moe_layers,
        "dense_layers": [i for i in range(cfg.num_hidden_layers) if i not in moe_layers],
        "loss_definition": ("mean over positions t = 0 .. S-2 of "
                            "logsumexp(logits[t]) - logits[t][input_ids[t + 1]] (transformers' "
                            "loss with labels = input_ids)"),
        "routing_definition": ("per MoE layer and token: the top-k experts of softmax(router "
                               "logits) in descending order and the weights their outputs are "
                               "scaled by (renormalised over the k when norm_topk_prob, or "
                               "always for Mixtral)"),
        "min_topk_gap": min_gap if moe_layers else None,  # null: no router
        "batch_max_abs_diff": batch_diff,
        "batch_loss": sum(losses) / len(losses),
        "sequences": sequences,
    }
    with open(os.path.join(out, "reference.json"), "w") as f:
        f.write(dump(reference) + "\n")
    total = 0
    for fname in sorted(os.listdir(out)):
        size = os.path.getsize(os.path.join(out, fname))
        total += size
        print(f"  {case['name']}/{fname:40s} {size:8d} bytes")
    print(f"{case['name']}: seed {seed}, moe layers {moe_layers}, min top-k gap {min_gap:.3g}, "
          f"losses {', '.join(f'{v:.4f}' for v in losses)}, {total} bytes")
    return total


DEEPSEEK_KWARGS = dict(
    vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=8,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
    n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=16,
    qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=8, n_group=2, topk_group=1,
    num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True, hidden_act="silu",
    max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
    attention_bias=False, attention_dropout=0.0,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                     "original_max_position_embeddings": 16, "beta_fast": 32.0,
                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    rope_interleave=True, num_nextn_predict_layers=1, initializer_range=0.02, use_cache=False,
    pad_token_id=None, bos_token_id=None, eos_token_id=None)
DEEPSEEK_CASES = {
    "deepseek_v3": dict(seed=501, kwargs=DEEPSEEK_KWARGS),
    # Also the routing of several groups kept: 4 groups of 2 keeping 2, top-4 (2 x topk_group).
    "deepseek_v3_no_q_lora": dict(seed=601, kwargs=dict(DEEPSEEK_KWARGS, q_lora_rank=None,
                                                        n_group=4, topk_group=2,
                                                        num_experts_per_tok=4)),
}
FP8_BLOCK = [16, 16]
FP8_MAX = 448.0  # the largest float8_e4m3fn


def deepseek_gap(router_logits, bias, cfg):
    """The smallest margin of DeepSeek's group-limited choice over the tokens: between the
    topk_group-th and next group score, and the k-th and next expert score within the groups."""
    s = torch.sigmoid(router_logits.double()) + bias.double()
    t, e = s.shape
    grouped = s.view(t, cfg.n_group, e // cfg.n_group)
    gscore = grouped.topk(2, dim=-1).values.sum(-1)
    gs = gscore.sort(dim=-1, descending=True).values
    gap = (gs[:, cfg.topk_group - 1] - gs[:, cfg.topk_group]).min().item()
    keep = torch.zeros_like(gscore, dtype=torch.bool)
    keep.scatter_(1, gscore.topk(cfg.topk_group, dim=-1).indices, True)
    masked = s.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(t, e), -math.inf)
    ms = masked.sort(dim=-1, descending=True).values
    k = cfg.num_experts_per_tok
    return min(gap, (ms[:, k - 1] - ms[:, k]).min().item())


def draw_params(named, g, hidden):
    """init_weights' rule for a list of (name, tensor)."""
    with torch.no_grad():
        for name, p in named:
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(2.0 / math.sqrt(hidden) * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(1.0 / math.sqrt(p.shape[-1]) * torch.randn(p.shape, generator=g))


def mtp_tensors(cfg, model, g):
    """DeepSeek's multi-token-prediction layer (num_nextn_predict_layers 1) under the names of
    DeepSeek-V3's checkpoints, drawn from g: a MoE decoder layer plus enorm, hnorm, eh_proj
    [H, 2H], shared_head.norm, and its own embed_tokens / shared_head.head (DeepSeek stores
    copies of the main model's)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer
    n = cfg.num_hidden_layers
    h = cfg.hidden_size
    layer = DeepseekV3DecoderLayer(cfg, layer_idx=n)
    named = list(layer.named_parameters())
    extra = {"enorm.weight": torch.empty(h), "hnorm.weight": torch.empty(h),
             "eh_proj.weight": torch.empty(h, 2 * h), "shared_head.norm.weight": torch.empty(h)}
    draw_params(named + sorted(extra.items()), g, h)
    with torch.no_grad():
        layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(cfg.n_routed_experts, generator=g))
    out = {}
    for k, v in layer.state_dict().items():
        v = v.detach().clone()
        if k == "mlp.experts.gate_up_proj":  # [E, 2I, H], gate rows first: per expert on disk
            i = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"model.layers.{n}.mlp.experts.{e}.gate_proj.weight"] = v[e, :i].clone()
                out[f"model.layers.{n}.mlp.experts.{e}.up_proj.weight"] = v[e, i:].clone()
        elif k == "mlp.experts.down_proj":  # [E, H, I]
            for e in range(v.shape[0]):
                out[f"model.layers.{n}.mlp.experts.{e}.down_proj.weight"] = v[e].clone()
        else:
            out[f"model.layers.{n}.{k}"] = v
    out.update({f"model.layers.{n}.{k}": v for k, v in extra.items()})
    out[f"model.layers.{n}.embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    out[f"model.layers.{n}.shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    return out


def fp8_quantize(w, block):
    """(float8_e4m3fn codes, float32 scale_inv [ceil(r/br), ceil(c/bc)]) of a 2-D weight:
    scale_inv = amax(|block|) / 448, codes = round-to-nearest(w / scale_inv)."""
    r, c = w.shape
    br, bc = block
    nr, nc = -(-r // br), -(-c // bc)
    scale = torch.empty(nr, nc, dtype=torch.float32)
    codes = torch.empty(r, c, dtype=torch.float8_e4m3fn)
    for i in range(nr):
        for j in range(nc):
            blk = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc].float()
            s = (blk.abs().max() / FP8_MAX).clamp(min=1e-12)
            scale[i, j] = s
            codes[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (blk / s).to(torch.float8_e4m3fn)
    return codes, scale


def fp8_dequantize(codes, scale, block):
    br, bc = block
    full = scale.repeat_interleave(br, 0)[:codes.shape[0]].repeat_interleave(bc, 1)[:, :codes.shape[1]]
    return codes.float() * full


def is_fp8_weight(name):
    """The tensors DeepSeek's FP8 release quantizes: linear weights of attention, dense MLP,
    shared and routed experts, the MTP layer's too; not norms, the router, embeddings, heads."""
    if not name.endswith(".weight") or "norm" in name:
        return False
    return any(k in name for k in (".self_attn.", ".mlp.experts.", ".mlp.shared_experts.",
                                    ".mlp.gate_proj", ".mlp.up_proj", ".mlp.down_proj"))


def deepseek_reference(ref, ids, cfg, name, seed, extra):
    sequences, losses, min_gap = [], [], math.inf
    moe_layers = [i for i, _ in moe_routers(ref)]
    for b in range(NUM_SEQUENCES):
        o, rl = run(ref, ids[b:b + 1])
        logits = o.logits[0]
        assert logits.dtype == torch.float64
        for i in moe_layers:
            gate = ref.model.layers[i].mlp.gate
            min_gap = min(min_gap, deepseek_gap(rl[i], gate.e_score_correction_bias, cfg))
        sequences.append({"input_ids": ids[b].tolist(), "loss": o.loss.item(),
                          "logits": [[float(v) for v in row] for row in logits]})
        losses.append(o.loss.item())
    assert min_gap > MARGIN, (name, min_gap)  # moecore sums in another order than torch
    return {
        "format": "moecore-hf-reference",
        "version": 1,
        "case": name,
        "architecture": type(ref).__name__,
        "generator": {"script": "tools/make_hf_fixtures.py", "torch": torch.__version__,
                      "transformers": transformers.__version__, "numpy": np.__version__,
                      "seed": seed},
        "compute": ("float64: the checkpoint loaded with from_pretrained(dtype=float32), widened "
                    "to float64 (.double()), eval mode, eager attention and experts, no attention "
                    "mask, each sequence alone (batch 1); the MTP layer is not part of it"),
        "moe_layers": moe_layers,
        "dense_layers": [i for i in range(cfg.num_hidden_layers) if i not in moe_layers],
        "min_group_topk_gap": min_gap,
        "batch_loss": sum(losses) / len(losses),
        **extra,
        "sequences": sequences,
    }


def write_json(path, obj):
    """Like dump(), but float64 values as repr (the shortest text that reads back exactly)."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def deepseek_config(kwargs):
    """The config with the plain-loop attention and experts (what load_kwargs() asks for; a
    float64 model needs them: the grouped experts take float32 / bf16 only)."""
    return DeepseekV3Config(**kwargs, attn_implementation="eager", experts_implementation="eager")


def write_deepseek_case(name, out_root):
    case = DEEPSEEK_CASES[name]
    cfg = deepseek_config(case["kwargs"])
    # transformers' group score (a group's top 2) is Megatron's (its top num_experts_per_tok /
    # topk_group) only then: moecore's import refuses other group-limited configs.
    assert cfg.topk_group == cfg.n_group or cfg.num_experts_per_tok == 2 * cfg.topk_group, name
    for seed in range(case["seed"], case["seed"] + 100):
        torch.manual_seed(seed)
        model = DeepseekV3ForCausalLM(cfg).eval()
        g = torch.Generator().manual_seed(seed)
        draw_params(list(model.named_parameters()), g, cfg.hidden_size)
        with torch.no_grad():
            for _, gate in moe_routers(model):
                gate.e_score_correction_bias.copy_(0.1 * torch.randn(cfg.n_routed_experts, generator=g))
        mtp = mtp_tensors(cfg, model, g)
        ids = torch.randint(0, cfg.vocab_size, (NUM_SEQUENCES, SEQ_LEN), generator=g)
        m64 = DeepseekV3ForCausalLM(cfg).eval()
        m64.load_state_dict(model.state_dict())
        m64.double()
        gap = math.inf
        for b in range(NUM_SEQUENCES):
            _, rl = run(m64, ids[b:b + 1])
            for i, gate in moe_routers(m64):
                gap = min(gap, deepseek_gap(rl[i], gate.e_score_correction_bias, cfg))
        print(f"{name}: seed {seed} min group/top-k gap {gap:.3g}", file=sys.stderr)
        if gap > MARGIN:
            break
    else:
        raise RuntimeError(f"{name}: no seed without routing near-ties")
    out = os.path.join(out_root, name)
    if os.path.isdir(out):
        shutil.rmtree(out)
    model.save_pretrained(out)
    path = os.path.join(out, "model.safetensors")
    tensors = load_file(path)
    assert not set(tensors) & set(mtp)
    tensors.update(mtp)
    save_file(tensors, path, metadata={"format": "pt"})

    ref, info = DeepseekV3ForCausalLM.from_pretrained(out, output_loading_info=True, **load_kwargs())
    # transformers reports the MTP layer (under its own fused expert names) as unexpected, unused.
    mtp_prefix = f"model.layers.{cfg.num_hidden_layers}."
    assert info["unexpected_keys"] and all(k.startswith(mtp_prefix) for k in info["unexpected_keys"])
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    sd = ref.state_dict()
    for n, t in model.state_dict().items():
        assert torch.equal(sd[n], t), n
    ref.double().eval()
    write_json(os.path.join(out, "reference.json"),
               deepseek_reference(ref, ids, cfg, name, seed,
                                  {"weights_dtype": "float32", "mtp_tensors": sorted(mtp)}))

    if name == "deepseek_v3":
        write_fp8_case(out, out_root, cfg, ids, seed)
    report(out, name)


def write_fp8_case(src, out_root, cfg, ids, seed):
    out = os.path.join(out_root, "deepseek_v3_fp8")
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    stored, dequant = {}, {}
    for n, t in sorted(tensors.items()):
        if is_fp8_weight(n):
            codes, scale = fp8_quantize(t, FP8_BLOCK)
            stored[n] = codes
            stored[n + "_scale_inv"] = scale
            dequant[n] = fp8_dequantize(codes, scale, FP8_BLOCK)
        else:
            stored[n] = t
    save_file(stored, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    save_file(dequant, os.path.join(out, "dequantized.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3",
                                     "quant_method": "fp8", "weight_block_size": FP8_BLOCK}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    # The main model with the dequantized weights, in float64: loaded by from_pretrained from a
    # float32 copy of the checkpoint (which splits the per-expert tensors as for the others).
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(os.path.join(src, "config.json"), tmp)
        save_file({n: dequant.get(n, t) for n, t in tensors.items()},
                  os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        model = DeepseekV3ForCausalLM.from_pretrained(tmp, **load_kwargs()).eval()
    model.double()
    write_json(os.path.join(out, "reference.json"),
               deepseek_reference(model, ids, cfg, "deepseek_v3_fp8", seed,
                                  {"weights_dtype": "float8_e4m3fn with float32 block scales",
                                   "weight_block_size": FP8_BLOCK,
                                   "fp8_tensors": sorted(dequant)}))
    report(out, "deepseek_v3_fp8")


def report(out, name):
    total = 0
    for fname in sorted(os.listdir(out)):
        size = os.path.getsize(os.path.join(out, fname))
        total += size
        print(f"  {name}/{fname:40s} {size:8d} bytes")
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=OUT_DIR)
    ap.add_argument("--cases", nargs="+",
                    choices=[c["name"] for c in CASES] + list(DEEPSEEK_CASES),
                    help="only these cases (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(1)  # one summation order, the same on every machine
    os.makedirs(args.out, exist_ok=True)
    total = sum(write_case(case, args.out) for case in CASES
                if not args.cases or case["name"] in args.cases)
    for name in DEEPSEEK_CASES:
        if not args.cases or name in args.cases:
            write_deepseek_case(name, args.out)
    print(f"total {total} bytes")


if __name__ == "__main__":
    main()
