"""PyTorch integration: ``import switchml.torch`` registers the "switchml" backend.

See :mod:`switchml.torch.backend` for the backend and :mod:`switchml.torch.hooks` for DDP
communication hooks.
"""

from switchml.torch.backend import SwitchMLProcessGroup, register, stats, stop_embedded_switch

register()

__all__ = ["SwitchMLProcessGroup", "register", "stats", "stop_embedded_switch"]
