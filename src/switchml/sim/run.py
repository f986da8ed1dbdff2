"""Sweeps, tables, JSON and plots for ``switchml sim``, and the comparison with testbed runs.

``switchml sim`` builds one :class:`~switchml.sim.config.SimConfig` per combination of
``--workers`` and ``--loss`` and runs each in timing or exact mode; this module does
everything after argparse.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from switchml.protocol.errors import ConfigError
from switchml.sim.config import LinkFailure, SimConfig, SimLink
from switchml.sim.exact import run_exact
from switchml.sim.report import SimReport
from switchml.sim.timing import run_timing

__all__ = ["compare_with_testbed", "format_table", "parse_failure", "plot_reports",
           "run_config", "write_json"]


def parse_failure(text: str) -> LinkFailure:
    """``worker:3@0.05`` (worker 3's link fails at t = 0.05 s) or ``rack:1@0.1``."""
    kind, sep, rest = text.partition(":")
    index, sep2, at = rest.partition("@")
    if not sep or not sep2 or not index.isdigit():
        raise ConfigError(f"expected KIND:INDEX@SECONDS (e.g. worker:3@0.05), got {text!r}")
    try:
        at_s = float(at)
    except ValueError as exc:
        raise ConfigError(f"bad failure time in {text!r}: {at!r}") from exc
    return LinkFailure(kind, int(index), at_s)


def run_config(config: SimConfig, mode: str, *, verbose: bool = True) -> SimReport:
    """Run one configuration in ``mode`` (``timing`` or ``exact``), with progress on stderr."""
    if mode not in ("timing", "exact"):
        raise ConfigError(f"mode must be 'timing' or 'exact', got {mode!r}")
    label = (f"n={config.workers} racks={config.racks} size={config.size_bytes} "
             f"loss={config.access.loss_rate:g}")

    def progress(fraction: float, t: float) -> None:
        if verbose:
            print(f"  [{mode} {label}] {fraction:6.1%} of results, virtual t={t:.4f} s",
                  file=sys.stderr, flush=True)

    run = run_timing if mode == "timing" else run_exact
    return run(config, progress=progress)


def format_table(reports: Iterable[SimReport]) -> str:
    """A plain-text table: one row per run."""
    head = (f"{'mode':6} {'n':>5} {'racks':>5} {'size':>10} {'loss':>7} {'ATE/s':>10} "
            f"{'of B/32':>7} {'ring bound':>10} {'up util':>7} {'retx':>7} {'rack retx':>9} "
            f"{'q drops':>7} {'elapsed s':>10} {'wall s':>7}  status")
    lines = [head, "-" * len(head)]
    for r in reports:
        c = r.config
        util = r.links[0].utilisation(r.elapsed_s)["mean"] if r.links else 0.0
        drops = sum(s.queue_drops for s in r.links)
        status = "ok" if r.ok else f"FAILED: {r.error}"
        if r.ok and r.mode == "exact":
            status += f" (max |error| {r.max_abs_error:.2e}, {r.results_checked} ranks checked)"
        lines.append(
            f"{r.mode:6} {c.workers:5d} {c.racks:5d} {c.size_bytes:10d} "
            f"{c.access.loss_rate:7.4f} {r.ate_per_s:10.3e} {r.fraction_of_line_rate:7.1%} "
            f"{c.ring_bound_ate:10.3e} {util:7.1%} {r.retransmissions:7d} "
            f"{r.rack_retransmissions:9d} {drops:7d} {r.elapsed_s:10.4f} {r.wall_s:7.1f}  "
            f"{status}")
    return "\n".join(lines)


def write_json(path: str, reports: list[SimReport], *, command: str = "",
               extra: dict[str, Any] | None = None) -> None:
    doc = {"benchmark": "sim", "command": command, "machine": {
        "python": platform.python_version(), "uname": " ".join(platform.uname()[:3])},
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "results": [r.as_dict() for r in reports], **(extra or {})}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def plot_reports(path: str, rows: list[dict[str, Any]]) -> list[str]:
    """Draw ATE/s against n (with B/32 and the ring bound) when the rows vary n, and against
    loss when they vary loss; one PNG per view (``path`` with ``-vs-n``/``-vs-loss`` inserted
    when both exist). Returns the files written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["ok"]]
    ns = sorted({r["workers"] for r in ok})
    losses = sorted({r["loss_rate"] for r in ok})
    views = []
    if len(ns) > 1:
        views.append("n")
    if len(losses) > 1:
        views.append("loss")
    if not views:
        views = ["n"]
    written = []
    for view in views:
        out = path if len(views) == 1 else path.replace(".png", f"-vs-{view}.png")
        fig, ax = plt.subplots(figsize=(7, 4.5))
        if view == "n":
            for loss in losses:
                pts = sorted((r["workers"], r["ate_per_s"]) for r in ok
                             if r["loss_rate"] == loss)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-",
                        label=f"switchml, simulated (loss {loss:g})")
            rate = ok[0]["rate_bps"] if ok else 1e9
            xs = [n for n in ns]
            ax.plot(xs, [rate / 32] * len(xs), "k--", label="in-network bound B/32")
            ax.plot(xs, [rate / 32 / (2 * (n - 1) / n) if n > 1 else rate / 32 for n in xs],
                    "k:", label="ring bound B/32 / (2(n-1)/n)")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("workers n")
        else:
            for n in ns:
                pts = sorted((r["loss_rate"], r["ate_per_s"]) for r in ok if r["workers"] == n)
                ax.plot([max(p[0], 1e-5) for p in pts], [p[1] for p in pts], "o-",
                        label=f"switchml, simulated, n={n}")
            rate = ok[0]["rate_bps"] if ok else 1e9
            ax.axhline(rate / 32, color="k", linestyle="--", label="in-network bound B/32")
            ax.set_xscale("log")
            ax.set_xlabel("loss rate per link (0 drawn at 1e-5)")
        ax.set_ylabel("ATE/s per worker")
        ax.set_ylim(bottom=0)
        first = ok[0] if ok else {}
        ax.set_title(f"switchml sim: {first.get('size_bytes', 0) / 2**20:g} MiB, "
                     f"{first.get('rate_bps', 0) / 1e6:g} Mbit/s, MTU {first.get('mtu', '')}",
                     fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out, dpi=120)
        plt.close(fig)
        written.append(out)
    return written


def compare_with_testbed(paths: list[str], base: SimConfig, mode: str,
                         run: Callable[[SimConfig, str], SimReport] | None = None,
                         gloo_costs: Any = None, cores: int | None = None
                         ) -> list[dict[str, Any]]:
    """Set every loss-free row of testbed JSON files (``bench allreduce --testbed``) against
    a prediction with the same n, rate, MTU and size: switchml's rows (32 bits) simulated
    (other settings from ``base``), and with ``gloo_costs`` (``costs.Costs``) gloo's by the
    ring model ``switchml predict`` charges (``predict.gloo_allreduce_s``: the wire or a
    rank's CPU, with the emulated links' cost where calibrated, the ranks sharing ``cores``).
    Returns ``{system, testbed row, predicted ATE/s, ratio}`` rows (switchml's also with the
    simulator's report); with ``gloo_costs``, also ``cores_needed`` (the CPU the model's
    processes spend at the predicted rate) and ``cpu_shared`` (switchml's rows: more than
    ``cores``, which the testbed's processes shared and the simulator does not see). A
    row's wire width is its ``bits`` (``bench allreduce --testbed``) or ``wire_bits``
    (through torch); a row with neither (files before either was written) counts as 32
    bits. A switchml row is simulated at its ``threads`` (else ``base``'s).

    Raises:
        ConfigError: a file that is not a ``bench allreduce`` JSON, a loopback run, or no
            row to compare in all the files."""
    run = run or (lambda cfg, m: run_config(cfg, m, verbose=False))
    out = []
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        rows = doc.get("results") if isinstance(doc, dict) else None
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ConfigError(f"{p} is not a `switchml bench allreduce --testbed --json` file: "
                              "it has no list of results")
        if doc.get("benchmark") == "allreduce":
            raise ConfigError(
                f"{p} is a loopback run (`switchml bench allreduce` without --testbed), which "
                "the model does not predict: there every worker and the switch share this "
                "machine's cores, their CPU per element grows with how many share them, and "
                "they wait on each other's wake-ups with cores idle (docs/benchmarks.md §6, "
                "'Loopback rows'); compare a --testbed run")
        for row in rows:
            system = row.get("system")
            if row.get("loss_rate", 0) or "rate_bps" not in row or not (
                    (system == "switchml"
                     and row.get("bits", row.get("wire_bits", 32)) == 32)
                    or (system == "gloo" and gloo_costs is not None)):
                continue
            mtu = row.get("mtu") or 1500
            entry: dict[str, Any] = {"file": p, "system": system, "workers": row["workers"],
                                     "rate_bps": row["rate_bps"], "mtu": mtu,
                                     "size_bytes": row["size_bytes"],
                                     "testbed_ate_per_s": row["ate_per_s"]}
            if system == "switchml":
                rep = run(replace(base, workers=row["workers"], size_bytes=row["size_bytes"],
                                  mtu=mtu, access=replace(base.access, rate_bps=row["rate_bps"]),
                                  threads=row.get("threads", base.threads)), mode)
                entry["predicted_ate_per_s"] = entry["sim_ate_per_s"] = rep.ate_per_s
                entry["sim"] = rep.as_dict()
            else:
                from switchml.predict import Resources, gloo_allreduce_s
                numel = row["size_bytes"] // 4
                costs = Resources(gloo_costs.on_emulated_links(mtu), cores=cores).for_gloo(
                    row["workers"])
                entry["predicted_ate_per_s"] = numel / gloo_allreduce_s(
                    numel, workers=row["workers"], rate_bps=row["rate_bps"], mtu=mtu,
                    costs=costs)
            entry["ratio"] = (entry["predicted_ate_per_s"] / row["ate_per_s"]
                              if row["ate_per_s"] else 0.0)
            if gloo_costs is not None:
                entry["cores_needed"] = _cores_needed(entry, gloo_costs)
                # (gloo's prediction shares the cores already: ``Resources.for_gloo``)
                entry["cpu_shared"] = (system == "switchml" and bool(cores)
                                       and entry["cores_needed"] > cores)
            out.append(entry)
    if not out:
        raise ConfigError(f"{', '.join(paths)}: no row to compare: only loss-free rows of "
                          "switchml at 32 bits, and gloo's, on the testbed's links are "
                          "predicted")
    return out


def _cores_needed(entry: dict[str, Any], costs: Any) -> float:
    """The CPU the model's processes (every worker and the switch, or every gloo rank) spend
    per second at the predicted rate, by ``predict``'s costs with the emulated links' cost
    (``costs.Costs``): above the machine's cores, the prediction gave them cores the testbed
    did not have (there they share them), and is optimistic."""
    from switchml.predict import Resources, gloo_resources_s, switchml_resources_s
    n, numel, mtu = entry["workers"], entry["size_bytes"] // 4, entry["mtu"]
    c = costs.on_emulated_links(mtu)
    seconds = numel / entry["predicted_ate_per_s"]
    if entry["system"] == "switchml":
        busy = switchml_resources_s(numel, workers=n, rate_bps=entry["rate_bps"], mtu=mtu,
                                    res=Resources(costs=c))
        return (n * busy["worker CPU"] + busy["switch CPU"]) / seconds
    busy = gloo_resources_s(numel, workers=n, rate_bps=entry["rate_bps"], mtu=mtu, costs=c)
    return n * busy["worker CPU"] / seconds


def access_link(rate_mbit: float, *, delay_us: float, queue_ms: float,
                loss: float) -> SimLink:
    rate = rate_mbit * 1e6
    return SimLink(rate_bps=rate, delay_s=delay_us * 1e-6,
                   queue_bytes=max(1, int(rate * queue_ms * 1e-3 / 8)), loss_rate=loss)
