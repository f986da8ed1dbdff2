"""Where each parameter lives: round-robin by tensor over P servers, large tensors split.

TensorFlow's parameter servers place variables round-robin (``replica_device_setter``) and
partition a large variable into pieces (``fixed_size_partitioner``) so that no server carries a
huge table alone. Here: tensors are visited in model order; a tensor of more than
``max_shard_elements`` elements is cut into ``ceil(numel / max)`` near-equal contiguous pieces;
every piece (or whole tensor) goes to the next server in turn. Pure function of the tensor list,
so every worker computes the same placement without talking to anyone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from switchml.protocol.errors import ConfigError

__all__ = ["Shard", "format_placement", "place"]


@dataclass(frozen=True, slots=True)
class Shard:
    """A contiguous piece of one tensor (flattened), held by one server."""

    shard_id: int
    tensor: int
    """Index of the tensor in the model's parameter order."""
    name: str
    offset: int
    """First element of the piece in the flattened tensor."""
    numel: int
    server: int


def place(tensors: Sequence[tuple[str, int]], servers: int, *,
          max_shard_elements: int = 1 << 20) -> list[Shard]:
    """Place ``(name, numel)`` tensors on ``servers`` servers; returns the shards in order.

    Raises:
        ConfigError: no servers, a non-positive shard limit, or an empty tensor list.
    """
    if servers < 1:
        raise ConfigError(f"expected at least one parameter server, got {servers}")
    if max_shard_elements < 1:
        raise ConfigError(f"max_shard_elements must be >= 1, got {max_shard_elements}")
    if not tensors:
        raise ConfigError("nothing to place: the model has no parameters")
    shards: list[Shard] = []
    turn = 0
    for t, (name, numel) in enumerate(tensors):
        if numel < 1:
            raise ConfigError(f"tensor {name!r} has {numel} elements")
        pieces = -(-numel // max_shard_elements)
        base, extra = divmod(numel, pieces)
        offset = 0
        for p in range(pieces):
            size = base + (1 if p < extra else 0)
            shards.append(Shard(len(shards), t, name, offset, size, turn % servers))
            offset += size
            turn += 1
    return shards


def format_placement(shards: Sequence[Shard], servers: int) -> str:
    """A readable table: one line per shard, then the elements each server holds."""
    lines = [f"{'shard':>5}  {'server':>6}  {'elements':>10}  tensor[offset]"]
    for s in shards:
        lines.append(f"{s.shard_id:>5}  {s.server:>6}  {s.numel:>10}  {s.name}[{s.offset}:]")
    totals = [sum(s.numel for s in shards if s.server == i) for i in range(servers)]
    lines.append("per server: " + ", ".join(f"ps{i}={n}" for i, n in enumerate(totals)))
    return "\n".join(lines)
