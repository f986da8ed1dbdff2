"""A job's work split over several I/O threads, as parts: pure rules, no threads.

One worker core carries about 4 Gbit/s of elements (docs/benchmarks.md), so a worker on a faster
link splits every operation over ``T`` **parts**, each driven by its own I/O thread with its own
socket (``transport/parallel.py``). Each part is a job of its own on the switch, with its share
of the window (:func:`part_window`); so the switch, the wire and every per-packet rule are
exactly those of a job with one thread (SwitchML's client splits its slots over worker threads
the same way).

What every rank must agree on, computed here from what they already share:

* :func:`part_specs`: part ``t``'s job (id, token, window). Part 0 *is* the job (its id and
  token), so ``T = 1`` is the job as before; the others' ids and tokens are derived from the
  job's token with BLAKE2b, so nobody without the token can name them.
* :func:`split`: which elements of an operation go to which part. Pieces start on block
  boundaries (a block: one datagram's elements at the operation's wire width), so every
  block, and with it every block exponent the switch agrees, is the same for any ``T``: the
  result is bit-identical to one thread's. An operation uses only as many parts as give each
  at least one window of blocks (small operations stay on part 0, where one thread's latency
  is lowest); every rank computes the same split from the size alone.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import replace

from switchml.protocol.auth import TENANT_JOBS
from switchml.protocol.config import MAX_THREADS, JobSpec
from switchml.protocol.errors import ConfigError

__all__ = ["MAX_THREADS", "MIN_PART_WINDOW", "PARTS_SLOTS", "block_elements", "check_threads",
           "part_specs", "part_window", "split"]

MIN_PART_WINDOW = 16
"""Slots a part keeps whatever ``T`` (the job's whole window when that is smaller): the floor
of ``config.default_window``. One thread needs its round trip covered at its own rate; on 16
cores (64 KB datagrams, a 16-slot job) 4 threads of 4 slots each all-reduced 3.1e8 elements/s,
of 16 each 6.6e8 (docs/results/multicore/README.md, run2).
"""
PARTS_SLOTS = 256
"""The most slots the floor gives a rank's parts together (``SwitchConfig.max_window``'s
default, what one job may hold): past 16 threads the floor shrinks, so that 64 threads of a
small job do not take a whole 1,024-slot pool."""


def check_threads(threads: object) -> None:
    """Raise ConfigError unless ``threads`` is an integer in 1..MAX_THREADS."""
    if not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise ConfigError(f"threads must be an integer in 1..{MAX_THREADS}, got {threads!r}")


def part_window(spec: JobSpec, threads: int) -> int:
    """Slots of each part: the job's window ``W`` shared out, but at least
    ``min(W, MIN_PART_WINDOW, floor(PARTS_SLOTS / T))``: ``max(floor(W / T), min(W, 16,
    floor(256 / T)))``. So a job holds up to ``T x 16`` slots of the switch's pool when
    ``W / T`` falls below 16, and never more than ``max(W, 256)`` (MTU 1500's default
    ``W = 128`` shares out to 16 at ``T = 8``, and holds 128 slots for any ``T``)."""
    check_threads(threads)
    floor = min(spec.window, MIN_PART_WINDOW, max(1, PARTS_SLOTS // threads))
    return max(spec.window // threads, floor)


def part_specs(spec: JobSpec, threads: int) -> list[JobSpec]:
    """The jobs of ``spec``'s ``threads`` parts; ``[spec]`` for one thread.

    Part ``t > 0`` gets job id and token from ``BLAKE2b(token, "part" | t)``, the id's top bit
    cleared (outside every tenant's range, ``auth.TENANT_JOBS``: a part's key derives from the
    switch's secret, and no tenant's quota counts it); every part gets
    ``part_window`` slots, the same ``num_workers``, chunk size and fixed-point scale.

    Raises:
        ConfigError: ``threads`` outside 1..MAX_THREADS.
    """
    check_threads(threads)
    if threads == 1:
        return [spec]
    window = part_window(spec, threads)
    specs = [replace(spec, window=window)]
    key = spec.token.to_bytes(8, "little")
    for t in range(1, threads):
        digest = hashlib.blake2b(b"switchml part" + struct.pack("<IH", spec.job_id, t),
                                 key=key, digest_size=12).digest()
        job_id, token = struct.unpack("<IQ", digest)
        specs.append(replace(spec, job_id=job_id & ~TENANT_JOBS, token=token, window=window))
    return specs


def block_elements(spec: JobSpec, bits: int = 32) -> int:
    """Elements per block (one datagram) at wire width ``bits``: ``k``, or ``2k`` at 16 bits
    (``protocol/operation.py``)."""
    if bits not in (16, 32):
        raise ConfigError(f"bits must be 16 or 32, got {bits!r}")
    return spec.elements_per_packet * 32 // bits


def split(size: int, spec: JobSpec, threads: int, bits: int = 32) -> list[tuple[int, int]]:
    """``[(start, stop), ...]``: the elements of an operation of ``size`` elements each part
    takes, in part order; only the parts in use (at least one: part 0, possibly empty).

    ``u = min(T, max(1, L // w))`` parts are used, for ``L`` blocks and a part window of
    ``w``; each takes ``ceil(L / u)`` blocks, the last what remains.
    """
    check_threads(threads)
    if size < 0:
        raise ConfigError(f"size must be >= 0, got {size}")
    k = block_elements(spec, bits)
    blocks = -(-size // k)
    used = min(threads, max(1, blocks // part_window(spec, threads)))
    per = -(-blocks // used) if blocks else 0
    bounds = []
    for t in range(used):
        start, stop = min(size, t * per * k), min(size, (t + 1) * per * k)
        if t == 0 or start < stop:
            bounds.append((start, stop))
    return bounds
