"""``switchml bench geo``'s outputs (``bench.geo``): JSON, CSV, accuracy against time, and
Gaia's trade-off of WAN bytes against accuracy."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any

from switchml.bench.geo import GeoBenchConfig, gaia_label

__all__ = ["write_outputs"]


def write_outputs(rows: list[dict[str, Any]], cfg: GeoBenchConfig, out_dir: str) -> list[str]:
    """JSON, CSV, ``geo.png`` (accuracy against time) and ``loss.png`` (held-out loss against
    step, every seed) in ``out_dir``, and with Gaia at several thresholds ``tradeoff.png``
    (final accuracy against WAN bytes); returns the paths."""
    import csv
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, n) for n in ("geo.json", "geo.csv", "geo.png")]
    with open(paths[0], "w") as f:
        json.dump({"benchmark": "geo", "config": asdict(cfg), "machine": {
            "cpus": os.cpu_count(), "uname": " ".join(os.uname())}, "results": rows}, f,
            indent=2)
    keys = ["mode", "threshold", "decay", "dcs", "wan_bps", "wan_rtt_s", "steps", "elapsed_s",
            "time_to_target_s", "final_accuracy", "last_accuracy", "final_loss", "wan_bytes",
            "fraction_entries_sent", "delay_line_cpu_s", "delay_line_packets",
            "delay_line_lost"]
    with open(paths[1], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(keys + ["time_to_target_vs_lan", "speedup_vs_wan", "wan_bytes_vs_wan"])
        for r in rows:
            c = r.get("comparison", {})
            w.writerow([r.get(k) for k in keys] + [c.get("time_to_target_vs_lan"),
                                               c.get("speedup_vs_wan"),
                                               c.get("wan_bytes_vs_wan")])
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = {"lan": "one data centre (LAN)", "wan": "synchronous across the WAN",
              "gaia": "Gaia", "diloco": f"DiLoCo (H = {cfg.inner_steps}, {cfg.outer_bits}-bit)",
              "torchft": f"torchft's DiLoCo (H = {cfg.inner_steps}, 32-bit)"}
    for r in rows:
        name = labels[r["mode"]] if r["mode"] != "gaia" else _row_label(r)
        ax.plot(r["times"], r["accuracy"], label=f"{name}: "
                f"{r['wan_bytes'] / 1e6:.1f} MB over the WAN")
    ax.axhline(cfg.target_accuracy, color="grey", ls="--", lw=0.8, label="target")
    ax.set_xlabel("seconds of training")
    ax.set_ylabel("held-out accuracy (data centre 0)")
    ax.set_title(f"{cfg.model}, data centres {cfg.dcs}, WAN {cfg.wan_bps / 1e6:g} Mbit/s + "
                 f"{cfg.wan_rtt_s * 1000:g} ms, LAN {cfg.lan_bps / 1e9:g} Gbit/s")
    ax.set_ylim(0.5 if cfg.model == "mf" else 0, 1)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(paths[2], dpi=100)
    plt.close(fig)
    paths.append(_plot_loss(rows, cfg, labels, os.path.join(out_dir, "loss.png")))
    if sum(r["mode"] == "gaia" for r in rows) > 1:
        paths.append(_plot_tradeoff(rows, cfg, os.path.join(out_dir, "tradeoff.png")))
    return paths


def _plot_loss(rows: list[dict[str, Any]], cfg: GeoBenchConfig, labels: dict[str, str],
               path: str) -> str:
    """Held-out loss against step: a line per seed, one colour per row (log scale: a run
    that diverged stays on the plot)."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, r in enumerate(rows):
        name = labels[r["mode"]] if r["mode"] != "gaia" else _row_label(r)
        runs = [x for x in r.get("runs", [r]) if "loss" in x and "eval_steps" in x]
        for i, run in enumerate(runs):
            ax.plot(run["eval_steps"], run["loss"], color=f"C{k}", lw=1, alpha=0.8,
                    ls=("-", "--", ":", "-.")[i % 4],
                    label=f"{name} ({len(runs)} seed(s))" if i == 0 else None)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss (data centre 0)")
    ax.set_title(f"{cfg.model}, data centres {cfg.dcs}: held-out loss, every seed")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _row_label(r: dict[str, Any]) -> str:
    """A Gaia row's name, with its threshold."""
    return f"Gaia {gaia_label(r.get('threshold', 0), bool(r.get('decay')))}"


def _plot_tradeoff(rows: list[dict[str, Any]], cfg: GeoBenchConfig, path: str) -> str:
    """Final accuracy, and time to target, against WAN bytes: Gaia at each threshold a line,
    the other modes across the WAN points. A point far below Gaia's and synchronous training's
    accuracies (a run that diverged) is drawn at the bottom edge with its value."""
    import matplotlib.pyplot as plt
    fig, (acc_ax, time_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    gaia = sorted((r for r in rows if r["mode"] == "gaia"), key=lambda r: r["wan_bytes"])
    others = [r for r in rows if r["mode"] in ("wan", "diloco", "torchft")]
    names = {"wan": "synchronous", "diloco": f"DiLoCo (H = {cfg.inner_steps})",
             "torchft": f"torchft's DiLoCo (H = {cfg.inner_steps})"}
    decay = "/sqrt(t)" if cfg.decay else ""
    scale = [100 * r["final_accuracy"] for r in gaia + [r for r in others if r["mode"] == "wan"]]
    low, high = min(scale) - 1.0, max(scale) + 1.0
    mb = [r["wan_bytes"] / 1e6 for r in gaia]
    acc_ax.plot(mb, [100 * r["final_accuracy"] for r in gaia], "o-",
                label=f"Gaia, threshold S{decay}")
    times = [(r["wan_bytes"] / 1e6, r["time_to_target_s"]) for r in gaia
             if r["time_to_target_s"] is not None]
    if times:
        time_ax.plot(*zip(*times), "o-", label=f"Gaia, threshold S{decay}")
    for k, r in enumerate(gaia):
        offset = (-10, 8 + 10 * (k % 3)) if k % 2 == 0 else (-10, -14 - 10 * (k % 3))
        acc_ax.annotate(f"S={r.get('threshold', 0):g}", (mb[k], 100 * r["final_accuracy"]),
                        textcoords="offset points", xytext=offset, fontsize=8)
    for r in others:
        x, acc = r["wan_bytes"] / 1e6, 100 * r["final_accuracy"]
        if acc < low:
            acc_ax.plot([x], [low + 0.1], "v", label=f"{names[r['mode']]}: {acc:.1f}% "
                        "(off the scale)")
        else:
            acc_ax.plot([x], [acc], "s", label=names[r["mode"]])
        if r["time_to_target_s"] is not None:
            time_ax.plot([x], [r["time_to_target_s"]], "s", label=names[r["mode"]])
    acc_ax.set_ylim(low, high)
    acc_ax.set_ylabel("final held-out accuracy (%)")
    time_ax.set_ylabel(f"seconds to {100 * cfg.target_accuracy:g}% (runs that reached it)")
    from matplotlib.ticker import NullFormatter
    for ax in (acc_ax, time_ax):
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("WAN bytes (MB, log scale)")
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(loc="best", fontsize=8)
    fig.suptitle(f"{cfg.model}: the significance threshold trades accuracy and time for WAN "
                 f"bytes (WAN {cfg.wan_bps / 1e6:g} Mbit/s, mean of {cfg.seeds} seed(s))",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
