#!/usr/bin/env python3
"""bench-small (bench/small.toml) in PyTorch, for side-by-side runs with `moecore train`.

    pip install torch
    OMP_NUM_THREADS=2 python3 tools/bench_small_torch.py [--bf16] [--dense] [--iters 10] [--device cuda]

The same model and step as bench/small.toml: vocab 8192, hidden 512, 4 layers, 8 query heads of
dim 64, 2 KV heads, RoPE 10000, RMSNorm 1e-6, 16 experts top-2 (softmax over the top-k logits),
expert and shared-expert SwiGLU width 512, aux loss 0.01, untied head, seq 256, micro-batch 8,
AdamW (0.9, 0.95) wd 0.1 lr 3e-4, fp32 (or bf16 autocast with --bf16). --dense swaps each MoE for
a dense SwiGLU of width 1536 (bench/dense.toml). Experts run as a loop over experts on gathered
rows, the usual eager-PyTorch MoE. Prints tokens/s and GFLOP/s with moecore's FLOPs formula
(docs/flags.md): 6 x active matmul params + 3 x attention forward FLOPs, per token.
"""
import argparse
import math
import time

import torch
import torch.nn.functional as F

V, H, L, HQ, HKV, D, S, B = 8192, 512, 4, 8, 2, 64, 256, 8
E, K, FE, FS, FD = 16, 2, 512, 512, 1536


class RMSNorm(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w


def rope(x, cos, sin):  # x [B, heads, S, D], Megatron's rotate_half form
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * cos + torch.cat((-x2, x1), -1) * sin


class SwiGLU(torch.nn.Module):
    def __init__(self, f):
        super().__init__()
        self.fc1 = torch.nn.Linear(H, 2 * f, bias=False)
        self.fc2 = torch.nn.Linear(f, H, bias=False)

    def forward(self, x):
        g, u = self.fc1(x).chunk(2, -1)
        return self.fc2(F.silu(g) * u)


class MoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(H, E, bias=False)
        self.experts = torch.nn.ModuleList(SwiGLU(FE) for _ in range(E))
        self.shared = SwiGLU(FS)

    def forward(self, x):
        t = x.reshape(-1, H)
        logits = self.router(t).float()
        top_v, top_i = logits.topk(K, -1)
        probs = top_v.softmax(-1)
        # Switch aux loss over the map the tokens took.
        scores = logits.softmax(-1)
        counts = torch.zeros(E, device=t.device).index_add_(
            0, top_i.reshape(-1), torch.ones(top_i.numel(), device=t.device))
        aux = 0.01 * E / (K * t.shape[0] ** 2) * (scores.sum(0) * counts).sum()
        y = torch.zeros_like(t)
        for e in range(E):
            rows, slot = (top_i == e).nonzero(as_tuple=True)
            if rows.numel():
                y.index_add_(0, rows, self.experts[e](t[rows]) * probs[rows, slot, None].to(t.dtype))
        return (y + self.shared(t)).reshape(x.shape), aux


class Block(torch.nn.Module):
    def __init__(self, dense):
        super().__init__()
        self.n1, self.n2 = RMSNorm(H), RMSNorm(H)
        self.qkv = torch.nn.Linear(H, (HQ + 2 * HKV) * D, bias=False)
        self.proj = torch.nn.Linear(HQ * D, H, bias=False)
        self.ffn = SwiGLU(FD) if dense else MoE()
        self.dense = dense

    def forward(self, x, cos, sin):
        h = self.n1(x)
        q, k, v = self.qkv(h).split([HQ * D, HKV * D, HKV * D], -1)
        q = rope(q.view(B, S, HQ, D).transpose(1, 2), cos, sin)
        k = rope(k.view(B, S, HKV, D).transpose(1, 2), cos, sin)
        v = v.view(B, S, HKV, D).transpose(1, 2)
        k = k.repeat_interleave(HQ // HKV, 1)
        v = v.repeat_interleave(HQ // HKV, 1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, S, HQ * D))
        if self.dense:
            return x + self.ffn(self.n2(x)), 0.0
        y, aux = self.ffn(self.n2(x))
        return x + y, aux


class Model(torch.nn.Module):
    def __init__(self, dense):
        super().__init__()
        self.emb = torch.nn.Embedding(V, H)
        self.blocks = torch.nn.ModuleList(Block(dense) for _ in range(L))
        self.norm = RMSNorm(H)
        self.head = torch.nn.Linear(H, V, bias=False)
        inv = 10000.0 ** (-torch.arange(0, D, 2).float() / D)
        ang = torch.arange(S).float()[:, None] * inv[None]
        self.register_buffer("cos", torch.cat((ang.cos(), ang.cos()), -1))
        self.register_buffer("sin", torch.cat((ang.sin(), ang.sin()), -1))

    def forward(self, ids, targets):
        x = self.emb(ids)
        aux = 0.0
        for b in self.blocks:
            x, a = b(x, self.cos, self.sin)
            aux = aux + a
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, V), targets.view(-1)) + aux


def flops_per_token(dense):
    per_layer = H * (HQ + 2 * HKV) * D + HQ * D * H
    per_layer += 3 * H * FD if dense else H * E + K * 3 * H * FE + 3 * H * FS
    return 6 * (L * per_layer + H * V) + 3 * L * 2 * HQ * D * (S + 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--dense", action="store_true")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (scripts/gpu_check.sh)")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device(args.device)
    model = Model(args.dense).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    ids = torch.randint(0, V, (B, S)).to(dev)
    targets = torch.randint(0, V, (B, S)).to(dev)
    times = []
    for it in range(args.iters):
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.bf16):
            loss = model(ids, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    steady = times[2:] if len(times) > 4 else times
    step = sum(steady) / len(steady)
    tps = B * S / step
    print(f"[torch {torch.__version__} {dev.type} threads={torch.get_num_threads()} "
          f"{'bf16' if args.bf16 else 'fp32'} {'dense' if args.dense else 'moe'}] "
          f"{tps:.0f} tokens/s | {flops_per_token(args.dense) * tps / 1e9:.1f} GFLOP/s | "
          f"step {step * 1e3:.1f} ms | loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
