"""Gaia's Approximate Synchronous Parallel across data centres (Hsieh et al., NSDI'17).

Synchronous training inside each data centre; between them only significant updates travel
(:class:`SignificanceFilter`), with a selective barrier (:class:`SelectiveBarrier`) and a mirror
clock bounding staleness (:class:`MirrorClock`); :mod:`.rules` holds these rules without I/O,
:class:`Mirror` links the data centres' leaders over TCP, :class:`GaiaSync` drives a PyTorch
model, and :func:`connect` sets that up in a training loop from the environment
(``gaia/api.py``). See docs/geo.md.
"""

from switchml.gaia.api import GaiaJob, connect
from switchml.gaia.mirror import GaiaError, Mirror
from switchml.gaia.rules import (
    MirrorClock,
    SelectiveBarrier,
    SignificanceFilter,
    parse_dc_layout,
    significance_threshold,
)
from switchml.gaia.trainer import GaiaSync

__all__ = ["GaiaError", "GaiaJob", "GaiaSync", "Mirror", "MirrorClock", "SelectiveBarrier",
           "SignificanceFilter", "connect", "parse_dc_layout", "significance_threshold"]
