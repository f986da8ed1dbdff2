"""Validated, frozen configuration objects for the switch, the worker and a job."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, fields

from switchml.protocol.errors import ConfigError
from switchml.protocol.wire import (
    AUTH_TAG_SIZE,
    HEADER_SIZE,
    MAX_DATAGRAM_BYTES,
    MAX_ELEMENTS_PER_PACKET,
)

__all__ = ["MAX_THREADS", "JobSpec", "SwitchConfig", "WorkerConfig", "default_window"]



def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


_KINDS = {"int": ("an integer", lambda v: isinstance(v, numbers.Integral)),
          "float": ("a number", lambda v: isinstance(v, numbers.Real)),
          "bytes": ("bytes", lambda v: isinstance(v, bytes))}


def _check_types(obj: object) -> None:
    """Each field annotated ``int``, ``float`` or ``bytes`` (or that or None) holds one: a
    string, a float where an integer belongs, or a bool (an integer to Python, a flag to its
    user) is refused naming the field, before a rule compares it or the wire packs it. (So
    the rules after it check ranges and sizes only.)"""
    for f in fields(obj):  # type: ignore[arg-type]
        kind = str(f.type)
        optional = kind.endswith(" | None")
        what, ok = _KINDS.get(kind.removesuffix(" | None"), (None, None))
        value = getattr(obj, f.name)
        if ok is None or (optional and value is None):
            continue
        _check(ok(value) and not isinstance(value, bool),
               f"{f.name} must be {what}{' or None' if optional else ''}, got {value!r} "
               f"({type(value).__name__})")


@dataclass(frozen=True, slots=True)
class SwitchConfig:
    """Switch resources. Every job's slots come out of one bounded pool."""

    pool_slots: int = 1024
    """Aggregation slots in the pool (each has two sets of up to ``max_elements_per_packet``
    int32). Memory is allocated per job, for the slots it holds: at most
    ``pool_slots * 2 * (40 + 4 * max_elements_per_packet)`` bytes, 128 MiB by default. A job
    asking more slots than the largest free range is refused. Default 1024."""
    max_elements_per_packet: int = MAX_ELEMENTS_PER_PACKET
    """Largest chunk a job may ask for, in int32 elements (1..16366). Default: the UDP maximum."""
    max_workers: int = 4096
    """Largest number of workers in one job (the seen bitmaps have no fixed width)."""
    max_window: int = 256
    """Most slots one job may hold (W), so that one JOIN cannot take the whole pool. Default
    256 (32 MiB of slot memory at the largest chunk size)."""
    lease_timeout_s: float = 30.0
    """A job that sends nothing for this long loses its slots (its workers died without
    leaving). Idle workers keep their lease with KEEPALIVE messages (``WorkerConfig``)."""
    secret: bytes | None = None
    """The root of every job key (``auth.job_key``): a JOIN or LEAVE counts only with a proof
    under the key this secret and the job's id and token give, so nobody without it creates,
    joins or leaves a job. None: an open switch (the empty secret), which authenticates only
    against those who never saw a job's token. Required when the switch listens beyond
    loopback."""
    tenant_slots: int | None = None
    """The most slots the jobs of one tenant (a range of job ids: ``auth.TENANT_JOBS``) may
    hold at once; a JOIN that would create one more job beyond it is refused. None: no quota
    (each job still holds at most ``max_window``)."""
    member_timeout_s: float = 20.0
    """A member the switch has heard nothing from (no request, no keep-alive: workers send one
    every ``keepalive_s``, 5 s, while idle) for this long is reported gone in the WAITING
    answers its peers get, and they fail at once naming it instead of waiting out their own
    ``op_timeout_s`` (30 minutes under torch). Default 20 s."""
    join_challenge_s: float = 5.0
    """How long a JOIN challenge's cookie stays good (a JOIN's round trip, with margin). A
    JOIN captured and replayed later than this changes nothing. Default 5 s."""
    challenges_per_s: float | None = 4096.0
    """The most CHALLENGE replies the switch sends per second, in bursts of up to as many
    (a token bucket): a flood of JOINs from spoofed sources gets no more than this back at
    whoever it names, and costs the switch no more cookies. Beyond it a JOIN without a
    cookie is dropped (``challenge_budget``) and its worker asks again after its retry
    interval. Every rank of a 4,096-rank job starting at once gets one in its first second.
    None: no budget. Default 4096."""
    nack_gap: int = 4
    """Switch-driven loss recovery: when a rank's chunk ``p + nack_gap`` arrives and its chunk
    ``p`` has not (its request was lost, or the result that releases it), the switch sends
    that rank a NACK at once and it re-sends, instead of waiting for its retransmission
    timeout. A worker's datagrams travel one path in order, so any gap >= 1 is safe; the
    gap is the reordering tolerated before a needless re-send. 0 turns NACKs off. Default 4."""

    nack_log_windows: int = 8
    """Completions the switch remembers per job for NACKs, in windows (a ring of
    ``nack_log_windows * window``); it also caps how far a widened NACK gap grows. Default 8."""
    quorum_history: int = 16
    """Rounds of each slot a quorum job's switch keeps after their set is reused, in rows
    beside the two sets: a rank the quorum left more than a round behind (it lost a result
    while the others went on) gets its earlier rounds' results from them. Each costs the job
    ``window`` slots' results (``window * (40 + 4 * elements_per_packet)`` bytes); jobs without
    a quorum keep none. Default 16."""
    nack_calm: int = 64
    """After this many completed rounds of the job without a needless NACK, a widened gap
    halves again towards ``nack_gap`` (the network stopped reordering). Default 64."""

    shard_index: int = 0
    shard_count: int = 1
    """A sharded switch: this process is shard ``shard_index`` of ``shard_count``. Workers
    stripe a job's lanes over the shards (lane i to shard i mod S) and join the job on every
    one; a shard tells which one it is in its JOINED answers. Default: one unsharded switch."""

    def __post_init__(self) -> None:
        _check_types(self)
        _check(self.nack_gap >= 0, f"nack_gap must be >= 0, got {self.nack_gap}")
        _check(self.tenant_slots is None or self.tenant_slots >= 1,
               f"tenant_slots must be None or an integer >= 1, got {self.tenant_slots!r}")
        _check(self.nack_log_windows >= 1,
               f"nack_log_windows must be >= 1, got {self.nack_log_windows}")
        _check(self.nack_calm >= 1, f"nack_calm must be >= 1, got {self.nack_calm}")
        _check(0 <= self.quorum_history <= 1024,
               f"quorum_history must be an integer in 0..1024, got {self.quorum_history!r}")
        _check(0 <= self.shard_index < self.shard_count,
               f"expected 0 <= shard_index < shard_count, got shard {self.shard_index} of "
               f"{self.shard_count}")
        _check(self.lease_timeout_s > 0, f"lease_timeout_s must be > 0, got "
               f"{self.lease_timeout_s}")
        _check(self.join_challenge_s > 0, f"join_challenge_s must be > 0, got "
               f"{self.join_challenge_s}")
        _check(self.member_timeout_s > 0, f"member_timeout_s must be > 0, got "
               f"{self.member_timeout_s}")
        _check(self.challenges_per_s is None or self.challenges_per_s >= 1,
               f"challenges_per_s must be None or >= 1, got {self.challenges_per_s!r}")
        _check(self.secret is None or len(self.secret) >= 16,
               "secret must be at least 16 bytes (use a random one)")
        _check(self.pool_slots >= 1, f"pool_slots must be >= 1, got {self.pool_slots}")
        _check(1 <= self.max_elements_per_packet <= MAX_ELEMENTS_PER_PACKET,
               f"max_elements_per_packet must be in 1..{MAX_ELEMENTS_PER_PACKET} "
               f"(a UDP datagram holds at most that many int32), got "
               f"{self.max_elements_per_packet}")
        _check(self.max_workers >= 1, f"max_workers must be >= 1, got {self.max_workers}")
        _check(self.max_window >= 1, f"max_window must be >= 1, got {self.max_window}")


