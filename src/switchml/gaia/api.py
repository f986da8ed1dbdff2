"""Gaia in a PyTorch training loop: a few lines, configured like torchrun jobs are.

Each data centre runs an ordinary job (torchrun, DDP over switchml or gloo) on its own
machines; its rank 0 is the data centre's *leader*, which links to the other leaders. Every
rank of every data centre runs::

    import switchml.gaia
    dist.init_process_group("switchml")              # inside this data centre
    model = DistributedDataParallel(net)
    gaia = switchml.gaia.connect(net)                # SWITCHML_DC, SWITCHML_DC_LEADERS
    for x, y in data:
        loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
        gaia.after_step()                            # significant updates out, others' in
    gaia.finish()                                    # every remaining update, everywhere

Configuration (arguments win over the environment):

* ``SWITCHML_DC``: this data centre's index, 0 .. D - 1;
* ``SWITCHML_DC_LEADERS``: the leaders' ``host:port``, one per data centre, in index order (the
  same list everywhere); this data centre's leader listens on its own entry;
* ``SWITCHML_TLS_DIR``: mutual TLS between the leaders (``switchml tls init DIR``), required
  when a leader listens beyond loopback (data centres on other hosts);
* ``threshold`` (default 1%, Gaia's), ``decay`` (1/sqrt(t), default on), ``staleness`` (the
  mirror clock's bound, default 2).

Guarantees (docs/geo.md): inside a data centre, replicas stay identical after every step; a
data centre runs at most ``staleness`` clocks ahead of the slowest; after :meth:`finish`, every
replica everywhere holds every update made anywhere. A dead or silent data centre is an error
(``GaiaError``, naming it) within the mirror's timeout, never a hang.
"""

from __future__ import annotations

from typing import Any

from switchml.gaia.mirror import Mirror
from switchml.gaia.trainer import GaiaSync
from switchml.links import LinkSecurity
from switchml.protocol.address import parse_address
from switchml.protocol.errors import ConfigError

__all__ = ["GaiaJob", "connect"]


class GaiaJob(GaiaSync):
    """:class:`GaiaSync` that owns its leader's links: :meth:`finish` closes them."""

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.close()

    def close(self) -> None:
        """Close the leader's links (idempotent; ``finish`` does it)."""
        if self.mirror is not None:
            self.mirror.close()
            self.mirror = None

    def __enter__(self) -> GaiaJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _dc_from_env(dc: int | None, leaders: list[str] | None) -> tuple[int, list[str]]:
    from switchml import env
    if dc is None:
        dc = env.dc_index()
        if dc is None:
            raise ConfigError("which data centre is this? set SWITCHML_DC to its index "
                              "(0, 1, ...) or pass dc=")
    if leaders is None:
        leaders = env.dc_leaders()
        if not leaders:
            raise ConfigError("where are the data centres' leaders? set SWITCHML_DC_LEADERS "
                              "to host:port,host:port,... (one per data centre) or pass "
                              "leaders=")
    if len(leaders) < 2:
        raise ConfigError(f"Gaia needs at least 2 data centres, got {len(leaders)} leader(s)")
    if not 0 <= dc < len(leaders):
        raise ConfigError(f"data centre index {dc} is not in 0..{len(leaders) - 1} "
                          f"({len(leaders)} leaders)")
    return dc, leaders


def connect(model: Any, *, dc: int | None = None, leaders: list[str] | None = None,
            group: Any = None, threshold: float = 0.01, decay: bool = True,
            staleness: int = 2, timeout_s: float = 120.0, tls_dir: str | None = None,
            insecure: bool = False) -> GaiaJob:
    """Make ``model`` (the module itself, not its DDP wrapper) Gaia-synchronised with the
    other data centres; call on every rank of this data centre's ``group`` (default: the
    default group, or one process when torch.distributed is not initialised). The group's
    rank 0 is the leader: it listens at its entry of ``leaders`` and connects to the others,
    returning once every link is up.

    Raises:
        ConfigError: the data centre, its leaders or the TLS credentials are missing or wrong.
        GaiaError: a leader unreachable within ``timeout_s`` (named).
    """
    import torch.distributed as dist
    dc, leaders = _dc_from_env(dc, leaders)
    addresses = [parse_address(a, what=f"leader {i}") for i, a in enumerate(leaders)]
    lead = not dist.is_initialized() or dist.get_rank(group) == 0
    mirror = None
    if lead:
        from switchml import env
        security = LinkSecurity.from_dir(tls_dir) if tls_dir else env.link_security()
        mirror = Mirror(dc=dc, leaders=addresses, staleness=staleness, timeout_s=timeout_s,
                        bind_host=addresses[dc][0], security=security,
                        insecure=insecure).start()
    return GaiaJob(model, mirror=mirror, group=group, threshold=threshold, decay=decay)
