#!/usr/bin/env python3
"""Reference fixtures for moecore's router, computed by Megatron-Core's own router functions.

Writes tests/fixtures/router/<case>.json; tests/moe/test_router_fixtures.cpp compares the C++
router against them, so CI needs no Python. Regenerate with

    python3 -m venv /tmp/h4venv && /tmp/h4venv/bin/pip install torch megatron-core numpy
    /tmp/h4venv/bin/python tools/make_router_fixtures.py

Generated with megatron-core 0.16.1 and torch 2.x on CPU. Called verbatim from
megatron.core.transformer.moe.moe_utils: topk_routing_with_score_function (softmax,
pre-softmax, sigmoid, group-limited top-k, expert bias, scaling factor), group_limited_topk
(through it), compute_routing_scores_for_aux_loss, switch_load_balancing_loss_func,
z_loss_func, sinkhorn, get_capacity, apply_router_token_dropping (drop policy "probs", with and
without padding).

Re-stated here in PyTorch, because they are TopKRouter methods (whose constructor needs CUDA
and initialised process groups) or absent from megatron-core 0.16.1:
  * TopKRouter._apply_seq_aux_loss / _apply_global_aux_loss: their bodies, calling
    switch_load_balancing_loss_func as Megatron does (one rank: the reduce groups have size 1);
  * TopKRouter.sinkhorn_load_balancing (its body, calling Megatron's sinkhorn());
  * get_updated_expert_bias (one line; Megatron's all_reduces over a process group);
  * the sqrtsoftplus score function (not in 0.16.1): the sigmoid branch of
    topk_routing_with_score_function with s = sqrt(softplus(logits));
  * quantile balancing (not in 0.16.1): MOE_SEMANTICS.md Router 5;
  * drop policy "position": Megatron takes torch.topk of the 0/1 map with sorted=False, whose
    tie order is unspecified; MOE_SEMANTICS.md says "the first `capacity` tokens in token
    order", which is what this script and moecore do.

Where moecore differs from Megatron on purpose (docs/router.md), the fixture records moecore's
choice and says so in its "note": the aux map is the experts the tokens chose (pre-drop) unless
the case sets megatron_aux_map.

Inputs are exact binary fractions (x and W_r multiples of 2^-8, R multiples of 2^-3) so both
sides see identical logits. Megatron rounds softmax/sigmoid to fp32 inside
topk_routing_with_score_function and compute_routing_scores_for_aux_loss even for fp64 logits,
so "expected" carries fp32 precision, and its aux-loss gradients (fp32 sums that cancel) only a
few fp32 ulps of the largest term, whatever the entry's own size. Each case is therefore run a
second time with those fp32 casts widened to fp64 (`widened_to_fp64`: the same Megatron
functions, torch.softmax(..., dtype=float32) and Tensor.float() made fp64 for the duration);
its values are "expected_f64", and its maps must equal the fp32 run's. The C++ test checks
moecore against expected_f64 elementwise with bounds derived per tensor, and against the fp32
"expected" within a few fp32 ulps of each tensor's largest value (docs/numerics.md, "Megatron
router fixtures"). The aux and z losses' part of the logit gradient (R = 0) is recorded on its
own as "dlogits_lb", so that its small entries are compared at their own scale.
Cases are redrawn until every top-k boundary has a margin far above fp32 rounding.
"""

import contextlib
import json
import math
import os
import sys

import numpy as np
import torch

from megatron.core.transformer.moe import moe_utils as mu

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures",
                       "router")
MARGIN = 1e-5  # minimum gap at any top-k boundary (fp32 rounding is ~1e-7)


# Significant digits written: 10 for the fp32 run (beyond fp32 precision, small files), 17 (every
# fp64 bit) for the widened run.
DIGITS = 10


def r10(v):
    """Rounds to DIGITS significant digits."""
    return [float(f"{x:.{DIGITS}g}") for x in np.asarray(v, dtype=np.float64).reshape(-1)]


def scalar(v):
    return float(f"{v.item():.{max(DIGITS, 12)}g}")


def ints(v):
    return [int(x) for x in np.asarray(v).reshape(-1)]


class Redraw(Exception):
    pass


