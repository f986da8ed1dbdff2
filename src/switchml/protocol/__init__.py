"""Sans-I/O protocol core: wire format, switch dataplane, worker stream, quantization.

Nothing here opens a socket, reads a clock, sleeps, starts a thread or draws from a global RNG:
datagrams and ``now`` go in, datagrams and deadlines come out (``tests/protocol/test_layering.py``
enforces the import rule).
"""
