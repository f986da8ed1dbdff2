"""The compiled part of switchml: the data plane (src/switchml/csrc: the worker's, worker.c,
and the switch's, switch.c), plain C extensions built by pip with the system's C compiler
(``pip install -e .`` builds it in a few seconds; after an edit to the C source,
``python setup.py build_ext --inplace`` rebuilds it alone). Everything else is in pyproject.toml.

``SWITCHML_PORTABLE=1`` builds for any CPU of the architecture (a wheel to ship); by default
the build uses this machine's instruction set (``-march=native``: the quantize and dequantize
loops vectorize with it), as a local install should."""

import os

from setuptools import Extension, setup

flags = ["-O3", "-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wno-unused-function"]
if os.environ.get("SWITCHML_PORTABLE", "") not in ("1", "true", "yes"):
    flags.append("-march=native")

HEADERS = ["src/switchml/csrc/layout.h", "src/switchml/csrc/common.h"]
setup(ext_modules=[
    Extension(f"switchml._{name}", sources=[f"src/switchml/csrc/{name}.c"], depends=HEADERS,
              include_dirs=["src/switchml/csrc"], extra_compile_args=flags,
              libraries=["crypto"])
    for name in ("worker", "switch")])
