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

__all__ = ["load_rows", "loss_slowdowns", "plot_results"]

COLORS = {"switchml": "tab:blue", "gloo": "tab:orange", "ps": "tab:green"}


def load_rows(paths: list[str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for p in paths:
        with open(p) as f:
            rows.extend(json.load(f)["results"])
    return rows


def loss_slowdowns(rows: list[dict[str, Any]]
                   ) -> tuple[tuple, dict[str, list[tuple[float, float]]]] | None:
    """The most common lossy setup ``(n, rate, size, mtu)`` and, per system, ``(loss,
    loss-free ATE/s / ATE/s)`` against the loss-free run of that same setup (None without
    lossy rows). The MTU is part of the setup: a 9000-byte run is no baseline for 1500."""
    def setup(r: dict[str, Any]) -> tuple:
        return r["workers"], r["rate_bps"], r["size_bytes"], r.get("mtu")

    setups = Counter(setup(r) for r in rows if r["loss_rate"] > 0)
    if not setups:
        return None
    key = setups.most_common(1)[0][0]
    group = [r for r in rows if setup(r) == key]
    series = {}
    for system in ("switchml", "gloo", "ps"):
        base = [r["ate_per_s"] for r in group if r["system"] == system and r["loss_rate"] == 0]
        pts = sorted((r["loss_rate"], r["ate_per_s"]) for r in group
                     if r["system"] == system and r["loss_rate"] > 0)
        if base and pts:
            series[system] = [(loss, base[0] / ate) for loss, ate in pts]
    return key, series


def plot_results(paths: list[str], out_dir: str) -> list[str]:
    """Write the plots the rows support into ``out_dir``; return their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load_rows(paths)
    os.makedirs(out_dir, exist_ok=True)
    lossless = [r for r in rows if r["loss_rate"] == 0]
    written = [_plot_ate_vs_size(plt, lossless, out_dir), _plot_speedup(plt, lossless, out_dir),
               _plot_slowdown(plt, rows, out_dir)]
    return [p for p in written if p is not None]


def _plot_ate_vs_size(plt: Any, lossless: list[dict[str, Any]], out_dir: str) -> str | None:
    """ATE/s against size, at the (n, rate) with the most sizes and no loss."""
    by_setup: dict[tuple, list] = defaultdict(list)
    for r in lossless:
        by_setup[(r["workers"], r["rate_bps"])].append(r)
    if not by_setup:
        return None
    (n, rate), group = max(by_setup.items(), key=lambda kv: len({r["size_bytes"] for r in kv[1]}))
    if len({r["size_bytes"] for r in group}) <= 1:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    mtus = sorted({r.get("mtu") for r in group}, key=lambda m: m or 0)
    styles = ["o-", "s--", "^:", "d-."]
    for system in ("switchml", "gloo", "ps"):
        for k, mtu in enumerate(mtus):  # one line per MTU: never mix them in one
            pts = sorted((r["size_bytes"], r["ate_per_s"]) for r in group
                         if r["system"] == system and r.get("mtu") == mtu)
            if pts:
                label = system if len(mtus) == 1 else f"{system}, MTU {mtu}"
                ax.plot([p[0] for p in pts], [p[1] for p in pts],
                        styles[k % len(styles)], label=label, color=COLORS[system])
    line = rate / 32
    ax.axhline(line, ls="--", color="k", lw=1, label="line rate B/32")
    ax.axhline(line / (2 * (n - 1) / n), ls=":", color="gray", lw=1,
               label="ring bound B/32 / (2(n-1)/n)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tensor size (bytes)")
    ax.set_ylabel("ATE/s per worker")
    ax.set_title(f"all-reduce, n={n}, {rate / 1e6:g} Mbit/s links")
    return _save(fig, out_dir, "ate_vs_size.png", ax)


def _plot_speedup(plt: Any, lossless: list[dict[str, Any]], out_dir: str) -> str | None:
    """switchml's speedup over gloo against n (same rate, largest size, no loss)."""
    pairs: dict[tuple, dict[str, float]] = defaultdict(dict)
    for r in lossless:
        pairs[(r["rate_bps"], r["size_bytes"], r["workers"])][r["system"]] = r["ate_per_s"]
    series: dict[tuple, list] = defaultdict(list)
    for (rate, size, n), d in pairs.items():
        if "switchml" in d and "gloo" in d:
            series[(rate, size)].append((n, d["switchml"] / d["gloo"]))
    multi = {k: sorted(v) for k, v in series.items() if len(v) > 1}
    if not multi:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    ns = sorted({n for v in multi.values() for n, _ in v})
    ax.plot(ns, [2 * (n - 1) / n for n in ns], "k--", label="2(n-1)/n")
    for (rate, size), pts in multi.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-",
                label=f"switchml / gloo, {size / 2**20:g} MiB, {rate / 1e6:g} Mbit/s")
    ax.set_xlabel("workers n")
    ax.set_ylabel("speedup over gloo (ATE/s ratio)")
    return _save(fig, out_dir, "speedup_vs_n.png", ax)


def _plot_slowdown(plt: Any, rows: list[dict[str, Any]], out_dir: str) -> str | None:
    """Slowdown against loss (same n, rate, size and MTU)."""
    loss = loss_slowdowns(rows)
    if loss is None:
        return None
    (n, rate, size, mtu), series = loss
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for system, pts in series.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=system,
                color=COLORS[system])
    ax.set_xscale("log")
    ax.set_xlabel("loss rate on every link")
    ax.set_ylabel("slowdown (loss-free ATE/s / ATE/s)")
    ax.set_title(f"n={n}, {rate / 1e6:g} Mbit/s, {size / 2**20:g} MiB"
                 + (f", MTU {mtu}" if mtu else ""))
    return _save(fig, out_dir, "slowdown_vs_loss.png", ax)


def _save(fig: Any, out_dir: str, name: str, ax: Any) -> str:
    """Grid and legend on ``ax``, then write ``fig`` as ``out_dir/name`` and close it."""
    import matplotlib.pyplot as plt
    ax.grid(True, alpha=0.3)
    ax.legend()
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
