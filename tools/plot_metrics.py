#!/usr/bin/env python3
"""Draw loss and expert-load curves from a `moecore train --metrics-file` JSON-lines file.

    python3 tools/plot_metrics.py metrics.jsonl -o curves.png [--floor 1.112] [more.jsonl ...]

Needs matplotlib: scripts/setup.sh installs Debian's python3-matplotlib (for /usr/bin/python3);
another Python takes `pip install matplotlib`. Without it the script says so in one line and exits
with status 1. Several files are drawn on the same axes, labelled by file name, so runs can be
compared.
"""
import argparse
import json
import os
import sys

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError as e:  # ModuleNotFoundError too: matplotlib or one of its own dependencies
    sys.exit(f"[plot_metrics] cannot import matplotlib ({e}) in {sys.executable}: run "
             "`bash scripts/setup.sh` (Debian's python3-matplotlib, for /usr/bin/python3) or "
             f"`{sys.executable} -m pip install matplotlib`")


def read(path):
    with open(path) as f:
        # Training rows only: evaluation rows carry valid_/test_ keys instead of lm_loss.
        return [r for r in (json.loads(line) for line in f if line.strip()) if "lm_loss" in r]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics", nargs="+", help="JSON-lines metrics files")
    ap.add_argument("-o", "--output", default="curves.png", help="PNG to write")
    ap.add_argument("--floor", type=float, help="entropy floor to draw (nats/token)")
    args = ap.parse_args()

    fig, (ax_loss, ax_load, ax_aux) = plt.subplots(1, 3, figsize=(15, 4.2))
    for path in args.metrics:
        rows = read(path)
        if not rows:
            continue
        it = [r["iteration"] for r in rows]
        label = os.path.basename(path)
        ax_loss.plot(it, [r["lm_loss"] for r in rows], label=label)
        ax_load.plot(it, [r["max_over_mean_load"] for r in rows], label=label)
        ax_aux.plot(it, [r["aux_loss"] for r in rows], label=label)
    if args.floor is not None:
        ax_loss.axhline(args.floor, color="k", linestyle="--", linewidth=1, label="entropy floor")
    ax_loss.set(title="lm loss", xlabel="iteration", ylabel="nats/token")
    ax_load.axhline(1.0, color="k", linestyle=":", linewidth=1)
    ax_load.set(title="expert load (max / mean)", xlabel="iteration")
    ax_aux.set(title="load_balancing_loss (aux / coeff)", xlabel="iteration")
    for ax in (ax_loss, ax_load, ax_aux):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.output, dpi=100)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
