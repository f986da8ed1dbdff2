"""What a unit of work costs a CPU: the constants ``switchml predict``, ``sim`` and ``plan``
charge, measured by ``switchml calibrate`` (``calibrate.py``) on the machine at hand.

The model (docs/simulator.md, "CPU"):

* a **switchml worker thread** spends ``worker_datagram_s`` per datagram and
  ``worker_element_s`` per element, each way (sent, and received); ``T`` threads share an
  operation's datagrams evenly;
* a **switch core** spends ``switch_request_s`` per request and ``switch_element_s`` per element
  of it (the results it sends for it included); ``S`` shards share the requests evenly;
* a **gloo rank** spends ``gloo_element_s`` per element it moves: a ring all-reduce of ``N``
  elements moves ``2 (n - 1) / n x N`` each way (TCP's cost, and the reduction of the half it
  receives in the reduce-scatter);
* an **emulated link** (the testbed's: a veth pair, a tbf shaper, another namespace) costs the
  kernel ``link_byte_s`` per byte it carries beyond what loopback costs, which the figures
  above hold (``switchml calibrate --links``; 0 where not measured), on the thread that sends
  the frame. A real network's NIC does that work: only predictions of testbed runs
  (``predict --against``) charge it (:meth:`Costs.on_emulated_links`).

Where a user has not calibrated, :data:`REFERENCE` holds what ``switchml calibrate`` measured
on this project's reference machine (2 cores, docs/benchmarks.md), and every output says so.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from switchml import env

__all__ = ["REFERENCE", "Costs", "default_path", "load"]


@dataclass(frozen=True)
class Costs:
    """CPU seconds per unit of work (see the module's docstring)."""

    worker_datagram_s: float
    worker_element_s: float
    switch_request_s: float
    switch_element_s: float
    gloo_element_s: float
    source: str = "given"
    """Where the figures come from (a file, the reference machine)."""
    link_byte_s: float = 0.0
    """An emulated link's kernel CPU per byte it carries, beyond loopback's (0: not measured,
    or real links)."""
    link_op_s: float = 0.0
    """On emulated links, the machine's CPU per all-reduce and worker beyond the figures
    above: a small all-reduce arrives at the link's pace in small batches, each wake-up of a
    worker's or the switch's thread taking a few datagrams (``calibrate --links``, from two
    sizes; 0: not measured)."""
    worker_op_s: float = 0.0
    """What ``predict`` charges each worker per all-reduce: 0, but ``link_op_s`` in a
    prediction of a testbed run (:meth:`on_emulated_links`)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "source" and not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"{f.name} must be a number >= 0, got {value!r}")

    def worker_s(self, datagrams: float, elements: float, threads: int = 1) -> float:
        """One worker's CPU time, spread over ``threads``, to send and receive ``datagrams``
        carrying ``elements`` (each way)."""
        return 2 * (datagrams * self.worker_datagram_s + elements * self.worker_element_s) / threads

    def switch_s(self, requests: float, elements: float, shards: int = 1) -> float:
        """The switch's CPU time, spread over ``shards``, for ``requests`` holding
        ``elements`` in all."""
        return (requests * self.switch_request_s + elements * self.switch_element_s) / shards

    def gloo_s(self, numel: float, workers: int) -> float:
        """One gloo rank's CPU time for a ring all-reduce of ``numel`` elements."""
        if workers < 2:
            return 0.0
        return numel * 2 * (workers - 1) / workers * self.gloo_element_s

    def on_emulated_links(self, mtu: int) -> Costs:
        """These costs with the emulated links' kernel work folded in, for a testbed run at
        ``mtu`` (``link_byte_s`` per byte each way of a worker's link), charged to the thread
        that sends: a frame sent into a veth is delivered in the other namespace, its softirq
        and the receiving socket included, on the sender's thread (perf, docs/benchmarks.md
        §6). So a switchml worker pays a frame per request it sends (one of its datagrams'
        two ways), the switch a frame per result (per request it answers), a gloo rank four
        bytes out and four in per element moved, in TCP segments of the MTU; and each
        switchml worker ``link_op_s`` per all-reduce (measured for switchml only)."""
        if not self.link_byte_s and not self.link_op_s:
            return self
        frame = (mtu + 14) * self.link_byte_s  # an IP packet of the MTU in an Ethernet frame
        mss = mtu - 52  # TCP over IPv4 with timestamps
        return replace(self,
                       # (``worker_s`` charges a datagram's cost each way: half a frame each)
                       worker_datagram_s=self.worker_datagram_s + frame / 2,
                       switch_request_s=self.switch_request_s + frame,
                       gloo_element_s=self.gloo_element_s
                       + 8 * (mss + 52 + 14) / mss * self.link_byte_s,
                       worker_op_s=self.worker_op_s + self.link_op_s,
                       link_byte_s=0.0, link_op_s=0.0)

    def slowed(self, factor: float) -> Costs:
        """Every cost ``factor`` times as high (a process that gets ``1 / factor`` of a
        core)."""
        if factor == 1:
            return self
        return Costs(**{f.name: getattr(self, f.name) * factor for f in fields(self)
                        if f.name != "source"}, source=self.source)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")


REFERENCE = Costs(
    worker_datagram_s=3e-8, worker_element_s=1.35e-9, switch_request_s=1.9e-7,
    switch_element_s=1.44e-9, gloo_element_s=2.45e-9,
    source="the reference machine's calibration (docs/benchmarks.md); run `switchml "
           "calibrate` for this machine's")
"""``switchml calibrate`` on the project's 2-core machine (two runs, 2026-12-03, rounded)."""


def default_path() -> Path:
    """Where ``switchml calibrate`` writes and predict reads: ``$XDG_CACHE_HOME/switchml/
    calibration.json`` (``~/.cache`` by default)."""
    return Path(env.cache_dir()) / "switchml" / "calibration.json"


def load(path: Path | None = None) -> Costs:
    """The calibration at ``path`` (default :func:`default_path`), or :data:`REFERENCE` when
    no path was given and there is none.

    Raises:
        ValueError: a given file that is missing, or a file that is not a calibration.
    """
    explicit = path is not None
    path = path or default_path()
    if not path.exists():
        if explicit:
            raise ValueError(f"no calibration at {path}: run `switchml calibrate --out {path}`")
        return REFERENCE
    try:
        doc = json.loads(path.read_text())
        known = {f.name for f in fields(Costs)}
        return Costs(**{k: v for k, v in doc.items() if k in known and k != "source"},
                     source=f"{path}: {doc.get('source', 'unknown')}")
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path} is not a switchml calibration: {exc}") from None
