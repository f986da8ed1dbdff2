"""switchml: in-network aggregation for distributed training.

A software implementation of SwitchML (Sapio et al., NSDI'21): a switch that keeps a pool of
integer aggregation slots, workers that stream their vectors through it in chunks, and the
fixed-point block-exponent numbers that make floats summable as integers.

Layers (imports point down only): ``protocol`` (sans-I/O core), ``transport`` (UDP and in-memory
pumps around the core), ``control`` (job registration helpers), ``service`` (switch launchers),
``torch``, ``bench``, ``cli``.
"""

from switchml.protocol.errors import (
    ConfigError,
    LocalProtocolError,
    OperationFailed,
    RemoteProtocolError,
    SwitchMLError,
    SwitchUnreachable,
    TransportError,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "LocalProtocolError",
    "OperationFailed",
    "RemoteProtocolError",
    "SwitchMLError",
    "SwitchUnreachable",
    "TransportError",
    "__version__",
]
