"""Prometheus metrics of a running switch, and the reader behind ``switchml stats``.

A switchml job's id is the label ``job_id`` (Prometheus keeps ``job`` for the scrape job's
name). ``deploy/prometheus/`` has alert rules over these metrics and ``deploy/grafana/`` a
dashboard; ``tests/ops/test_prometheus.py`` runs both against a real Prometheus.

The exporter is a prometheus-client *collector*: it reads the dataplane's counters when
scraped, so the packet path pays nothing for it. Metric names:

| metric | type | labels |
|---|---|---|
| ``switchml_packets_in_total`` / ``switchml_packets_out_total`` | counter | |
| ``switchml_results_multicast_total`` | counter | |
| ``switchml_results_resent_total`` (from shadow copies) | counter | |
| ``switchml_late_contributions_total`` (quorum jobs: re-sends after their round completed,
  answered with its result) | counter | |
| ``switchml_old_results_answered_total`` (quorum jobs: results of earlier rounds from a
  slot's history, to a rank left behind) | counter | |
| ``switchml_rounds_gone_answered_total`` (quorum jobs: re-sends of rounds past a slot's
  history, answered GONE) | counter | |
| ``switchml_waiting_sent_total`` | counter | |
| ``switchml_mismatch_sent_total`` (ranks disagreed about a chunk) | counter | |
| ``switchml_nacks_sent_total`` (loss recovery: a rank was told to re-send) | counter | |
| ``switchml_members_joined_total``, ``_members_left_total`` (LEAVE),
  ``_members_replaced_total`` (a quorum job's rank joined running, from a new address),
  ``switchml_jobs_expired_total`` (every member silent for the lease) | counter | |
| ``switchml_drops_total`` | counter | ``reason`` |
| ``switchml_elements_aggregated_total`` | counter | ``job_id`` |
| ``switchml_jobs``, ``switchml_slots_in_use``, ``switchml_pool_slots`` | gauge | |
| ``switchml_memory_bytes`` (slot memory held by jobs) | gauge | |
| ``switchml_job_ranks``, ``_members``, ``_open_rounds``, ``_quorum`` (ranks a round
  completes with) | gauge | ``job_id`` |
| ``switchml_job_rank_missing_rounds`` (open rounds lacking it) | gauge | ``job_id``, ``rank`` |
| ``switchml_job_rank_silent_seconds`` (-1: never heard) | gauge | ``job_id``, ``rank`` |
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["SwitchCollector", "read_metrics", "start_exporter"]


class SwitchCollector:
    """A prometheus-client collector over ``stats()`` of a SwitchServer."""

    def __init__(self, stats: Callable[[], dict[str, Any]], pool_slots: int) -> None:
        self._stats = stats
        self._pool_slots = pool_slots

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        s = self._stats()
        for name, key, doc in (
                ("switchml_packets_in", "packets_in", "Datagrams received"),
                ("switchml_packets_out", "packets_out", "Datagrams sent"),
                ("switchml_results_multicast", "results_multicast",
                 "Completed slots sent to every member"),
                ("switchml_results_resent", "results_resent",
                 "Results resent from shadow copies to one worker"),
                ("switchml_late_contributions", "late_contributions",
                 "Quorum jobs: re-sends into rounds complete without them, answered with the "
                 "result (not added)"),
                ("switchml_old_results_answered", "old_results_answered",
                 "Quorum jobs: results of earlier rounds sent from a slot's history to a rank "
                 "left behind"),
                ("switchml_rounds_gone_answered", "rounds_gone_answered",
                 "Quorum jobs: re-sends of rounds past a slot's history, answered GONE (the "
                 "rank is too far behind)"),
                ("switchml_waiting_sent", "waiting_sent",
                 "WAITING answers to retransmissions into open slots"),
                ("switchml_mismatch_sent", "mismatch_sent",
                 "MISMATCH answers: ranks sent a chunk with different shapes"),
                ("switchml_nacks_sent", "nacks_sent",
                 "NACKs: a rank's later chunks arrived before an earlier one (loss recovery)"),
                ("switchml_members_joined", "members_joined",
                 "Ranks that joined a job (a new membership: a first JOIN, a JOIN from a new "
                 "address before the job started, or a quorum job's replacement)"),
                ("switchml_members_left", "members_left", "Ranks that left a job (LEAVE)"),
                ("switchml_members_replaced", "members_replaced",
                 "Ranks of a running quorum job that joined again from a new address (a "
                 "replacement took the rank's place)"),
                ("switchml_jobs_expired", "jobs_expired",
                 "Jobs removed because every member went silent for the lease")):
            yield CounterMetricFamily(name, doc, value=s.get(key, 0))
        drops = CounterMetricFamily("switchml_drops", "Dropped datagrams", labels=["reason"])
        for reason, n in sorted(s["drops"].items()):
            drops.add_metric([reason], n)
        yield drops
        elems = CounterMetricFamily("switchml_elements_aggregated",
                                    "Aggregated elements per live job", labels=["job_id"])
        for job, n in sorted(s["elements_aggregated"].items()):
            elems.add_metric([str(job)], n)
        yield elems
        yield GaugeMetricFamily("switchml_jobs", "Live jobs", value=s["jobs"])
        yield GaugeMetricFamily("switchml_slots_in_use", "Slots held by jobs",
                                value=s["slots_in_use"])
        yield GaugeMetricFamily("switchml_pool_slots", "Slots in the pool",
                                value=self._pool_slots)
        yield GaugeMetricFamily("switchml_memory_bytes", "Slot memory held by jobs",
                                value=s["memory_bytes"])
        yield from _job_families(s.get("job_states", []))


def _job_families(states: list[dict[str, Any]]) -> Iterator[Any]:
    """Per job: its ranks, joined members and open rounds; per rank it waits for: the rounds
    it is missing from and how long it has been silent."""
    from prometheus_client.core import GaugeMetricFamily
    per_job = {name: GaugeMetricFamily(f"switchml_job_{name}", doc, labels=["job_id"])
               for name, doc in (("ranks", "Ranks of the job"),
                                 ("members", "Ranks joined"),
                                 ("open_rounds", "Slot rounds waiting for contributions"),
                                 ("quorum", "Ranks a round completes with (all of them "
                                            "without a quorum)"))}
    missing = GaugeMetricFamily("switchml_job_rank_missing_rounds",
                                "Open rounds this rank has not contributed to",
                                labels=["job_id", "rank"])
    silent = GaugeMetricFamily("switchml_job_rank_silent_seconds",
                               "Seconds since this rank last sent anything (-1: never)",
                               labels=["job_id", "rank"])
    for st in states:
        job = str(st["job"])
        for name, family in per_job.items():
            family.add_metric([job], st[name])
        for rank, rounds in st["waiting_for"].items():
            missing.add_metric([job, str(rank)], rounds)
            quiet = st["silent_s"].get(rank)
            silent.add_metric([job, str(rank)], -1.0 if quiet is None else quiet)
    yield from per_job.values()
    yield missing
    yield silent


def start_exporter(stats: Callable[[], dict[str, Any]], pool_slots: int, host: str,
                   port: int) -> tuple[Any, Any]:
    """Serve ``/metrics`` on host:port in a thread; returns (server, thread)."""
    from prometheus_client import start_http_server
    from prometheus_client.registry import CollectorRegistry
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SwitchCollector(stats, pool_slots))
    return start_http_server(port, addr=host, registry=registry)


def read_metrics(url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """Scrape a switch's metrics endpoint into ``{name: value | {label: value}}`` (a sample
    with several labels under their values joined by commas, e.g. ``"7,2"``)."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - user's URL
        text = resp.read().decode()
    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            if sample.labels:  # one label: its value; several: their values, "a,b"
                label = ",".join(sample.labels.values())
                out.setdefault(sample.name, {})[label] = sample.value
            else:
                out[sample.name] = sample.value
    return out
