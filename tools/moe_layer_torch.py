#!/usr/bin/env python3
"""The MoE layer of bench/moe_layer_bench.cpp in PyTorch, forward + backward, for side-by-side runs
(scripts/gpu_check.sh stage 4; bench/README.md):

    python3 tools/moe_layer_torch.py [--device cuda] [--preset mixtral,deepseek] [--forms fast,eager]
        [--iters 10] [--warmup 3] [--fp32] [--peak-size 8192] [--model bench/moe_1b.toml]

The layer (Megatron's MoE perf-test shapes, 4096 tokens; src/plan/moe_layer_kernels.cpp):
router (a linear of H to E; softmax over the top-k logits, or sigmoid scores with the expert bias
and group-limited selection, probs normalised over the K), aux loss (coefficient 1; DeepSeek:
seq_aux_loss of the one sequence, which is the same), SwiGLU experts, the combine as a sum of the K
rows times their probs, a shared SwiGLU expert where the shape has one. Parameters and activations
in bf16 (Megatron's perf test: the layer .to(bfloat16)), the router's scores in f32. Two forms:

  fast   as torchtitan builds its MoE (torchtitan/models/moe/moe.py): a stable argsort of the
         expert ids, the rows gathered once, each expert's rows padded to a multiple of 16 (its
         indices_padding_wrapper), torch._grouped_mm for w1, w3 and w2 with device offsets (no
         host sync), scatter-add back;
  eager  a loop over experts on the gathered rows of each (nonzero, index_add_: a host sync per
         expert), the usual eager-PyTorch MoE (tools/bench_small_torch.py).

Each prints the line bench_moe_layer prints, with TFLOP/s against the bf16 GEMM peak measured
first in the same run (torch.matmul on n x n x n, the best of 5 batches):
  [gemm-peak] torch 2.11.0 cuda bf16 8192x8192x8192: 760.123 TFLOP/s (torch.matmul, best of 5 batches)
  [moe-layer] torch-fast cuda bf16 mixtral T=4096 H=4096 F=14336 E=8 K=2 Fs=0: fwd ... | bwd ... |
      fwd+bwd ... ms | ... TFLOP/s | ...% of ... TFLOP/s peak (measured)
A form that cannot run prints `[moe-layer] torch-fast ... NOT RUN: why`.

--model CONFIG: instead, the training step of the config's model (bench/moe_1b.toml: the keys
read are the architecture, seq-length, micro-batch-size) in the fast form (torch._grouped_mm,
scaled_dot_product_attention with GQA, fp32 master weights, bf16 compute, fused AdamW), tokens/s
and MFU against the measured peak with moecore's FLOPs formula (docs/flags.md):
  [step] torch-fast cuda bf16 moe_1b: 4096 tokens/step | step 90.1 ms | 45460 tokens/s | MFU 38.5% of ...
"""
import argparse
import math
import os
import re
import sys
import time

import torch
import torch.nn.functional as F

PRESETS = {  # src/plan/moe_layer_kernels.cpp, moe_bench_preset
    "mixtral": dict(T=4096, H=4096, F=14336, E=8, K=2, Fs=0, sigmoid=False, groups=0, gtopk=0),
    "deepseek": dict(T=4096, H=7168, F=2048, E=32, K=8, Fs=2048, sigmoid=True, groups=8, gtopk=4),
    "small": dict(T=256, H=128, F=256, E=8, K=2, Fs=0, sigmoid=False, groups=0, gtopk=0),
    "small-deepseek": dict(T=256, H=128, F=64, E=32, K=8, Fs=64, sigmoid=True, groups=8, gtopk=4),
}
ALIGN = 16  # rows per expert group for torch._grouped_mm (torchtitan pads to 8 / 16 / 32)


def shape_text(name, s):
    return f"{name} T={s['T']} H={s['H']} F={s['F']} E={s['E']} K={s['K']} Fs={s['Fs']}"


