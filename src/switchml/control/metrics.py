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

import socket
import time
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


SCRAPE_TIMEOUT_S = 5.0
"""How long the exporter waits on any one receive from a scraper before it closes it."""
MAX_SCRAPES = 16
"""Connections the exporter serves at once; one more closes the oldest (a scrape takes
milliseconds: a connection that old is a stranger holding it)."""


def start_exporter(stats: Callable[[], dict[str, Any]], pool_slots: int, host: str,
                   port: int) -> tuple[Any, Any]:
    """Serve ``/metrics`` on host:port in a thread (prometheus-client's WSGI app); returns
    (server, thread). Each connection has its own thread, at most ``MAX_SCRAPES`` at once
    (one more closes the oldest: ``server.evicted`` counts them), and ``SCRAPE_TIMEOUT_S``
    for each receive (``server.failed`` counts connections that ended in an error): a
    stranger holding half-open requests can neither grow the switch's threads without bound
    nor keep a scrape out."""
    import threading
    from collections import OrderedDict
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import make_wsgi_app
    from prometheus_client.registry import CollectorRegistry

    class Handler(WSGIRequestHandler):
        timeout = SCRAPE_TIMEOUT_S  # (StreamRequestHandler sets it on the connection)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - its name
            pass  # a scrape every few seconds is not news

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        request_queue_size = 64  # connections waiting for their accept
        evicted = 0
        failed = 0  # connections that timed out, were evicted or broke off mid-request

        def handle_error(self, request: Any, client_address: Any) -> None:
            with self._open_lock:  # (socketserver would print a traceback per stranger)
                self.failed += 1

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._open: OrderedDict[Any, None] = OrderedDict()
            self._open_lock = threading.Lock()
            super().__init__(*args, **kwargs)

        def process_request(self, request: Any, client_address: Any) -> None:
            with self._open_lock:
                if len(self._open) >= MAX_SCRAPES:
                    oldest, _ = self._open.popitem(last=False)
                    self.evicted += 1
                    try:  # its thread's receive returns, and the thread ends
                        oldest.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                self._open[request] = None
            super().process_request(request, client_address)

        def shutdown_request(self, request: Any) -> None:
            with self._open_lock:
                self._open.pop(request, None)
            super().shutdown_request(request)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SwitchCollector(stats, pool_slots))
    httpd = make_server(host, port, make_wsgi_app(registry), Server, handler_class=Handler)
    thread = threading.Thread(target=httpd.serve_forever, name="switchml-metrics",
                              daemon=True)
    thread.start()
    return httpd, thread


MAX_METRICS_BYTES = 16 << 20
"""The most a scrape reads (a switch's page is kilobytes: more is not a switch's)."""


def read_metrics(url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """Scrape a switch's metrics endpoint into ``{name: value | {label: value}}`` (a sample
    with several labels under their values joined by commas, e.g. ``"7,2"``).

    Raises:
        OSError: no answer (refused, unreachable, or no byte within ``timeout_s``).
        ValueError: an answer that is not a switch's metrics page: not HTTP, not Prometheus
            text, over ``MAX_METRICS_BYTES``, or not whole after ``timeout_s`` (a server that
            dribbles its page is given that long in all, checked between reads)."""
    import http.client

    from prometheus_client.parser import text_string_to_metric_families
    deadline = time.monotonic() + timeout_s
    body = bytearray()
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - user's URL
            while chunk := resp.read1(1 << 16):
                body += chunk
                if len(body) > MAX_METRICS_BYTES:
                    raise ValueError(f"{url} sent more than {MAX_METRICS_BYTES >> 20} MiB: "
                                     "not a switchml metrics endpoint?")
                if time.monotonic() > deadline:
                    raise ValueError(f"{url} did not send its page within {timeout_s:g} s")
    except http.client.HTTPException as exc:
        raise ValueError(f"can't read {url}: not an HTTP answer ({type(exc).__name__}: "
                         f"{exc}): not a switchml metrics endpoint?") from exc
    try:
        families = list(text_string_to_metric_families(body.decode()))
    except ValueError as exc:  # (UnicodeDecodeError included)
        raise ValueError(f"can't read {url}: its page is not Prometheus text ({exc}): not a "
                         "switchml metrics endpoint?") from exc
    out: dict[str, Any] = {}
    for family in families:
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            if sample.labels:  # one label: its value; several: their values, "a,b"
                label = ",".join(sample.labels.values())
                out.setdefault(sample.name, {})[label] = sample.value
            else:
                out[sample.name] = sample.value
    return out
