"""The switch capacity figures, from the samples the driver took, and the JSON file."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import asdict
from typing import Any

from switchml.bench.switchcap.config import SwitchCapConfig, SwitchCapResult

__all__ = ["result_of", "write_json"]


def _commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here,
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _bottleneck(sw_pct: float, gen_pct: float, other_pct: float,
                machine_pct: float = 0.0) -> str:
    """Which side limited the rate, from the CPU each used over the interval (the busiest
    shard, the busiest generator) and the whole machine's use in % of all its cores."""
    if sw_pct >= 90.0 and gen_pct >= 90.0:
        return "both near 100% (the rate is a lower bound of the switch's)"
    if sw_pct >= 90.0:
        return "switch"
    if gen_pct >= 90.0:
        return "generator"
    if other_pct >= 20.0:
        return f"undetermined: other processes used {other_pct:.0f}% of a core"
    if machine_pct >= 90.0:
        return "the machine: every core busy (the rate is a lower bound of the switch's)"
    return "neither at 90% CPU (latency-bound)"


def _generator_figures(g_mark: dict[str, Any], g_end: dict[str, Any], report: dict[str, Any],
                       first_s: float) -> dict[str, Any]:
    """The generator's counters over the interval and (``*_total``) over the whole run."""
    g_dt = g_end["t"] - g_mark["t"]
    gfin = report["final"]
    return {
        "interval_s": g_dt,
        "requests": g_end["requests"] - g_mark["requests"],
        "results": g_end["results"] - g_mark["results"],
        "requests_per_s": (g_end["requests"] - g_mark["requests"]) / g_dt,
        "results_per_s": (g_end["results"] - g_mark["results"]) / g_dt,
        "cpu_percent_own_clock": 100.0 * (g_end["cpu_s"] - g_mark["cpu_s"]) / g_dt,
        "send_calls": g_end["send_calls"] - g_mark["send_calls"],
        "recv_calls": g_end["recv_calls"] - g_mark["recv_calls"],
        "requests_total": gfin["requests"],
        "results_total": gfin["results"],
        "retransmissions_total": gfin["retransmissions"],
        "wrong_results_total": gfin["wrong_results"],
        "in_flight_at_end": report["in_flight_at_end"],
        "first_result_after_s": first_s,
        "unexpected_total": report["unexpected"],
        "send_blocked_total": report["send_blocked"],
        "joins_sent": report["joins_sent"],
        "control_replies_total": report["control_replies"],
        "gso": report["gso"], "gro": report["gro"],
    }


def _merge_generators(figs: list[dict[str, Any]]) -> dict[str, Any]:
    """The generators' figures as one: counters and rates summed, dicts merged, the interval
    and the first result the longest, GSO/GRO only if every generator had them."""
    if len(figs) == 1:
        return figs[0]
    out: dict[str, Any] = {}
    for key, v in figs[0].items():
        vals = [f[key] for f in figs]
        if isinstance(v, bool):
            out[key] = all(vals)
        elif key in ("interval_s", "first_result_after_s"):
            out[key] = max(vals)
        elif isinstance(v, dict):
            out[key] = _sum_dicts(vals)
        else:
            out[key] = sum(vals)
    out["per_generator"] = figs
    return out


def _sum_dicts(ds: list[dict[str, Any]]) -> dict[str, Any]:
    """Numbers summed key by key (booleans: all true); other values from the first."""
    out: dict[str, Any] = {}
    for d in ds:
        for key, v in d.items():
            if key not in out:
                out[key] = dict(v) if isinstance(v, dict) else v
            elif isinstance(v, bool):
                out[key] = out[key] and v
            elif isinstance(v, (int, float)):
                out[key] += v
            elif isinstance(v, dict):
                out[key] = _sum_dicts([out[key], v])
    return out


_SHARD_LEVELS = frozenset({"jobs", "slots_in_use", "memory_bytes", "nack_gaps",
                           "elements_aggregated"})
"""Switch stats that describe one shard's state, not traffic: not summed over shards."""