def layer_flops(s):  # 3 x forward: router, routed experts, shared expert (plan::moe_layer_model_flops)
    T, H, F_, E, K, Fs = s["T"], s["H"], s["F"], s["E"], s["K"], s["Fs"]
    return 3 * (2 * T * H * E + 2 * T * K * H * 3 * F_ + 2 * T * H * 3 * Fs)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def measure_peak(dev, dtype, n):
    """The best of 5 batches of torch.matmul(a, b), each ~50 ms, in TFLOP/s."""
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    torch.matmul(a, b)
    sync(dev)
    t0 = time.perf_counter()
    torch.matmul(a, b)
    sync(dev)
    one = max(time.perf_counter() - t0, 1e-6)
    reps = max(3, int(0.05 / one))
    best = 1e30
    for _ in range(5):
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b)
        sync(dev)
        best = min(best, (time.perf_counter() - t0) / reps)
    del a, b
    return 2 * n ** 3 / best / 1e12


class MoELayer(torch.nn.Module):
    def __init__(self, s, form, dtype, dev):
        super().__init__()
        H, F_, E, Fs = s["H"], s["F"], s["E"], s["Fs"]
        self.s, self.form = s, form

        def param(*shape, std=0.02):
            return torch.nn.Parameter(torch.randn(*shape, device=dev, dtype=dtype) * std)
        self.router = param(E, H)
        self.w1, self.w3, self.w2 = param(E, F_, H), param(E, F_, H), param(E, H, F_)
        self.register_buffer("expert_bias", torch.zeros(E, device=dev, dtype=torch.float32))
        if Fs:
            self.s1, self.s3, self.s2 = param(Fs, H), param(Fs, H), param(H, Fs)

    def weights(self):
        names = ["router", "w1", "w3", "w2"] + (["s1", "s3", "s2"] if self.s["Fs"] else [])
        return {n: getattr(self, n) for n in names}

    def route(self, x, w):
        """top-k expert ids [T, K], their probs [T, K] (f32) and the aux loss."""
        s = self.s
        T, E, K = x.shape[0], s["E"], s["K"]
        logits = F.linear(x, w["router"]).float()
        if not s["sigmoid"]:  # Megatron's default: top-k of the logits, softmax over the K
            top_v, top_i = logits.topk(K, -1)
            probs = top_v.softmax(-1)
            aux_scores = logits.softmax(-1)
        else:  # sigmoid scores; the expert bias and the group limit choose, the scores weigh
            scores = logits.sigmoid()
            key = scores.detach() + self.expert_bias
            if s["groups"]:
                g = key.view(T, s["groups"], E // s["groups"])
                group_score = g.topk(2, -1).values.sum(-1)  # DeepSeek-V3: sum of the top 2
                keep = group_score.topk(s["gtopk"], -1).indices
                mask = torch.zeros_like(group_score).scatter_(1, keep, 1.0)
                key = key.masked_fill(mask.repeat_interleave(E // s["groups"], 1) == 0, float("-inf"))
            top_i = key.topk(K, -1).indices
            top_v = scores.gather(1, top_i)
            probs = top_v / (top_v.sum(-1, keepdim=True) + 1e-20)
            aux_scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
        counts = torch.bincount(top_i.reshape(-1), minlength=E).float()
        aux = E / (K * T * T) * (aux_scores.sum(0) * counts).sum()  # coefficient 1
        return top_i, probs, aux

    def experts_fast(self, x, top_i, probs, w):
        s = self.s
        T, H, E, K = x.shape[0], s["H"], s["E"], s["K"]
        N = T * K
        ids = top_i.reshape(-1)
        order = torch.argsort(ids, stable=True)
        token = order // K
        counts = torch.bincount(ids, minlength=E)
        padded = (counts + ALIGN - 1) // ALIGN * ALIGN
        ends_pad = torch.cumsum(padded, 0)
        starts = torch.cumsum(counts, 0) - counts
        sorted_e = ids[order]
        dest = (ends_pad - padded)[sorted_e] + torch.arange(N, device=x.device) - starts[sorted_e]
        rows = N + E * ALIGN  # a static bound: no host sync
        x_pad = x.new_zeros(rows, H).index_copy(0, dest, x[token])
        offs = ends_pad.to(torch.int32)
        h = F.silu(torch._grouped_mm(x_pad, w["w1"].transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(x_pad, w["w3"].transpose(-2, -1), offs=offs)
        out = torch._grouped_mm(h, w["w2"].transpose(-2, -1), offs=offs)[dest]
        out = (out.float() * probs.reshape(-1)[order, None]).to(x.dtype)
        return x.new_zeros(T, H).index_add(0, token, out)

    def experts_eager(self, x, top_i, probs, w):
        y = torch.zeros_like(x)
        for e in range(self.s["E"]):
            rows, slot = (top_i == e).nonzero(as_tuple=True)
            if rows.numel():
                xe = x[rows]
                h = F.silu(F.linear(xe, w["w1"][e])) * F.linear(xe, w["w3"][e])
                out = F.linear(h, w["w2"][e]) * probs[rows, slot, None].to(x.dtype)
                y.index_add_(0, rows, out)
        return y

    def forward(self, x, w=None):
        """w: the weights to compute with (default the parameters; the model step passes their
        bf16 copies)."""
        w = w if w is not None else self.weights()
        top_i, probs, aux = self.route(x, w)
        if self.form == "fast":
            y = self.experts_fast(x, top_i, probs, w)
        else:
            y = self.experts_eager(x, top_i, probs, w)
        if self.s["Fs"]:
            y = y + F.linear(F.silu(F.linear(x, w["s1"])) * F.linear(x, w["s3"]), w["s2"])
        return y, aux


def bench_layer(name, s, form, dev, dtype, iters, warmup, peak, dname):
    tag = f"[moe-layer] torch-{form} {dev.type} {dname} {shape_text(name, s)}:"
    try:
        torch.manual_seed(0)
        layer = MoELayer(s, form, dtype, dev)
        x = torch.randn(s["T"], s["H"], device=dev, dtype=dtype, requires_grad=True)
        dy = torch.randn(s["T"], s["H"], device=dev, dtype=dtype)
        fwd, bwd = [], []
        for it in range(warmup + iters):
            x.grad = None
            layer.zero_grad(set_to_none=True)
            sync(dev)
            t0 = time.perf_counter()
            y, aux = layer(x)
            sync(dev)
            t1 = time.perf_counter()
            torch.autograd.backward([y, aux], [dy, torch.ones_like(aux)])
            sync(dev)
            t2 = time.perf_counter()
            if it >= warmup:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
        med = lambda v: sorted(v)[len(v) // 2]
        both = med([f + b for f, b in zip(fwd, bwd)])
        tflops = layer_flops(s) / both / 1e12
        print(f"{tag} fwd {med(fwd) * 1e3:.3f} ms | bwd {med(bwd) * 1e3:.3f} ms | fwd+bwd "
              f"{both * 1e3:.3f} ms | {tflops:.3f} TFLOP/s | {100 * tflops / peak:.1f}% of "
              f"{peak:.1f} TFLOP/s peak (measured)", flush=True)
    except Exception as e:  # e.g. torch._grouped_mm refused here: the other forms go on
        msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        print(f"{tag} NOT RUN: {type(e).__name__}: {msg}", flush=True)
    finally:
        layer = x = dy = None
        if dev.type == "cuda":
            torch.cuda.empty_cache()


# --model: the training step of a TOML config's model (the keys moecore train reads).
def read_config(path):
    cfg = {}
    for line in open(path):
        line = line.split("#", 1)[0].strip()
        m = re.match(r'^([A-Za-z0-9_-]+)\s*=\s*(.+)$', line)
        if m:
            v = m.group(2).strip().strip('"')
            cfg[m.group(1).replace("_", "-")] = {"true": True, "false": False}.get(v, v)
    return cfg


class Block(torch.nn.Module):
    def __init__(self, c, dev):
        super().__init__()
        H, D, HQ, HKV = c["H"], c["D"], c["HQ"], c["HKV"]
        def p(*shape, std=0.02):
            return torch.nn.Parameter(torch.randn(*shape, device=dev) * std)
        self.n1, self.n2 = torch.nn.Parameter(torch.ones(H, device=dev)), torch.nn.Parameter(torch.ones(H, device=dev))
        self.qkv, self.proj = p((HQ + 2 * HKV) * D, H), p(H, HQ * D)
        s = dict(T=c["T"], H=H, F=c["F"], E=c["E"], K=c["K"], Fs=c["Fs"], sigmoid=False, groups=0, gtopk=0)
        self.moe = MoELayer(s, "fast", torch.float32, dev)
        self.c = c

    def forward(self, x, cos, sin):
        c = self.c
        B, S, H, D, HQ, HKV = c["B"], c["S"], c["H"], c["D"], c["HQ"], c["HKV"]
        h = F.rms_norm(x, (H,), self.n1.bfloat16(), 1e-6)
        q, k, v = F.linear(h, self.qkv.bfloat16()).split([HQ * D, HKV * D, HKV * D], -1)
        rot = lambda t: t * cos + torch.cat((-t[..., D // 2:], t[..., : D // 2]), -1) * sin
        q = rot(q.view(B, S, HQ, D).transpose(1, 2))
        k = rot(k.view(B, S, HKV, D).transpose(1, 2))
        v = v.view(B, S, HKV, D).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + F.linear(a.transpose(1, 2).reshape(B, S, HQ * D), self.proj.bfloat16())
        h = F.rms_norm(x, (H,), self.n2.bfloat16(), 1e-6).reshape(B * S, H)
        # bf16 compute copies of the f32 master weights, as torchtitan's mixed precision casts.
        y, aux = self.moe(h, {n: w.bfloat16() for n, w in self.moe.weights().items()})
        return x + y.view(B, S, H), aux


def bench_model(path, dev, iters, warmup, peak, overrides=()):
    cfg = read_config(path)
    for kv in overrides:
        k, v = kv.split("=", 1)
        cfg[k.replace("_", "-")] = v
    name = os.path.splitext(os.path.basename(path))[0]
    H = int(cfg["hidden-size"]); HQ = int(cfg["num-attention-heads"])
    c = dict(H=H, HQ=HQ, D=int(cfg.get("kv-channels", H // HQ)),
             HKV=int(cfg.get("num-query-groups", HQ)) if cfg.get("group-query-attention") else HQ,
             S=int(cfg["seq-length"]), B=int(cfg.get("micro-batch-size", 1)), L=int(cfg["num-layers"]),
             V=int(cfg.get("vocab-size", 256)), E=int(cfg["num-experts"]), K=int(cfg["moe-router-topk"]),
             F=int(cfg["moe-ffn-hidden-size"]), Fs=int(cfg.get("moe-shared-expert-intermediate-size", 0)))
    c["T"] = c["B"] * c["S"]
    tag = f"[step] torch-fast {dev.type} bf16 {name}:"
    try:
        torch.manual_seed(0)
        emb = torch.nn.Parameter(torch.randn(c["V"], H, device=dev) * 0.02)
        head = torch.nn.Parameter(torch.randn(c["V"], H, device=dev) * 0.02)
        norm = torch.nn.Parameter(torch.ones(H, device=dev))
        blocks = torch.nn.ModuleList(Block(c, dev) for _ in range(c["L"]))
        params = [emb, head, norm] + list(blocks.parameters())
        opt = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                fused=dev.type == "cuda")
        D = c["D"]
        inv = 10000.0 ** (-torch.arange(0, D, 2, device=dev).float() / D)
        ang = torch.arange(c["S"], device=dev).float()[:, None] * inv[None]
        cos = torch.cat((ang.cos(), ang.cos()), -1).bfloat16()
        sin = torch.cat((ang.sin(), ang.sin()), -1).bfloat16()
        ids = torch.randint(0, c["V"], (c["B"], c["S"]), device=dev)
        tgt = torch.randint(0, c["V"], (c["B"], c["S"]), device=dev)
        coeff = float(cfg.get("moe-aux-loss-coeff", 0.0))
        times = []
        for it in range(warmup + iters):
            sync(dev)
            t0 = time.perf_counter()
            x = F.embedding(ids, emb).bfloat16()
            aux_sum = 0.0
            for b in blocks:
                x, aux = b(x, cos, sin)
                aux_sum = aux_sum + aux
            logits = F.linear(F.rms_norm(x, (H,), norm.bfloat16(), 1e-6), head.bfloat16()).float()
            loss = F.cross_entropy(logits.view(-1, c["V"]), tgt.view(-1)) + coeff * aux_sum
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sync(dev)
            if it >= warmup:
                times.append(time.perf_counter() - t0)
        step = sorted(times)[len(times) // 2]
        tps = c["T"] / step
        # moecore's FLOPs per token (docs/flags.md): 6 x active matmul params + 3 x attention fwd.
        L = c["L"]
        active = L * (H * (HQ + 2 * c["HKV"]) * D + HQ * D * H + H * c["E"] + c["K"] * 3 * H * c["F"]
                      + 3 * H * c["Fs"]) + H * c["V"]
        flops = 6 * active + 3 * L * 2 * HQ * D * (c["S"] + 1)
        mfu = flops * tps / 1e12 / peak
        print(f"{tag} {c['T']} tokens/step | step {step * 1e3:.1f} ms | {tps:.0f} tokens/s | "
              f"{flops * tps / 1e12:.1f} TFLOP/s | MFU {100 * mfu:.1f}% of {peak:.1f} TFLOP/s peak "
              f"(measured) | loss {loss.item():.4f} | max mem "
              f"{torch.cuda.max_memory_allocated() / 2**30 if dev.type == 'cuda' else 0:.1f} GiB",
              flush=True)
    except Exception as e:
        msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        print(f"{tag} NOT RUN: {type(e).__name__}: {msg}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="mixtral,deepseek", help="comma-separated: " + ", ".join(PRESETS))
    ap.add_argument("--forms", default="fast,eager")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--fp32", action="store_true", help="f32 instead of bf16 (the CPU's test)")
    ap.add_argument("--peak-size", type=int, default=0, help="0: 8192 on cuda, 256 on the CPU")
    ap.add_argument("--peak-tflops", type=float, default=0, help="given: not measured")
    ap.add_argument("--model", default="", help="a TOML config: its training step instead")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="with --model: override a config key (the GPU check's dry run shrinks it)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    dtype = torch.float32 if args.fp32 else torch.bfloat16
    dname = "fp32" if args.fp32 else "bf16"
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "the CPU"
    print(f"# torch {torch.__version__} on {where}", flush=True)
    peak = args.peak_tflops
    if peak <= 0:
        n = args.peak_size or (8192 if dev.type == "cuda" else 256)
        peak = measure_peak(dev, dtype, n)
        print(f"[gemm-peak] torch {torch.__version__} {dev.type} {dname} {n}x{n}x{n}: {peak:.3f} "
              f"TFLOP/s (torch.matmul, best of 5 batches)", flush=True)
    if args.model:
        return bench_model(args.model, dev, args.iters, args.warmup, peak, args.set)
    for name in args.preset.split(","):
        for form in args.forms.split(","):
            bench_layer(name, PRESETS[name], form, dev, dtype, args.iters, args.warmup, peak, dname)


if __name__ == "__main__":
    main()
