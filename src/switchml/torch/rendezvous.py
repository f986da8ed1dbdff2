"""How the ranks of a group agree on things before their switch job exists: one interface, two
carriers. A "switchml" group created by torch has a store (:class:`StoreExchange`); a DDP hook
on any other group has only that group's collectives (:class:`GroupExchange`). What they agree
on (the switch, ``embedded.resolve_switch``; the job, ``jobspec.agree_on_job``) is written once
over :class:`Exchange`.

Values are text. Every rank calls the same methods in the same order (each is a collective).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch.distributed as dist

__all__ = ["Exchange", "GroupExchange", "StoreExchange"]


class Exchange(Protocol):
    """Rank 0's word, and every rank's, among ``size`` ranks."""

    rank: int
    size: int

    def share(self, name: str, value: str | None) -> str:
        """Rank 0's ``value`` (the others pass None), on every rank."""
        ...

    def gather(self, name: str, value: str) -> list[str]:
        """Every rank's ``value``, in rank order, on every rank."""
        ...


class StoreExchange:
    """Through a c10d store, under keys ``prefix/name`` (and ``prefix/name/rank``)."""

    def __init__(self, store: Any, prefix: str, rank: int, size: int) -> None:
        self.store, self.prefix, self.rank, self.size = store, prefix, rank, size

    def share(self, name: str, value: str | None) -> str:
        key = f"{self.prefix}/{name}"
        if self.rank == 0:
            if value is None:
                raise ValueError(f"rank 0 must share a value for {name!r}")
            self.store.set(key, value)
            return value
        return self.store.get(key).decode()

    def gather(self, name: str, value: str) -> list[str]:
        self.store.set(f"{self.prefix}/{name}/{self.rank}", value)
        return [self.store.get(f"{self.prefix}/{name}/{r}").decode() for r in range(self.size)]


class GroupExchange:
    """Through a process group's own object collectives (``broadcast_object_list`` and
    ``all_gather_object``), for groups of any backend."""

    def __init__(self, pg: dist.ProcessGroup) -> None:
        self.pg = pg
        self.rank, self.size = dist.get_rank(pg), dist.get_world_size(pg)

    def share(self, name: str, value: str | None) -> str:
        if self.rank == 0 and value is None:
            raise ValueError(f"rank 0 must share a value for {name!r}")
        box: list[Any] = [value if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.pg, 0), group=self.pg)
        return _text(name, box[0])

    def gather(self, name: str, value: str) -> list[str]:
        values: list[Any] = [None] * self.size
        dist.all_gather_object(values, value, group=self.pg)
        return [_text(name, v) for v in values]


def _text(name: str, value: Any) -> str:
    """A value the ranks exchanged, which must be text (a rank that called another exchange,
    or none, sends something else)."""
    if not isinstance(value, str):
        raise RuntimeError(f"the group's ranks disagree about {name!r}: got {value!r} where text "
                           "was expected (do all ranks set the same SWITCHML_SWITCH?)")
    return value
