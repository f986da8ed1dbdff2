"""Job set-up: create a job's shared spec and pass it to every rank.

How a job comes to life (documented in ``docs/protocol.md``, section Control):

1. One party (a launcher, rank 0, the benchmark) calls :func:`new_job_spec`: a random 32-bit job
   id and a random 64-bit token from the OS CSPRNG, plus n, the window W and the chunk size k.
2. It hands the spec to every rank, e.g. as the string of :func:`encode_job_spec` in an
   environment variable or through torch.distributed's store.
3. Every rank JOINs the switch: JOIN(job, rank, token, n, W, k) draws a challenge, and the
   JOIN that answers it proves a key derived from the switch's secret (``protocol/auth.py``).
   The first proven JOIN creates the job and allocates W slots; later ones must carry the same
   token and geometry. The switch records each rank's address; results go to those addresses.
4. When every rank has sent LEAVE, the job's slots return to the pool.
"""

from __future__ import annotations

import secrets

from switchml.protocol.config import JobSpec, default_window
from switchml.protocol.errors import ConfigError

__all__ = ["decode_job_spec", "encode_job_spec", "new_job_spec"]


def new_job_spec(num_workers: int, *, window: int | None = None,
                 elements_per_packet: int = 16000) -> JobSpec:
    """Return a JobSpec with a fresh random job id and an unguessable token.

    ``window``: slots in flight per worker; default ``default_window(elements_per_packet)``
    (about 256 KiB in flight: 128 slots for MTU-1500 chunks, 16 for 64 KB datagrams)."""
    return JobSpec(job_id=secrets.randbits(32), token=secrets.randbits(64),
                   num_workers=num_workers,
                   window=default_window(elements_per_packet) if window is None else window,
                   elements_per_packet=elements_per_packet)


def encode_job_spec(spec: JobSpec) -> str:
    """Encode as ``job_id:token:n:window:k`` (hex token), for environment variables, with
    ``:scale_workers`` appended when it is set."""
    text = (f"{spec.job_id}:{spec.token:016x}:{spec.num_workers}:{spec.window}:"
            f"{spec.elements_per_packet}")
    return text if spec.scale_workers is None else f"{text}:{spec.scale_workers}"


def decode_job_spec(text: str) -> JobSpec:
    """Inverse of :func:`encode_job_spec`; raises ConfigError with the reason."""
    parts = text.strip().split(":")
    if len(parts) not in (5, 6):
        raise ConfigError(f"expected job_id:token:n:window:k[:scale_workers], got {text!r}")
    try:
        job_id, n, window, k = int(parts[0]), int(parts[2]), int(parts[3]), int(parts[4])
        token = int(parts[1], 16)
        scale = int(parts[5]) if len(parts) == 6 else None
    except ValueError as exc:
        raise ConfigError(f"bad job spec {text!r}: {exc}") from exc
    return JobSpec(job_id=job_id, token=token, num_workers=n, window=window,
                   elements_per_packet=k, scale_workers=scale)