def _sum_counters(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """The shards' stats as one switch's: counters summed, drops merged; state (jobs, slots,
    gaps, ...) as shard 0 has it (each shard's own is in ``shards``)."""
    out = dict(stats[0])
    for key, v in stats[0].items():
        if key in _SHARD_LEVELS or isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            out[key] = sum(st.get(key, 0) for st in stats)
        elif key == "drops":
            out[key] = _sum_dicts([st.get(key, {}) for st in stats])
    return out


def _shard_figures(i: int, dt: float, s_mark: dict[str, Any], s_end: dict[str, Any],
                   cpu: int | None) -> dict[str, Any]:
    """One shard's rate and CPU over the interval."""
    st0, st1 = s_mark["stats"][i], s_end["stats"][i]
    d_in = int(st1.get("packets_in", 0)) - int(st0.get("packets_in", 0))
    d_out = int(st1.get("packets_out", 0)) - int(st0.get("packets_out", 0))
    sw_cpu = s_end["cpu_s"][i] - s_mark["cpu_s"][i]
    return {"shard": i, "pinned_cpu": cpu, "datagrams_in": d_in, "datagrams_out": d_out,
            "in_per_s": d_in / dt, "out_per_s": d_out / dt,
            "cpu_s": sw_cpu, "cpu_percent": 100.0 * sw_cpu / dt,
            "cpu_us_per_datagram": 1e6 * sw_cpu / d_in if d_in else float("nan"),
            "capacity_per_s": d_in / sw_cpu if sw_cpu > 0 else float("nan")}


def result_of(cfg: SwitchCapConfig, m: dict[str, Any], pinned: dict[str, Any],
            load_before: float) -> SwitchCapResult:
    """The figures from the driver's samples ``m`` (``driver._measure``)."""
    s_mark, s_end = m["s_mark"], m["s_end"]
    dt = s_end["t"] - s_mark["t"]
    shards = [_shard_figures(i, dt, s_mark, s_end, cpu)
              for i, cpu in enumerate(pinned["switch_cpus"])]
    d_in = sum(f["datagrams_in"] for f in shards)
    d_out = sum(f["datagrams_out"] for f in shards)
    sw_cpu = sum(f["cpu_s"] for f in shards)
    gen_pcts = [100.0 * (b - a) / dt for a, b in zip(m["c_gen0"], m["c_gen1"])]
    sw_pct = 100.0 * sw_cpu / dt
    gen_pct = sum(gen_pcts)
    busy_pct = 100.0 * (s_end["busy_s"] - s_mark["busy_s"]) / dt
    other_pct = max(0.0, busy_pct - sw_pct - gen_pct)
    generator = _merge_generators([
        _generator_figures(gm, ge, rep, m["first_s"])
        for gm, ge, rep in zip(m["g_mark"], m["g_end"], m["reports"])])
    final, first = m["final"]["stats"], m["first"]["stats"]
    fs = final[0] if len(final) == 1 else _sum_counters(final)
    errors = {key: sum(int(f.get(key, 0)) - int(b.get(key, 0)) for f, b in zip(final, first))
              for key in ("internal_errors", "send_errors", "truncated")}
    capacity = sum(f["capacity_per_s"] for f in shards)
    return SwitchCapResult(
        config={**asdict(cfg), "datagram_bytes": cfg.datagram_bytes,
                "generators": len(gen_pcts)},
        interval_s=dt,
        switch_datagrams_in=d_in, switch_datagrams_out=d_out,
        switch_in_per_s=d_in / dt, switch_out_per_s=d_out / dt,
        payload_gbytes_per_s=d_in * cfg.elements_per_packet * 4 / dt / 1e9,
        switch_cpu_percent=sw_pct, generator_cpu_percent=gen_pct, other_cpu_percent=other_pct,
        switch_cpu_us_per_datagram=1e6 * sw_cpu / d_in if d_in else float("nan"),
        switch_capacity_per_s=capacity,
        bottleneck=_bottleneck(max(f["cpu_percent"] for f in shards), max(gen_pcts),
                               other_pct, busy_pct / pinned["cores"]),
        generator=generator,
        drops={str(k): int(v) for k, v in dict(fs.get("drops", {})).items()},
        switch_errors=errors,
        switch_stats={k: v for k, v in fs.items() if k != "elements_aggregated"},
        pinned=pinned,
        shards=shards,
        machine={"cpus": os.cpu_count(), "uname": " ".join(os.uname()), "commit": _commit(),
                 "date": time.strftime("%Y-%m-%d"), "loadavg_before": load_before},
    )


def write_json(path: str, result: SwitchCapResult) -> None:
    """Write ``result`` to ``path`` as JSON, with its derived checks."""
    doc = {"benchmark": "switch-capacity", **asdict(result),
           "wrong_results": result.wrong_results, "consistent": result.consistent}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
