"""PNG plots of testbed all-reduce results (JSON files written by ``bench allreduce --testbed``).

``plot_results(paths, out_dir)`` groups the rows it finds and draws what they support:

* ``ate_vs_size.png``: ATE/s against tensor size per system, with the line-rate bound B/32 and
  the ring bound (for the most common worker count and rate);
* ``speedup_vs_n.png``: switchml's speedup over gloo against n, beside 2(n-1)/n;
* ``slowdown_vs_loss.png``: ATE/s relative to the loss-free run, per system, against loss rate.
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from typing import Any

__all__ = ["load_rows", "plot_results"]

COLORS = {"switchml": "tab:blue", "gloo": "tab:orange", "ps": "tab:green"}


def load_rows(paths: list[str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for p in paths:
        with open(p) as f:
            rows.extend(json.load(f)["results"])
    return rows


def plot_results(paths: list[str], out_dir: str) -> list[str]:
    """Write the plots the rows support into ``out_dir``; return their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load_rows(paths)
    os.makedirs(out_dir, exist_ok=True)
    written = []

    # 1. ATE/s against size, at the (n, rate) with the most sizes and no loss.
    lossless = [r for r in rows if r["loss_rate"] == 0]
    by_setup: dict[tuple, list] = defaultdict(list)
    for r in lossless:
        by_setup[(r["workers"], r["rate_bps"])].append(r)
    if by_setup:
        (n, rate), group = max(by_setup.items(),
                               key=lambda kv: len({r["size_bytes"] for r in kv[1]}))
        if len({r["size_bytes"] for r in group}) > 1:
            fig, ax = plt.subplots(figsize=(7, 4.5))
            for system in ("switchml", "gloo", "ps"):
                pts = sorted((r["size_bytes"], r["ate_per_s"]) for r in group
                             if r["system"] == system)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=system,
                            color=COLORS[system])
            line = rate / 32
            ax.axhline(line, ls="--", color="k", lw=1, label="line rate B/32")
            ax.axhline(line / (2 * (n - 1) / n), ls=":", color="gray", lw=1,
                       label="ring bound B/32 / (2(n-1)/n)")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tensor size (bytes)")
            ax.set_ylabel("ATE/s per worker")
            ax.set_title(f"all-reduce, n={n}, {rate / 1e6:g} Mbit/s links")
            ax.grid(True, alpha=0.3)
            ax.legend()
            written.append(_save(fig, out_dir, "ate_vs_size.png"))

    # 2. speedup over gloo against n (same rate, largest size, no loss).
    pairs: dict[tuple, dict[str, float]] = defaultdict(dict)
    for r in lossless:
        pairs[(r["rate_bps"], r["size_bytes"], r["workers"])][r["system"]] = r["ate_per_s"]
    series: dict[tuple, list] = defaultdict(list)
    for (rate, size, n), d in pairs.items():
        if "switchml" in d and "gloo" in d:
            series[(rate, size)].append((n, d["switchml"] / d["gloo"]))
    multi = {k: sorted(v) for k, v in series.items() if len(v) > 1}
    if multi:
        fig, ax = plt.subplots(figsize=(6, 4))
        ns = sorted({n for v in multi.values() for n, _ in v})
        ax.plot(ns, [2 * (n - 1) / n for n in ns], "k--", label="2(n-1)/n")
        for (rate, size), pts in multi.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-",
                    label=f"switchml / gloo, {size / 2**20:g} MiB, {rate / 1e6:g} Mbit/s")
        ax.set_xlabel("workers n")
        ax.set_ylabel("speedup over gloo (ATE/s ratio)")
        ax.grid(True, alpha=0.3)
        ax.legend()
        written.append(_save(fig, out_dir, "speedup_vs_n.png"))

    # 3. slowdown against loss (same n, rate, size).
    setups = Counter((r["workers"], r["rate_bps"], r["size_bytes"]) for r in rows
                     if r["loss_rate"] > 0)
    if setups:
        n, rate, size = setups.most_common(1)[0][0]
        group = [r for r in rows if (r["workers"], r["rate_bps"], r["size_bytes"]) ==
                 (n, rate, size)]
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for system in ("switchml", "gloo", "ps"):
            base = [r["ate_per_s"] for r in group if r["system"] == system
                    and r["loss_rate"] == 0]
            pts = sorted((r["loss_rate"], r["ate_per_s"]) for r in group
                         if r["system"] == system and r["loss_rate"] > 0)
            if base and pts:
                ax.plot([p[0] for p in pts], [base[0] / p[1] for p in pts], "o-", label=system,
                        color=COLORS[system])
        ax.set_xscale("log")
        ax.set_xlabel("loss rate on every link")
        ax.set_ylabel("slowdown (loss-free ATE/s / ATE/s)")
        ax.set_title(f"n={n}, {rate / 1e6:g} Mbit/s, {size / 2**20:g} MiB")
        ax.grid(True, alpha=0.3)
        ax.legend()
        written.append(_save(fig, out_dir, "slowdown_vs_loss.png"))
    return written


def _save(fig: Any, out_dir: str, name: str) -> str:
    import matplotlib.pyplot as plt
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
