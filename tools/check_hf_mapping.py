#!/usr/bin/env python3
"""Checks the HF <-> moecore tensor mapping of docs/hf_interop.md on tests/fixtures/hf/.

For each fixture: reads the HF safetensors (single or sharded, F32 or BF16), renames and fuses
them into moecore's tensors by the doc's table (hf_to_moecore), maps those back (moecore_to_hf)
and requires the round trip to give every HF tensor back bit for bit; then runs a float64 forward
written from moecore's semantics on the moecore tensors (fused QKV split per query group, RoPE on
pairs (i, i + D/2), fc1 rows [gate | up], the router modes of MOE_SEMANTICS.md, the shared
expert's sigmoid gate, the layer pattern) and compares its logits, losses and chosen experts with
the reference.json that transformers computed.

numpy only (the safetensors files are parsed here), so it shares no code with transformers; any
Python with numpy (e.g. the venv of tools/make_hf_fixtures.py):

    python3 tools/check_hf_mapping.py [--fixtures tests/fixtures/hf]
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "hf")
CASES = ["mixtral", "qwen2_moe", "qwen3_moe"]
LOGITS_TOL = 1e-4  # float64 here vs float32 in transformers: a few 1e-6 in practice


# ---- safetensors (numpy; BF16 widened exactly) ----

def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        raw = data[b:end]
        if e["dtype"] == "F32":
            a = np.frombuffer(raw, dtype="<f4")
        elif e["dtype"] == "BF16":
            a = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise ValueError(f"{path}: {name} has dtype {e['dtype']}")
        out[name] = a.reshape(e["shape"]).astype(np.float64)
    return out


def read_hf_dir(d):
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    t = {}
    for fname in files:
        part = read_safetensors(os.path.join(d, fname))
        assert not set(part) & set(t), fname
        t.update(part)
    return t


# ---- the config (docs/hf_interop.md, "config.json") ----

def model_shape(cfg):
    arch = cfg["architectures"][0]
    H, Hq = cfg["hidden_size"], cfg["num_attention_heads"]
    Hkv = cfg.get("num_key_value_heads") or Hq
    D = cfg.get("head_dim") or H // Hq
    L = cfg["num_hidden_layers"]
    E = cfg.get("num_local_experts", cfg.get("num_experts", 0))
    if arch == "MixtralForCausalLM":
        moe = [1] * L
    else:
        step = cfg.get("decoder_sparse_step", 1)
        only = cfg.get("mlp_only_layers") or []
        moe = [int(i not in only and E > 0 and (i + 1) % step == 0) for i in range(L)]
    rope = cfg.get("rope_parameters") or {}
    return dict(arch=arch, H=H, Hq=Hq, Hkv=Hkv, D=D, L=L, E=E, K=cfg["num_experts_per_tok"],
                moe=moe, eps=cfg["rms_norm_eps"],
                theta=rope.get("rope_theta", cfg.get("rope_theta")),
                pre_softmax=not cfg.get("norm_topk_prob", arch == "MixtralForCausalLM"),
                tied=cfg.get("tie_word_embeddings", False))


# ---- the tensor table ----

def hf_moe_prefix(s, i):
    return f"model.layers.{i}.block_sparse_moe." if s["arch"] == "MixtralForCausalLM" else \
        f"model.layers.{i}.mlp."


def expert_names(s):
    return ("w1", "w3", "w2") if s["arch"] == "MixtralForCausalLM" else \
        ("gate_proj", "up_proj", "down_proj")


def hf_to_moecore(hf, s):
    hf = dict(hf)
    take = hf.pop  # every HF tensor must be consumed exactly once
    m = {"embedding.word_embeddings.weight": take("model.embed_tokens.weight")}
    qpg = s["Hq"] // s["Hkv"]

    def fuse_qkv(q, k, v):
        tail = q.shape[1:]
        q = q.reshape(s["Hkv"], qpg * s["D"], *tail)
        k = k.reshape(s["Hkv"], s["D"], *tail)
        v = v.reshape(s["Hkv"], s["D"], *tail)
        return np.concatenate([q, k, v], axis=1).reshape(-1, *tail)

    for i in range(s["L"]):
        p, q = f"model.layers.{i}.", f"decoder.layers.{i}."
        a, b = p + "self_attn.", q + "self_attention."
        m[q + "input_layernorm.weight"] = take(p + "input_layernorm.weight")
        m[b + "linear_qkv.weight"] = fuse_qkv(take(a + "q_proj.weight"), take(a + "k_proj.weight"),
                                              take(a + "v_proj.weight"))
        if a + "q_proj.bias" in hf:
            m[b + "linear_qkv.bias"] = fuse_qkv(take(a + "q_proj.bias"), take(a + "k_proj.bias"),
                                                take(a + "v_proj.bias"))
        if a + "q_norm.weight" in hf:
            m[b + "q_layernorm.weight"] = take(a + "q_norm.weight")
            m[b + "k_layernorm.weight"] = take(a + "k_norm.weight")
        m[b + "linear_proj.weight"] = take(a + "o_proj.weight")
        m[q + "pre_mlp_layernorm.weight"] = take(p + "post_attention_layernorm.weight")
        if s["moe"][i]:
            r = hf_moe_prefix(s, i)
            gate, up, down = expert_names(s)
            m[q + "mlp.router.weight"] = take(r + "gate.weight")
            m[q + "mlp.experts.linear_fc1.weight"] = np.stack([
                np.concatenate([take(f"{r}experts.{e}.{gate}.weight"),
                                take(f"{r}experts.{e}.{up}.weight")]) for e in range(s["E"])])
            m[q + "mlp.experts.linear_fc2.weight"] = np.stack(
                [take(f"{r}experts.{e}.{down}.weight") for e in range(s["E"])])
            if r + "shared_expert.gate_proj.weight" in hf:
                m[q + "mlp.shared_experts.linear_fc1.weight"] = np.concatenate(
                    [take(r + "shared_expert.gate_proj.weight"),
                     take(r + "shared_expert.up_proj.weight")])
                m[q + "mlp.shared_experts.linear_fc2.weight"] = take(r + "shared_expert.down_proj.weight")
                m[q + "mlp.shared_experts.gate_weight"] = take(r + "shared_expert_gate.weight")
        else:
            r = p + "mlp."
            m[q + "mlp.linear_fc1.weight"] = np.concatenate([take(r + "gate_proj.weight"),
                                                             take(r + "up_proj.weight")])
            m[q + "mlp.linear_fc2.weight"] = take(r + "down_proj.weight")
    m["decoder.final_layernorm.weight"] = take("model.norm.weight")
    if not s["tied"]:
        m["output_layer.weight"] = take("lm_head.weight")
    assert not hf, f"HF tensors not mapped: {sorted(hf)}"
    return m


def moecore_to_hf(m, s):
    m = dict(m)
    take = m.pop
    hf = {"model.embed_tokens.weight": take("embedding.word_embeddings.weight")}
    qpg = s["Hq"] // s["Hkv"]

    def split_qkv(w):
        tail = w.shape[1:]
        g = w.reshape(s["Hkv"], qpg + 2, s["D"], *tail)
        return (g[:, :qpg].reshape(-1, *tail), g[:, qpg].reshape(-1, *tail),
                g[:, qpg + 1].reshape(-1, *tail))

    for i in range(s["L"]):
        p, q = f"model.layers.{i}.", f"decoder.layers.{i}."
        a, b = p + "self_attn.", q + "self_attention."
        hf[p + "input_layernorm.weight"] = take(q + "input_layernorm.weight")
        for kind in ("weight", "bias"):
            if f"{b}linear_qkv.{kind}" in m:
                (hf[f"{a}q_proj.{kind}"], hf[f"{a}k_proj.{kind}"],
                 hf[f"{a}v_proj.{kind}"]) = split_qkv(take(f"{b}linear_qkv.{kind}"))
        if b + "q_layernorm.weight" in m:
            hf[a + "q_norm.weight"] = take(b + "q_layernorm.weight")
            hf[a + "k_norm.weight"] = take(b + "k_layernorm.weight")
        hf[a + "o_proj.weight"] = take(b + "linear_proj.weight")
        hf[p + "post_attention_layernorm.weight"] = take(q + "pre_mlp_layernorm.weight")
        if s["moe"][i]:
            r = hf_moe_prefix(s, i)
            gate, up, down = expert_names(s)
            hf[r + "gate.weight"] = take(q + "mlp.router.weight")
            fc1, fc2 = take(q + "mlp.experts.linear_fc1.weight"), take(q + "mlp.experts.linear_fc2.weight")
            F = fc1.shape[1] // 2
            for e in range(s["E"]):
                hf[f"{r}experts.{e}.{gate}.weight"] = fc1[e, :F]
                hf[f"{r}experts.{e}.{up}.weight"] = fc1[e, F:]
                hf[f"{r}experts.{e}.{down}.weight"] = fc2[e]
            if q + "mlp.shared_experts.linear_fc1.weight" in m:
                fc1 = take(q + "mlp.shared_experts.linear_fc1.weight")
                F = fc1.shape[0] // 2
                hf[r + "shared_expert.gate_proj.weight"] = fc1[:F]
                hf[r + "shared_expert.up_proj.weight"] = fc1[F:]
                hf[r + "shared_expert.down_proj.weight"] = take(q + "mlp.shared_experts.linear_fc2.weight")
                hf[r + "shared_expert_gate.weight"] = take(q + "mlp.shared_experts.gate_weight")
        else:
            fc1 = take(q + "mlp.linear_fc1.weight")
            F = fc1.shape[0] // 2
            hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"] = fc1[:F], fc1[F:]
            hf[p + "mlp.down_proj.weight"] = take(q + "mlp.linear_fc2.weight")
    hf["model.norm.weight"] = take("decoder.final_layernorm.weight")
    if not s["tied"]:
        hf["lm_head.weight"] = take("output_layer.weight")
    assert not m, f"moecore tensors not mapped: {sorted(m)}"
    return hf


# ---- a float64 forward with moecore's semantics ----

def rmsnorm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, theta):
    """ops/rope.h: x [S, heads, D], pairs (x[i], x[i + D/2]) rotated by p * theta^(-2i/D)."""
    S, _, D = x.shape
    half = D // 2
    angle = np.arange(S)[:, None] * theta ** (-2.0 * np.arange(half) / D)
    c, s = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def swiglu_mlp(x, fc1, fc2, p=None):
    """ops/swiglu.h: h = x fc1^T with rows [gate | up], a = silu(gate) * up (* p), y = a fc2^T."""
    h = x @ fc1.T
    F = fc1.shape[0] // 2
    g, u = h[..., :F], h[..., F:]
    a = g / (1.0 + np.exp(-g)) * u
    if p is not None:
        a = a * p
    return a @ fc2.T


def softmax(x):
    z = np.exp(x - x.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def forward(m, s, ids):
    """Logits [S, V] of one sequence and, per MoE layer, the experts each token chose."""
    S, D, Hq, Hkv = len(ids), s["D"], s["Hq"], s["Hkv"]
    qpg = Hq // Hkv
    x = m["embedding.word_embeddings.weight"][ids]
    routes = {}
    causal = np.tril(np.ones((S, S), dtype=bool))
    for i in range(s["L"]):
        q_, b = f"decoder.layers.{i}.", f"decoder.layers.{i}.self_attention."
        n = rmsnorm(x, m[q_ + "input_layernorm.weight"], s["eps"])
        qkv = n @ m[b + "linear_qkv.weight"].T
        if b + "linear_qkv.bias" in m:
            qkv = qkv + m[b + "linear_qkv.bias"]
        qkv = qkv.reshape(S, Hkv, qpg + 2, D)  # ops/qkv_layout.h: per group, its q heads, k, v
        q, k, v = qkv[:, :, :qpg].reshape(S, Hq, D), qkv[:, :, qpg], qkv[:, :, qpg + 1]
        if b + "q_layernorm.weight" in m:
            q = rmsnorm(q, m[b + "q_layernorm.weight"], s["eps"])
            k = rmsnorm(k, m[b + "k_layernorm.weight"], s["eps"])
        q, k = rope(q, s["theta"]), rope(k, s["theta"])
        core = np.empty((S, Hq, D))
        for h in range(Hq):
            scores = np.where(causal, q[:, h] @ k[:, h // qpg].T / np.sqrt(D), -np.inf)
            core[:, h] = softmax(scores) @ v[:, h // qpg]
        x = x + core.reshape(S, Hq * D) @ m[b + "linear_proj.weight"].T
        n = rmsnorm(x, m[q_ + "pre_mlp_layernorm.weight"], s["eps"])
        if s["moe"][i]:
            logits = n @ m[q_ + "mlp.router.weight"].T
            fc1, fc2 = m[q_ + "mlp.experts.linear_fc1.weight"], m[q_ + "mlp.experts.linear_fc2.weight"]
            y = np.zeros_like(n)
            chosen = []
            for t in range(S):
                idx = np.argsort(-logits[t], kind="stable")[:s["K"]]  # top-k of the logits
                if s["pre_softmax"]:  # softmax over E, not renormalised
                    p = softmax(logits[t])[idx]
                else:  # softmax over the K chosen logits
                    p = softmax(logits[t, idx])
                chosen.append([int(e) for e in idx])
                for e, pe in zip(idx, p):
                    y[t] += swiglu_mlp(n[t], fc1[e], fc2[e], pe)
            if q_ + "mlp.shared_experts.linear_fc1.weight" in m:
                g = 1.0 / (1.0 + np.exp(-(n @ m[q_ + "mlp.shared_experts.gate_weight"].T)))
                y = y + g * swiglu_mlp(n, m[q_ + "mlp.shared_experts.linear_fc1.weight"],
                                       m[q_ + "mlp.shared_experts.linear_fc2.weight"])
            routes[i] = chosen
        else:
            y = swiglu_mlp(n, m[q_ + "mlp.linear_fc1.weight"], m[q_ + "mlp.linear_fc2.weight"])
        x = x + y
    x = rmsnorm(x, m["decoder.final_layernorm.weight"], s["eps"])
    head = m["embedding.word_embeddings.weight"] if s["tied"] else m["output_layer.weight"]
    return x @ head.T, routes


def mean_ce(logits, ids):
    x = logits[:-1]
    lse = x.max(-1) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1))
    return float((lse - x[np.arange(len(ids) - 1), ids[1:]]).mean())


def check_case(d):
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(d, "reference.json")) as f:
        ref = json.load(f)
    s = model_shape(cfg)
    hf = read_hf_dir(d)
    m = hf_to_moecore(hf, s)
    back = moecore_to_hf(m, s)
    assert sorted(back) == sorted(hf), "round trip changed the tensor names"
    for name, t in hf.items():
        assert back[name].shape == t.shape and np.array_equal(back[name], t), name
    assert [i for i in range(s["L"]) if s["moe"][i]] == ref["moe_layers"]
    worst = 0.0
    for seq in ref["sequences"]:
        ids = np.array(seq["input_ids"])
        logits, routes = forward(m, s, ids)
        worst = max(worst, float(np.abs(logits - np.array(seq["logits"])).max()))
        for r in seq["routing"]:
            assert routes[r["layer"]] == r["experts"], (r["layer"], routes[r["layer"]], r["experts"])
        assert abs(mean_ce(logits, ids) - seq["loss"]) < LOGITS_TOL, (mean_ce(logits, ids), seq["loss"])
    assert worst < LOGITS_TOL, worst
    return len(hf), len(m), worst


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fixtures", default=FIXTURES)
    args = ap.parse_args()
    failed = 0
    for case in CASES:
        try:
            n_hf, n_m, worst = check_case(os.path.join(args.fixtures, case))
            print(f"{case}: {n_hf} HF tensors -> {n_m} moecore tensors and back, bitwise; "
                  f"max |logits - transformers| = {worst:.2e}; routing equal")
        except AssertionError as e:
            failed += 1
            print(f"{case}: FAILED {e}")
    print(f"{len(CASES) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