@contextlib.contextmanager
def widened_to_fp64():
    """Megatron's fp32 casts (softmax dtype=float32, Tensor.float()) become fp64 inside."""
    softmax, tensor_float = torch.softmax, torch.Tensor.float

    def softmax64(x, dim=None, dtype=None, **kw):
        return softmax(x, dim=dim, dtype=torch.float64 if dtype == torch.float32 else dtype, **kw)

    torch.softmax = softmax64
    torch.Tensor.float = lambda self, *a, **kw: self.double()
    try:
        yield
    finally:
        torch.softmax, torch.Tensor.float = softmax, tensor_float


def check_margin(values, k, what):
    """Top-k of each row must not sit on a near-tie."""
    if k >= values.shape[1]:
        return
    s = torch.sort(values.double(), dim=1, descending=True).values
    finite = torch.isfinite(s[:, k])
    gap = (s[:, k - 1] - s[:, k])[finite]
    if gap.numel() and gap.min().item() < MARGIN:
        raise Redraw(what)


def sinkhorn_load_balancing(logits, topk, training):
    """Body of TopKRouter.sinkhorn_load_balancing (re-stated: it is a method)."""

    def _sinkhorn_activation(logits):
        if topk == 1:
            logits = torch.sigmoid(logits)
        else:  # k > 1
            logits = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
        return logits

    if training:
        with torch.no_grad():
            norm_logits = mu.sinkhorn(logits.float())
            check_margin(norm_logits, topk, "sinkhorn")
            _, indices = torch.topk(norm_logits, k=topk, dim=1)
        logits = _sinkhorn_activation(logits)
    else:
        logits = _sinkhorn_activation(logits)
        check_margin(logits.detach(), topk, "sinkhorn eval")
        _, indices = torch.topk(logits, k=topk, dim=1)
    map = torch.zeros_like(logits).int().scatter(1, indices, 1).bool()
    scores = logits * map
    return scores, map


def sqrtsoftplus_routing(logits, topk, num_groups, group_topk, scaling_factor, expert_bias):
    """The sigmoid branch of topk_routing_with_score_function with s = sqrt(softplus(l))."""
    num_tokens, num_experts = logits.shape
    scores = torch.nn.functional.softplus(logits.float()).sqrt().type_as(logits)

    def compute_topk(s):
        if group_topk:
            return mu.group_limited_topk(s, topk, num_tokens, num_experts, num_groups, group_topk)
        return torch.topk(s, k=topk, dim=1)

    if expert_bias is not None:
        _, top_indices = compute_topk(scores + expert_bias)
        scores = torch.gather(scores, dim=1, index=top_indices).type_as(logits)
    else:
        scores, top_indices = compute_topk(scores)
    probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    if scaling_factor:
        probs = probs * scaling_factor
    routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
    routing_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
    return routing_probs, routing_map


