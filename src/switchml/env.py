"""Every environment variable switchml reads, in one place, read only at the edges.

Libraries take parameters; only entry points read the environment and pass what they found:
the ``switchml`` command (``cli/``: every flag's default may come from ``SWITCHML_<FLAG>``;
``service.py`` reads ``SWITCHML_SECRET`` for the switch it launches when no secret file is given),
torch group creation (``torch/backend.py``, ``torch/hooks.py``), the torchrun roles of the
parameter servers (``ps/roles.py``) and the processes the testbed starts
(``bench/nsproc.py``).

| variable | meaning |
|---|---|
| ``SWITCHML_SWITCH`` | ``HOST:PORT`` of the switch (comma-separated: a sharded switch) |
| ``SWITCHML_SECRET`` | the switch's secret: JOIN and LEAVE are proven with a key derived from it |
| ``SWITCHML_JOB_KEY`` | one job's key instead (``switchml job-key``; ``WorkerConfig.job_key``) |
| ``SWITCHML_TENANT`` | torch: draw groups' job ids from this tenant's range |
| ``SWITCHML_TENANT_KEY`` | its key instead of the secret (``switchml job-key --tenant``) |
| ``SWITCHML_MTU`` | the path MTU to size chunks for (default: the route's) |
| ``SWITCHML_WINDOW`` | slots per job (default: from the chunk size) |
| ``SWITCHML_ELEMENTS_PER_PACKET`` | the chunk size outright |
| ``SWITCHML_THREADS`` | torch: I/O threads per rank (default: from the link's rate) |
| ``XDG_CACHE_HOME`` | where ``switchml calibrate`` keeps this machine's costs (``~/.cache``) |
| ``LOCAL_WORLD_SIZE`` | torch (set by torchrun): ranks on this machine, which share its cores |
| ``SWITCHML_HALF_BITS`` | torch: wire bits of float16/bfloat16 all-reduces (auto, 16, 32) |
| ``SWITCHML_QUORUM`` | torch: the default group's quorum k (rounds complete with k ranks) |
| ``SWITCHML_AUTH_DATA`` | torch: ``1``: groups' jobs authenticate their data plane (rank 0's) |
| ``SWITCHML_GSO`` | ``0`` turns UDP GSO/GRO and recvmmsg batching off |
| ``SWITCHML_DC`` | this worker's data centre, by index (Gaia: ``switchml.gaia.connect``) |
| ``SWITCHML_DC_LEADERS`` | the data centres' leaders, ``host:port,...`` in index order (Gaia) |
| ``SWITCHML_PS_HOST`` | the address a parameter-server rank announces |
| ``SWITCHML_STALL_LOG_S`` | torch: log what a rank waits for after this long in a collective (30) |
| ``SWITCHML_FLIGHT_SIGNAL`` | torch: a signal (e.g. ``USR1``) dumping recent collectives |
| ``SWITCHML_TLS_DIR`` | TLS credentials of the parameter-server and Gaia links (``links.py``) |
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from switchml.protocol.address import Address, parse_addresses
from switchml.protocol.errors import ConfigError

if TYPE_CHECKING:
    from switchml.links import LinkSecurity

__all__ = ["batching", "cache_dir", "dc_index", "dc_leaders", "elements_per_packet", "flag_default",
           "flight_signal", "half_bits", "half_bits_text", "link_security", "mtu", "ps_host",
           "local_world_size", "secret", "stall_log_s", "switch_addresses", "threads", "window"]


def _get(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None


def _int(name: str) -> int | None:
    value = _get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _nonnegative(name: str, what: str) -> float | None:
    """A number >= 0 from ``name`` (None where unset); ``what`` says its unit in the error."""
    value = (_get(name) or "").strip()
    if not value:
        return None
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(f"{name} must be {what} >= 0, got {value!r}")
    return number


def flag_default(dest: str, default: object) -> object:
    """``SWITCHML_<DEST>`` (a flag's default for the ``switchml`` command), else ``default``."""
    return os.environ.get(f"SWITCHML_{dest.upper()}", default)


def switch_addresses() -> Address | list[Address] | None:
    """``SWITCHML_SWITCH``: one address, the list of a sharded switch's shards, or None.

    Raises:
        ConfigError: it is set but not ``HOST:PORT[,HOST:PORT...]``.
    """
    text = _get("SWITCHML_SWITCH")
    if text is None:
        return None
    addrs = parse_addresses(text, what="SWITCHML_SWITCH")
    return addrs[0] if len(addrs) == 1 else addrs


def secret() -> bytes | None:
    """``SWITCHML_SECRET``, as bytes."""
    value = _get("SWITCHML_SECRET")
    return value.encode() if value is not None else None


def job_key() -> bytes | None:
    """``SWITCHML_JOB_KEY``: one job's key (``switchml job-key``), as bytes.

    Raises:
        ConfigError: it is not 64 hex digits.
    """
    return _hex_key("SWITCHML_JOB_KEY", "`switchml job-key`")


def _hex_key(name: str, printer: str) -> bytes | None:
    """A 32-byte key given as 64 hex digits in ``name`` (None: unset); ConfigError naming
    ``printer``, the command that prints it, otherwise."""
    value = _get(name)
    if value is None:
        return None
    try:
        key = bytes.fromhex(value)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise ConfigError(f"{name} must be the 64 hex digits {printer} prints")
    return key


def tenant() -> int | None:
    """``SWITCHML_TENANT``: the tenant whose range of job ids new jobs are drawn from.

    Raises:
        ConfigError: not a whole number in 0 .. ``auth.MAX_TENANT``.
    """
    from switchml.protocol.auth import MAX_TENANT
    value = _get("SWITCHML_TENANT")
    if value is None:
        return None
    if not value.isdigit() or int(value) > MAX_TENANT:
        raise ConfigError(f"SWITCHML_TENANT must be a tenant number in 0..{MAX_TENANT}, got "
                          f"{value!r}")
    return int(value)


def tenant_key() -> bytes | None:
    """``SWITCHML_TENANT_KEY``: a tenant's key (``switchml job-key --tenant``), as bytes;
    it needs ``SWITCHML_TENANT``, the tenant it is the key of.

    Raises:
        ConfigError: not 64 hex digits, or SWITCHML_TENANT unset.
    """
    key = _hex_key("SWITCHML_TENANT_KEY", "`switchml job-key --tenant`")
    if key is None:
        return None
    if tenant() is None:
        raise ConfigError("SWITCHML_TENANT_KEY needs SWITCHML_TENANT, the tenant it is the key "
                          "of (its jobs' ids are drawn from that tenant's range)")
    return key


def link_security() -> LinkSecurity | None:
    """``SWITCHML_TLS_DIR``: the parameter-server and Gaia links' TLS credentials, or None.

    Raises:
        ConfigError: the directory lacks a file or the files do not load.
    """
    from switchml.links import LinkSecurity
    value = _get("SWITCHML_TLS_DIR")
    return LinkSecurity.from_dir(value) if value else None


def stall_log_s() -> float | None:
    """``SWITCHML_STALL_LOG_S``: seconds > 0 after which a collective that has not finished
    is logged; None where unset.

    Raises:
        ValueError: not a number of seconds > 0."""
    seconds = _nonnegative("SWITCHML_STALL_LOG_S", "a number of seconds")
    if seconds == 0:
        raise ValueError("SWITCHML_STALL_LOG_S must be a number of seconds > 0, got '0'")
    return seconds


def flight_signal() -> str | None:
    """``SWITCHML_FLIGHT_SIGNAL``: a signal name, e.g. ``USR1``."""
    return _get("SWITCHML_FLIGHT_SIGNAL")


def mtu() -> int | None:
    """``SWITCHML_MTU``."""
    return _int("SWITCHML_MTU")


def window() -> int | None:
    """``SWITCHML_WINDOW``."""
    return _int("SWITCHML_WINDOW")


def elements_per_packet() -> int | None:
    """``SWITCHML_ELEMENTS_PER_PACKET``."""
    return _int("SWITCHML_ELEMENTS_PER_PACKET")


def half_bits_text() -> str:
    """``SWITCHML_HALF_BITS`` as written (lower case, stripped), unchecked; "" where unset."""
    return (_get("SWITCHML_HALF_BITS") or "").strip().lower()


def half_bits() -> int | None:
    """``SWITCHML_HALF_BITS``: 16 or 32; None for ``auto`` (the default)."""
    value = half_bits_text() or "auto"
    if value not in ("auto", "16", "32"):
        raise ValueError(f"SWITCHML_HALF_BITS must be auto, 16 or 32, got {value!r}")
    return None if value == "auto" else int(value)


def failover() -> str:
    """``SWITCHML_FAILOVER``: ``gloo`` (a torch group whose switch stops answering goes on
    over gloo) or ``off`` (the default: its collectives fail, naming the switch)."""
    value = (_get("SWITCHML_FAILOVER") or "off").strip().lower()
    if value in ("", "0", "no", "none", "off"):
        return "off"
    if value != "gloo":
        raise ValueError(f"SWITCHML_FAILOVER must be gloo or off, got {value!r}")
    return value


def failover_probe_s() -> float:
    """``SWITCHML_FAILOVER_PROBE_S``: how often a group that failed over to gloo asks whether
    its switch is back (rank 0 joins a fresh job there; default 10 s; 0: never go back)."""
    seconds = _nonnegative("SWITCHML_FAILOVER_PROBE_S", "seconds")
    return 10.0 if seconds is None else seconds


def failover_keep_bytes() -> int | None:
    """``SWITCHML_FAILOVER_KEEP_MB``: how many MiB of its latest results a rank keeps for
    peers that missed them when the switch died (at least the latest all-reduce's are
    kept); None where unset (the backend's default)."""
    mib = _nonnegative("SWITCHML_FAILOVER_KEEP_MB", "a number of MiB")
    return None if mib is None else int(mib * 2**20)


def quorum() -> int | None:
    """``SWITCHML_QUORUM``: a positive integer (the torch default group's ``JobSpec.quorum``),
    or None where unset or ``all``."""
    value = (_get("SWITCHML_QUORUM") or "").strip().lower()
    if value in ("", "all", "none"):
        return None
    try:
        k = int(value)
    except ValueError:
        k = 0
    if k < 1:
        raise ValueError(f"SWITCHML_QUORUM must be a positive integer (or all), got {value!r}")
    return k


def auth_data() -> bool:
    """``SWITCHML_AUTH_DATA``: ``1``/``yes``/``on``/``true`` makes a torch group's switch job
    authenticate its data plane (``JobSpec.auth_data``); ``0`` or unset: not."""
    value = (_get("SWITCHML_AUTH_DATA") or "0").strip().lower()
    if value in ("0", "no", "off", "false"):
        return False
    if value in ("1", "yes", "on", "true"):
        return True
    raise ValueError(f"SWITCHML_AUTH_DATA must be 1 or 0, got {value!r}")


def batching() -> bool:
    """False where ``SWITCHML_GSO`` says ``0``/``no``/``off``/``false``."""
    return os.environ.get("SWITCHML_GSO", "1").lower() not in ("0", "no", "off", "false")


def fast_path() -> bool:
    """False where ``SWITCHML_FASTPATH`` says ``0``/``no``/``off``/``false``: the worker's
    compiled receive-and-send loop is off (``transport/fastpath.py``; for comparison)."""
    return os.environ.get("SWITCHML_FASTPATH", "1").lower() not in ("0", "no", "off", "false")


def dc_index() -> int | None:
    """``SWITCHML_DC``: this data centre's index (Gaia)."""
    return _int("SWITCHML_DC")


def dc_leaders() -> list[str]:
    """``SWITCHML_DC_LEADERS``: the data centres' leaders, in index order (Gaia)."""
    return [a.strip() for a in (_get("SWITCHML_DC_LEADERS") or "").split(",") if a.strip()]


def ps_host() -> str | None:
    """``SWITCHML_PS_HOST``."""
    return _get("SWITCHML_PS_HOST")


def threads() -> int | None:
    """``SWITCHML_THREADS``: I/O threads per rank (``transport/parallel.py``), or None."""
    return _int("SWITCHML_THREADS")


def local_world_size() -> int | None:
    """``LOCAL_WORLD_SIZE`` (torchrun's): the ranks on this machine, or None."""
    return _int("LOCAL_WORLD_SIZE")


def cache_dir() -> str:
    """``XDG_CACHE_HOME``, else ``~/.cache``: where switchml keeps machine-local files."""
    return _get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
