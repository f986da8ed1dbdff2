"""Discrete-event simulation of switchml at scale (``switchml sim``, docs/simulator.md).

``config`` (what to simulate), ``timing`` (the vectorised protocol model, no payloads),
``exact`` (the real endpoints on simulated links), ``cluster`` (a two-level tree of real
endpoints on any fabric), ``run`` (sweeps, tables, JSON, plots, testbed comparison).
"""
