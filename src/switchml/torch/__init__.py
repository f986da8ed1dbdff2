"""PyTorch integration: ``import switchml.torch`` registers the "switchml" backend.

See :mod:`switchml.torch.backend` for the backend (its tensors' staging in
:mod:`~switchml.torch.staging`, its ``Work`` in :mod:`~switchml.torch.works`, the switch rank 0
starts in :mod:`~switchml.torch.embedded`), :mod:`switchml.torch.hooks` for DDP communication
hooks, :mod:`switchml.torch.hybrid` for Poseidon-style hybrid data parallelism.
"""

from switchml.torch.backend import (
    SwitchMLProcessGroup,
    dump_flight_records,
    flight_records,
    new_quorum_group,
    register,
    stats,
    stop_embedded_switch,
)
from switchml.torch.hybrid import HybridDataParallel, LayerDecision

register()

__all__ = ["HybridDataParallel", "LayerDecision", "SwitchMLProcessGroup", "dump_flight_records",
           "flight_records", "new_quorum_group", "register", "stats", "stop_embedded_switch"]