MAX_THREADS = 64
"""The most I/O threads (job parts, ``protocol/parts.py``) one rank may use."""
WINDOW_BYTES = 256 * 1024
"""Bytes a worker keeps in flight by default (``default_window``)."""


def default_window(elements_per_packet: int) -> int:
    """The default window W for chunks of ``elements_per_packet``: about ``WINDOW_BYTES`` in
    flight per worker, between 16 and 128 slots. Small datagrams need many in flight to cover
    a round trip, large ones few: 358-element chunks (MTU 1500) get 128, 2233 (MTU 9000) 29,
    64 KB datagrams 16. Measured on the testbed (n = 4, 1 Gbit/s, MTU 1500): a 64 MiB
    all-reduce ran at 32% of the line rate with 16, 44-51% with 64-128, 52-60% with 256; DDP
    steps of a small CNN took 73-76 ms with 32-128 and 107 ms with 256 (gloo: 57 ms)."""
    datagram = 40 + 4 * elements_per_packet
    return max(16, min(128, round(WINDOW_BYTES / datagram)))


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What every worker of a job must agree on; created once and shared with all ranks.

    ``switchml.control.new_job_spec`` fills ``job_id`` and ``token`` from a CSPRNG.
    """

    job_id: int
    """32-bit job number, unique on the switch."""
    token: int
    """64-bit secret; a datagram without it is dropped by the switch and by workers."""
    num_workers: int
    """n, the number of ranks (0..n-1) that contribute to every operation."""
    window: int = 16
    """W, slots the job holds on the switch = chunks in flight per worker. Tuning: W x packet
    bytes should cover the bandwidth-delay product; on loopback 8-32 is plenty. Default 16."""
    elements_per_packet: int = 16000
    """k, int32 elements per chunk (packet payload = 4k bytes). Default 16000 (64 KB datagrams,
    right for loopback only). Whoever makes the spec chooses k; no transport changes it.
    Unless told k, the torch backend and its DDP hooks size it to the smallest path MTU over
    the ranks, ``switchml bench allreduce`` to the path MTU or its ``--mtu``, and
    ``control.new_job_spec`` (the numpy ``WorkerClient``'s jobs) to the MTU of the path to
    the ``switch`` it is given, else to a 1500-byte Ethernet MTU: all with one rule,
    ``transport.sockets.local_mtu`` and ``wire.elements_for_mtu`` (358 for a 1500-byte MTU,
    2233 for 9000-byte jumbo frames, 16366 on loopback: no IP fragmentation)."""
    scale_workers: int | None = None
    """How many contributors the fixed-point scale must allow for (``P = 31 -
    bit_length(scale_workers)``). ``None`` means ``num_workers``. A job whose sums are added
    again upstream (the ranks of one rack under a hierarchical switch) sets it to the number of
    workers of the whole tree, so that every level's integer sum fits and the partial sums of
    different racks add exactly."""

    quorum: int | None = None
    """k: the switch completes each round when k of the n ranks have contributed, and
    multicasts a sum that says which ranks it holds (a bitmap after the payload); a rank whose
    chunk comes after that is answered with the stored result, not added, and goes on with the
    same result as everyone else (TensorFlow's backup workers, done in the network). ``None``
    (the default): every round waits for all n, exactly as without the option. A job over a
    hierarchy of switches (``tree.py``) has no quorum."""
    quorum_deadline_s: float | None = None
    """With ``quorum``: a round also completes this long after its first contribution, with at
    least ``quorum_min`` ranks (fewer than ``quorum`` when the rest are late). None: a round
    always waits for ``quorum`` ranks. Up to 4294 s (microseconds on the wire)."""
    quorum_min: int | None = None
    """The ranks a round needs at ``quorum_deadline_s`` (1..quorum); required with it."""
    auth_data: bool = False
    """Authenticate the data plane: every REQUEST and RESULT carries a MAC under a key derived
    from the job key (docs/protocol.md, "Authenticated data plane"), so that whoever can send
    datagrams from the switch's or a worker's address, but lacks the key, changes no sum.
    Needs a switch with a secret (an open switch's job keys derive from public values). Not
    with a quorum or a hierarchy of switches yet. Costs about 16 bytes and a SipHash per
    datagram each way."""

    @property
    def scale_count(self) -> int:
        """The number of contributors the fixed-point scale allows for."""
        return self.num_workers if self.scale_workers is None else self.scale_workers

    def __post_init__(self) -> None:
        _check_types(self)
        _check(0 <= self.job_id < 2**32, f"job_id must fit 32 bits, got {self.job_id}")
        _check(0 <= self.token < 2**64, "token must fit 64 bits")
        _check(self.num_workers >= 1, f"num_workers must be >= 1, got {self.num_workers}")
        _check(1 <= self.window <= 65536, f"window must be in 1..65536, got {self.window}")
        _check(1 <= self.elements_per_packet <= MAX_ELEMENTS_PER_PACKET,
               f"elements_per_packet must be in 1..{MAX_ELEMENTS_PER_PACKET}, got "
               f"{self.elements_per_packet}")
        _check(self.quorum is None or 1 <= self.quorum <= self.num_workers,
               f"quorum must be None or an integer in 1..num_workers ({self.num_workers}), got "
               f"{self.quorum!r}")
        _check(self.quorum_deadline_s is None or (
                   self.quorum is not None and self.quorum_min is not None
                   and 1 <= self.quorum_min <= self.quorum
                   and 1e-6 <= self.quorum_deadline_s < 4294.0),
               "quorum_deadline_s needs a quorum and a quorum_min in 1..quorum, and must be in "
               f"1e-6..4294 s; got quorum={self.quorum}, quorum_min={self.quorum_min!r}, "
               f"quorum_deadline_s={self.quorum_deadline_s!r}")
        _check(self.quorum_min is None or self.quorum_deadline_s is not None,
               "quorum_min is the ranks a round needs at quorum_deadline_s: give both")
        _check(self.quorum is None or HEADER_SIZE + 4 * self.elements_per_packet
               + (self.num_workers + 7) // 8 <= MAX_DATAGRAM_BYTES,
               f"a quorum job's results carry {(self.num_workers + 7) // 8} bitmap bytes after "
               f"the payload: elements_per_packet must be at most "
               f"{(MAX_DATAGRAM_BYTES - HEADER_SIZE - (self.num_workers + 7) // 8) // 4}, got "
               f"{self.elements_per_packet}")
        _check(not self.auth_data or self.quorum is None,
               "auth_data with a quorum is not supported yet (its late results go through "
               "Python unverified): choose one")
        _check(not self.auth_data or HEADER_SIZE + 4 * self.elements_per_packet + AUTH_TAG_SIZE
               <= MAX_DATAGRAM_BYTES,
               f"an authenticated job's datagrams carry a {AUTH_TAG_SIZE}-byte MAC: "
               f"elements_per_packet must be at most "
               f"{(MAX_DATAGRAM_BYTES - HEADER_SIZE - AUTH_TAG_SIZE) // 4}, got "
               f"{self.elements_per_packet}")
        _check(self.scale_workers is None or self.scale_workers >= self.num_workers,
               f"scale_workers must be >= num_workers ({self.num_workers}), got "
               f"{self.scale_workers}")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Loss recovery and failure detection of a worker. Times in seconds."""

    initial_rto_s: float = 0.2
    """Retransmission timeout before any round trip was measured. Default 0.2 s."""
    min_rto_s: float = 0.01
    """Lower clamp of the adaptive timeout (srtt + 4 rttvar, RFC 6298 style). Default 10 ms."""
    max_rto_s: float = 1.0
    """Upper clamp, also for exponential backoff of a chunk lost repeatedly. Default 1 s."""
    min_rto_srtts: float = 3.0
    """The timeout is also at least this many smoothed round trips. A slot held up by another
    rank's loss completes after that rank's NACK recovery: the NACK down, the re-send up and
    the result down cross the same queues as a round trip does, so about two round trips
    after this rank's request; a timeout that fires meanwhile only re-sends what the switch
    already has, on a path with a standing queue for every loss. Timeouts are the backstop
    (NACKs and tail probes recover loss first). 1 gives plain RFC 6298. The floor also
    applies where only a timeout can recover: with the switch's NACKs off (``nack_gap=0``),
    every loss costs at least 3 srtt. Default 3."""
    op_timeout_s: float = 15.0
    """An operation with no progress for this long fails with an error naming the switch or the
    silent peers. Must exceed the longest stall a healthy peer can have (e.g. a slow backward
    pass before it issues the same operation). Default 15 s."""
    join_timeout_s: float = 10.0
    """Joining fails if the switch does not answer within this time. Default 10 s."""
    keepalive_s: float = 5.0
    """An idle worker sends KEEPALIVE this often, so the switch keeps the job's lease (keep it
    well below the switch's ``lease_timeout_s``, default 30 s). Default 5 s."""
    max_restarts: int = 3
    """How often one operation may be restarted after the switch lost the job (a switch restart
    or an expired lease) before it fails. 0 disables transparent restarts."""
    secret: bytes | None = None
    """The switch's secret (``SwitchConfig.secret``): the job key that proves this rank's
    JOIN and LEAVE is derived from it (``auth.job_key``). None for an open switch."""
    job_key: bytes | None = None
    """This job's key, in place of ``secret`` (``auth.job_key`` of the switch's secret and the
    job's id and token; ``switchml job-key`` prints it): a worker that holds only this can
    create and join this job and no other, and its job holds at most the switch's
    ``max_window`` slots, so a tenant's workers need not hold the switch-wide secret. One job
    only: a rank on several I/O threads (a job per thread) needs the secret."""
    tenant_key: bytes | None = None
    """A tenant's key, in place of ``secret`` (``auth.tenant_key``; ``switchml job-key
    --tenant T`` prints it): a worker that holds only this can create and join the jobs of its
    tenant's range of ids (``auth.tenant_job_id``; ``control.new_job_spec(tenant=T)`` draws
    one) and no other, within the tenant's slot quota (``SwitchConfig.tenant_slots``)."""
    fast_retransmit: bool = False
    """Re-send a chunk as soon as a chunk sent later has its result (RACK, RFC 8985), instead of
    waiting for its timeout; the reorder window widens when a re-send proves spurious (a
    WAITING answer, or a result sooner than the smallest round trip after it). Off by default:
    a slot completes when the *last* worker's chunk arrives, so over deep queues results come
    back out of sending order by about a round trip, and on the emulated network it was only
    level with the timeouts (docs/benchmarks.md)."""
    min_reorder_window_s: float = 0.001
    """How much later a chunk must have been sent before its result marks an earlier chunk as
    lost (RACK), and how long a tail-loss probe waits for a reordered result: the larger of
    this and a quarter of the smallest round trip seen. Also the least time without any
    result before an idle probe (otherwise two smoothed round trips). Default 1 ms."""
    max_reorder_scale: float = 1024.0
    """RACK's reorder window doubles at each needless re-send, up to this many times its base.
    Default 1024."""
    control_retry_s: float = 0.2
    """JOIN and LEAVE are retried after this long, doubling up to ``control_retry_max_s``.
    Default 0.2 s."""
    control_retry_max_s: float = 2.0
    """Cap of the JOIN/LEAVE retry backoff. Default 2 s."""
    leave_timeout_s: float = 1.0
    """``close`` gives up waiting for LEFT after this long (the switch's lease frees the slots
    anyway). Default 1 s."""
    quorum_keep_bytes: int = 256 * 2**20
    """In a quorum job (``JobSpec.quorum``), the results of later operations a rank keeps,
    in bytes: a rank that falls behind (it starts an operation after the others finished it)
    gets every result by the switch's multicast meanwhile and completes the operation from
    them when it starts it, without waiting. Beyond this the results are dropped (counted
    ``ahead_dropped``) and such an operation waits for the switch, which has moved on: it fails
    after ``op_timeout_s``. Default 256 MiB."""
    threads: int | None = None
    """I/O threads a rank drives its job with (``transport/parallel.py``; each a part of the job,
    ``protocol/parts.py``); every rank of a job must use the same. None: chosen from the link's
    rate (one on loopback and virtual links). ``SWITCHML_THREADS`` overrides it in the torch
    backend."""

    def __post_init__(self) -> None:
        _check_types(self)
        _check(self.min_reorder_window_s >= 0,
               f"min_reorder_window_s must be >= 0, got {self.min_reorder_window_s}")
        _check(self.keepalive_s > 0, f"keepalive_s must be > 0, got {self.keepalive_s}")
        _check(self.max_restarts >= 0, f"max_restarts must be >= 0, got {self.max_restarts}")
        _check(self.min_rto_srtts >= 1.0,
               f"min_rto_srtts must be >= 1 (round trips), got {self.min_rto_srtts}")
        _check(0 < self.min_rto_s <= self.initial_rto_s <= self.max_rto_s,
               "expected 0 < min_rto_s <= initial_rto_s <= max_rto_s, got "
               f"{self.min_rto_s}, {self.initial_rto_s}, {self.max_rto_s}")
        _check(self.op_timeout_s > self.max_rto_s,
               f"op_timeout_s ({self.op_timeout_s}) must exceed max_rto_s ({self.max_rto_s}) so "
               "that a chunk is retried before the operation gives up")
        _check(self.join_timeout_s > 0, f"join_timeout_s must be > 0, got {self.join_timeout_s}")
        _check(self.max_reorder_scale >= 1,
               f"max_reorder_scale must be >= 1, got {self.max_reorder_scale}")
        _check(0 < self.control_retry_s <= self.control_retry_max_s,
               "expected 0 < control_retry_s <= control_retry_max_s, got "
               f"{self.control_retry_s}, {self.control_retry_max_s}")
        _check(self.threads is None or 1 <= self.threads <= MAX_THREADS,
               f"threads must be None or an integer in 1..{MAX_THREADS}, got {self.threads!r}")
        _check(self.quorum_keep_bytes >= 0,
               f"quorum_keep_bytes must be an integer >= 0, got {self.quorum_keep_bytes!r}")
        _check(self.job_key is None or len(self.job_key) == 32,
               "job_key must be the 32 bytes `switchml job-key` prints (as hex)")
        _check(self.tenant_key is None or len(self.tenant_key) == 32,
               "tenant_key must be the 32 bytes `switchml job-key --tenant` prints (as hex)")
        _check(sum(k is not None for k in (self.secret, self.job_key, self.tenant_key)) <= 1,
               "give one of the switch's secret, a job key or a tenant key, not several")
        _check(self.leave_timeout_s > 0, f"leave_timeout_s must be > 0, got "
               f"{self.leave_timeout_s}")