def quantile_routing(logits, topk, beta, score_function, pre_softmax, scaling_factor):
    """MOE_SEMANTICS Router 5: idx = top-k of (l - beta); probs from the score function."""
    num_tokens, num_experts = logits.shape
    key = logits.detach() - beta
    check_margin(key, topk, "quantile top-k")
    vals, idx = torch.topk(key, k=topk + 1, dim=1)
    alpha = vals[:, topk]
    top_indices = idx[:, :topk]
    if score_function == "softmax" and not pre_softmax:
        probs = torch.softmax(torch.gather(logits, 1, top_indices), dim=-1)
    elif score_function == "softmax":
        probs = torch.gather(torch.softmax(logits, dim=-1), 1, top_indices)
    else:
        s = torch.sigmoid(logits) if score_function == "sigmoid" else \
            torch.nn.functional.softplus(logits).sqrt()
        s = torch.gather(s, 1, top_indices)
        probs = s / (s.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else s
    if scaling_factor:
        probs = probs * scaling_factor
    routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
    routing_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
    # The per-micro-batch beta estimate: the (T K / E + 1)-th largest of column e of l - alpha.
    c = num_tokens * topk // num_experts
    col = logits.detach() - alpha[:, None]
    beta_local = torch.sort(col, dim=0, descending=True).values[c]
    return routing_probs, routing_map, beta_local


def position_dropping(routing_probs, routing_map, topk, capacity_factor, pad):
    """Drop policy 'position': each expert keeps its first `capacity` tokens in token order."""
    num_tokens, num_experts = routing_probs.shape
    cap = mu.get_capacity(num_tokens * topk, num_experts, capacity_factor)
    keep = (torch.cumsum(routing_map.int(), dim=0) <= cap) & routing_map
    return routing_probs * keep, keep


def aux_scores_and_map(logits, topk, score_function):
    if score_function == "sqrtsoftplus":  # re-stated like the sigmoid branch
        scores = torch.nn.functional.softplus(logits).sqrt()
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        _, top = torch.topk(scores, k=topk, dim=1)
        return torch.zeros_like(logits).int().scatter(1, top, 1).bool(), scores
    return mu.compute_routing_scores_for_aux_loss(logits, topk, score_function)


def route(case, logits, training, beta):
    """probs [T, E] after dropping, routed map (pre-drop), kept map (post-drop), beta_local."""
    E, K = case["E"], case["K"]
    lbt = [t for t, _ in case["load_balancing"]]
    bias = torch.tensor(case["expert_bias"], dtype=torch.float32) \
        if case["expert_bias"] is not None else None
    beta_local = None
    score = case["score"]
    if "sinkhorn" in lbt:
        probs, routed = sinkhorn_load_balancing(logits, K, training)
    elif "quantile_balancing" in lbt:
        probs, routed, beta_local = quantile_routing(logits, K, beta, score, case["pre_softmax"],
                                                     case["scaling"])
    else:
        # Margins on the key the top-k sees.
        with torch.no_grad():
            if score == "softmax":
                key = torch.softmax(logits, -1) if case["pre_softmax"] else logits
            elif score == "sigmoid":
                key = torch.sigmoid(logits)
            else:
                key = torch.nn.functional.softplus(logits).sqrt()
            if bias is not None:
                key = key + bias.double()
            if case["group_topk"]:
                G, g = case["num_groups"], case["group_topk"]
                gs = key.view(key.shape[0], G, -1).topk(K // g, dim=-1)[0].sum(-1)
                check_margin(gs, g, "group scores")
                keep = torch.zeros_like(gs).scatter(1, gs.topk(g, dim=-1)[1], 1).bool()
                key = key.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
            check_margin(key, K, "top-k")
        groups = (case["num_groups"] or None, case["group_topk"] or None)
        if score == "sqrtsoftplus":
            probs, routed = sqrtsoftplus_routing(logits, K, groups[0], groups[1], case["scaling"],
                                                 bias)
        else:
            probs, routed = mu.topk_routing_with_score_function(
                logits, K, use_pre_softmax=case["pre_softmax"], num_groups=groups[0],
                group_topk=groups[1], scaling_factor=case["scaling"], score_function=score,
                expert_bias=bias)
    kept = routed
    if case["capacity_factor"] > 0:
        if case["drop_policy"] == "probs":
            # Ties among the kept probs would make the choice arbitrary.
            cap = mu.get_capacity(logits.shape[0] * K, E, case["capacity_factor"])
            for e in range(E):
                col = probs.detach()[:, e][routed[:, e]]
                if col.numel() > cap:
                    check_margin(col[None, :], cap, "capacity")
            probs, final_map = mu.apply_router_token_dropping(
                probs, routed, K, case["capacity_factor"], "probs", case["pad"])
        else:
            probs, final_map = position_dropping(probs, routed, K, case["capacity_factor"],
                                                 case["pad"])
        kept = final_map & routed  # with padding Megatron's map also marks the pad slots
    return probs, routed, kept, beta_local


def aux_values(case, logits, routed, prev_counts, n_micro):
    """Coefficient-free value of each listed aux type (the logged aux / coeff)."""
    E, K, B = case["E"], case["K"], case["B"]
    T = logits.shape[0]
    S = T // B
    megatron_map, scores = aux_scores_and_map(logits, K, case["score"])
    if case["megatron_aux_map"]:
        check_margin(scores.detach(), K, "aux map")
        amap = megatron_map
    else:
        amap = routed  # moecore: the map the tokens really took (docs/router.md, #2767)
    out = {}
    for t, _ in case["load_balancing"]:
        if t == "aux_loss":  # TopKRouter._apply_aux_loss, one rank
            out[t] = mu.switch_load_balancing_loss_func(scores, amap.sum(dim=0), T, K, E, 1.0)
        elif t == "seq_aux_loss":  # TopKRouter._apply_seq_aux_loss body
            sc = scores.reshape(S, -1)
            tpe = amap.reshape(S, -1).sum(dim=0)
            out[t] = mu.switch_load_balancing_loss_func(sc, tpe, S, K, E, 1.0) / B
        elif t == "global_aux_loss":  # TopKRouter._apply_global_aux_loss body
            total = prev_counts + amap.sum(dim=0)
            avg = total / n_micro
            out[t] = mu.switch_load_balancing_loss_func(scores, avg, T, K, E, 1.0)
    return out, amap.sum(dim=0)


def make_case(name, seed, E, K, T, H=4, B=1, score="softmax", pre_softmax=False, scaling=None,
              num_groups=0, group_topk=0, expert_bias=None, capacity_factor=0.0,
              drop_policy="probs", pad=False, load_balancing=(("aux_loss", 0.0),), z_coeff=0.0,
              megatron_aux_map=False, micro_batches=1, training=True, beta=None, ema=0.0,
              bias_rate=1e-3, note=""):
    case = dict(name=name, E=E, K=K, T=T, H=H, B=B, score=score, pre_softmax=pre_softmax,
                scaling=scaling, num_groups=num_groups, group_topk=group_topk,
                expert_bias=expert_bias, capacity_factor=capacity_factor,
                drop_policy=drop_policy, pad=pad, load_balancing=[list(t) for t in load_balancing],
                z_coeff=z_coeff, megatron_aux_map=megatron_aux_map, training=training,
                quantile_beta=beta, quantile_ema=ema, bias_update_rate=bias_rate, note=note)
    for attempt in range(200):
        g = torch.Generator().manual_seed(seed * 1000 + attempt)
        try:
            out = fill(case, g, micro_batches)
        except Redraw as why:
            last = str(why)
            continue
        # The same draw with Megatron's fp32 casts widened: same maps, fp64 values.
        global DIGITS
        DIGITS = 17
        try:
            with widened_to_fp64():
                wide = fill(case, torch.Generator().manual_seed(seed * 1000 + attempt),
                            micro_batches)
        finally:
            DIGITS = 10
        ex, wx = out["expected"], wide["expected"]
        for key in ("routed_TE", "kept_TE", "tokens_per_expert", "capacity", "dropped"):
            if ex[key] != wx[key]:
                raise RuntimeError(f"{name}: {key} differs between the fp32 and fp64 runs")
        out["expected_f64"] = {k: wx[k] for k in ("logits", "probs_TE", "aux", "z", "dlogits",
                                                  "dlogits_lb", "dx", "dW", "beta_after")
                               if k in wx}
        return out
    raise RuntimeError(f"{name}: no draw with top-k margins ({last})")


def fill(case, g, micro_batches):
    E, K, T, H = case["E"], case["K"], case["T"], case["H"]
    W = torch.randint(-256, 257, (E, H), generator=g).double() / 256
    xs = [torch.randint(-256, 257, (T, H), generator=g).double() / 256 for _ in range(micro_batches)]
    if case["capacity_factor"] > 0:
        # Skew the load towards expert 0 so that capacity really drops.
        W[0, 0] = 1.0
        for x in xs:
            x[:, 0] = x[:, 0].abs()
    R = torch.randint(-8, 9, (T, E), generator=g).double() / 8
    # beta is an fp32 buffer (MOE_SEMANTICS Router 5), like the expert bias: the starting
    # values are its fp32 roundings; the update is computed in fp64.
    beta = torch.tensor(case["quantile_beta"], dtype=torch.float32).double() \
        if case["quantile_beta"] is not None else None
    prev_counts = torch.zeros(E, dtype=torch.float64)
    bias_counts = torch.zeros(E, dtype=torch.float64)
    beta_sum = torch.zeros(E, dtype=torch.float64)
    for m, x in enumerate(xs):
        last = m == len(xs) - 1
        x = x.clone().requires_grad_(last)
        Wg = W.clone().requires_grad_(last)
        logits = x @ Wg.t()
        if last:
            logits.retain_grad()
        probs, routed, kept, beta_local = route(case, logits, case["training"], beta)
        vals, counts = aux_values(case, logits, routed, prev_counts, m + 1)
        prev_counts = prev_counts + counts
        bias_counts += kept.sum(dim=0)
        if beta_local is not None:
            beta_sum += beta_local
    lb = torch.zeros((), dtype=torch.float64)
    for t, c in case["load_balancing"]:
        if t in vals and c > 0:
            lb = lb + c * vals[t]
    z = mu.z_loss_func(logits, 1.0)
    if case["z_coeff"] > 0:
        lb = lb + case["z_coeff"] * z
    loss = (probs * R).sum() + lb
    loss.backward(retain_graph=True)
    dlogits = logits.grad.clone()
    # The aux and z losses' part of the logit gradient alone (R = 0); after the full backward,
    # because autograd.grad also feeds logits' retained .grad.
    dlogits_lb = torch.autograd.grad(lb, logits, allow_unused=True)[0] \
        if lb.requires_grad else None
    if dlogits_lb is None:
        dlogits_lb = torch.zeros_like(logits)

    cap = mu.get_capacity(T * K, E, case["capacity_factor"]) if case["capacity_factor"] > 0 else 0
    exp = dict(
        logits=r10(logits.detach()), probs_TE=r10(probs.detach()),
        routed_TE=ints(routed.int()), kept_TE=ints(kept.int()),
        tokens_per_expert=ints(kept.sum(dim=0)), capacity=int(cap),
        dropped=int(routed.sum().item() - kept.sum().item()),
        aux={t: scalar(v) for t, v in vals.items()}, z=scalar(z), dlogits=r10(dlogits), dlogits_lb=r10(dlogits_lb),
        dx=r10(x.grad), dW=r10(Wg.grad))
    if case["expert_bias"] is not None:
        # get_updated_expert_bias, one rank: bias + sign(mean(c) - c) * rate (in fp32).
        b = torch.tensor(case["expert_bias"], dtype=torch.float32)
        c32 = bias_counts.float()
        off = c32.sum() / E - c32
        exp["bias_after"] = [float(v) for v in (b + torch.sign(off) * case["bias_update_rate"])]
    if beta is not None and case["training"]:
        avg = beta_sum / len(xs)
        nb = case["quantile_ema"] * beta + (1 - case["quantile_ema"]) * avg
        exp["beta_after"] = r10(nb - nb.mean())
    case = dict(case)
    case.update(W=r10(W), x=[r10(x) for x in xs], R=r10(R), expected=exp)
    return case


def cases():
    aux, seq, glob = "aux_loss", "seq_aux_loss", "global_aux_loss"
    bias8 = [0.05, -0.03, 0.0, 0.02, -0.06, 0.01, 0.04, -0.02]
    bias16 = [((i * 7) % 11 - 5) / 100 for i in range(16)]
    yield make_case("softmax_e8_k2", 1, 8, 2, 12, load_balancing=[(aux, 0.01)])
    yield make_case("softmax_topk_all", 2, 4, 4, 7, load_balancing=[(aux, 0.1)], z_coeff=0.01)
    yield make_case("softmax_e6_k3_aux_z", 3, 6, 3, 13, load_balancing=[(aux, 0.05)], z_coeff=0.02)
    yield make_case("pre_softmax_top1", 4, 5, 1, 11, pre_softmax=True,
                    load_balancing=[(aux, 0.1)], z_coeff=0.01)
    yield make_case("pre_softmax_scaled", 5, 8, 2, 9, pre_softmax=True, scaling=2.5)
    yield make_case("sigmoid_k3_scaled", 6, 8, 3, 10, score="sigmoid", scaling=2.5,
                    load_balancing=[(aux, 0.1)], z_coeff=0.01)
    yield make_case("sigmoid_top1", 7, 4, 1, 9, score="sigmoid", load_balancing=[(aux, 0.1)])
    yield make_case("sqrtsoftplus_k2", 8, 8, 2, 10, score="sqrtsoftplus",
                    load_balancing=[(aux, 0.05)], z_coeff=0.01,
                    note="sqrtsoftplus re-stated (not in megatron-core 0.16.1)")
    yield make_case("sqrtsoftplus_bias", 9, 8, 2, 10, score="sqrtsoftplus", expert_bias=bias8,
                    load_balancing=[("none", 0.0)],
                    note="sqrtsoftplus re-stated (not in megatron-core 0.16.1)")
    yield make_case("sigmoid_bias_aux", 10, 8, 2, 12, score="sigmoid", expert_bias=bias8,
                    load_balancing=[(aux, 0.01)], micro_batches=2,
                    note="aux map = the experts tokens chose (moecore, #2767)")
    yield make_case("sigmoid_bias_aux_megatron_map", 10, 8, 2, 12, score="sigmoid",
                    expert_bias=bias8, load_balancing=[(aux, 0.01)], megatron_aux_map=True)
    yield make_case("group_softmax_e8_g4", 12, 8, 2, 10, num_groups=4, group_topk=2,
                    load_balancing=[(aux, 0.01)])
    yield make_case("deepseek_v3_like", 13, 16, 4, 12, B=2, score="sigmoid", scaling=2.5,
                    num_groups=4, group_topk=2, expert_bias=bias16,
                    load_balancing=[(seq, 0.001)],
                    note="aux map = the experts tokens chose (moecore, #2767)")
    yield make_case("deepseek_v3_like_megatron_map", 13, 16, 4, 12, B=2, score="sigmoid",
                    scaling=2.5, num_groups=4, group_topk=2, expert_bias=bias16,
                    load_balancing=[(seq, 0.001)], megatron_aux_map=True)
    yield make_case("group_pre_softmax_e12_g3", 15, 12, 2, 8, pre_softmax=True, num_groups=3,
                    group_topk=1, load_balancing=[(aux, 0.02)])
    yield make_case("seq_aux_b3", 16, 6, 2, 15, B=3, load_balancing=[(seq, 0.01)])
    yield make_case("global_aux_two_micro", 17, 8, 2, 10, load_balancing=[(glob, 0.01)],
                    micro_batches=2)
    yield make_case("three_losses_two_micro", 18, 8, 2, 12, B=2,
                    load_balancing=[(aux, 0.01), (seq, 0.001), (glob, 0.002)], z_coeff=0.001,
                    micro_batches=2)
    yield make_case("sinkhorn_top1", 20, 6, 1, 12, load_balancing=[("sinkhorn", 0.0)],
                    note="sinkhorn_load_balancing re-stated (TopKRouter method)")
    yield make_case("sinkhorn_k2", 21, 8, 2, 16, load_balancing=[("sinkhorn", 0.0)],
                    note="sinkhorn_load_balancing re-stated (TopKRouter method)")
    yield make_case("sinkhorn_k2_eval", 22, 8, 2, 16, load_balancing=[("sinkhorn", 0.0)],
                    training=False)
    yield make_case("capacity_probs", 23, 4, 2, 10, capacity_factor=1.0,
                    load_balancing=[(aux, 0.01)])
    yield make_case("capacity_position", 23, 4, 2, 10, capacity_factor=1.0, drop_policy="position",
                    load_balancing=[(aux, 0.01)], note="position policy re-stated")
    yield make_case("capacity_probs_pad", 25, 4, 2, 10, capacity_factor=1.25, pad=True)
    yield make_case("capacity_position_pad", 26, 5, 2, 9, capacity_factor=0.5,
                    drop_policy="position", pad=True, note="position policy re-stated")
    yield make_case("capacity_sigmoid_scaled", 27, 6, 3, 11, score="sigmoid", scaling=2.0,
                    capacity_factor=0.8, load_balancing=[(aux, 0.05)], z_coeff=0.01)
    yield make_case("capacity_bias_counts_after_drop", 28, 8, 2, 12, score="sigmoid",
                    expert_bias=bias8, capacity_factor=1.0, load_balancing=[("none", 0.0)])
    yield make_case("quantile_softmax", 29, 8, 2, 12, load_balancing=[("quantile_balancing", 0.0)],
                    beta=[0.1, -0.05, 0.0, 0.2, -0.1, 0.05, -0.15, -0.05], ema=0.5,
                    micro_batches=2, note="quantile balancing re-stated from MOE_SEMANTICS")
    yield make_case("quantile_sigmoid_top1", 30, 4, 1, 8, score="sigmoid",
                    load_balancing=[("quantile_balancing", 0.0)], beta=[0.0, 0.1, -0.2, 0.1],
                    note="quantile balancing re-stated from MOE_SEMANTICS")
    yield make_case("quantile_eval", 31, 8, 2, 12, load_balancing=[("quantile_balancing", 0.0)],
                    beta=[0.1, -0.05, 0.0, 0.2, -0.1, 0.05, -0.15, -0.05], training=False)
    yield make_case("z_only", 32, 5, 2, 7, load_balancing=[("none", 0.0)], z_coeff=0.1)


def main():
    os.makedirs(OUT_DIR, exist_ok=True)
    for f in os.listdir(OUT_DIR):
        if f.endswith(".json"):
            os.remove(os.path.join(OUT_DIR, f))
    total = 0
    for case in cases():
        path = os.path.join(OUT_DIR, case["name"] + ".json")
        with open(path, "w") as f:
            json.dump(case, f, separators=(",", ":"))
            f.write("\n")
        total += os.path.getsize(path)
        print(f"{case['name']:34s} {os.path.getsize(path):7d} bytes")
    print(f"total {total} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
