"""TensorFlow-style parameter servers as a PyTorch training mode.

Parameters are placed on P server processes (:mod:`.placement`: round-robin by tensor, large
tensors split); workers push gradients and pull parameters over a small framed TCP protocol
(:mod:`.wire`); the optimizer step runs on the servers (:mod:`.server`). Synchronous training
with backup workers, or asynchronous (:mod:`.rules`). :class:`PSTrainer` drives a model;
``switchml ps`` starts servers and workers. See docs/geo.md.
"""

from switchml.ps.client import PSClient
from switchml.ps.placement import Shard, format_placement, place
from switchml.ps.roles import PSRole, torchrun_role
from switchml.ps.server import ParameterServer, ServerConfig
from switchml.ps.trainer import PSTrainer, model_digest
from switchml.ps.wire import PSError

__all__ = ["PSClient", "PSError", "PSRole", "PSTrainer", "ParameterServer", "ServerConfig",
           "Shard", "format_placement", "model_digest", "place", "torchrun_role"]
