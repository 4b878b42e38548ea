"""Lazy Triton import shared by the optimizer files.

Triton is optional: without it the optimizers run their plain-PyTorch path (``pip install -e .`` on a CPU machine
has no Triton; the CUDA builds of torch bring it). The format files define their Triton helpers at import time, so
when Triton is missing ``jit`` returns a placeholder that raises the install instruction only if someone actually
tries to launch it, and ``tl`` is a stand-in for what those definitions evaluate at import (``_NoTriton``).

On a machine without CUDA, Triton kernels still run under ``TRITON_INTERPRET=1`` (numpy-backed, slow,
small tensors only): that is how CI checks the kernel logic. The variable must be set before this module
is imported, because ``triton.jit`` picks the interpreter at decoration time.
"""

import os

try:  # pragma: no cover - exercised implicitly by every import
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - tests/optimizers/test_optimizer_contract.py runs it in a subprocess

    class _NoTriton:
        """Stands in for ``triton.language`` where Triton is missing. Defining a kernel helper evaluates its
        parameters' ``tl.constexpr`` annotations (unless its file has ``from __future__ import annotations``: Triton
        reads them, as objects or as strings), and the files wrap their kernel constants in ``tl.constexpr(...)``;
        that is all of ``tl`` that runs at import. Here ``constexpr`` returns its value, and anything else is
        missing loudly: the helpers' bodies never run (``jit`` gives placeholders)."""

        @staticmethod
        def constexpr(value=None):
            return value

    triton = None
    tl = _NoTriton()
    HAVE_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

INSTALL_HINT = "pip install triton (torch's CUDA builds bring it), or construct the optimizer with backend='torch'"


def jit(fn=None, **kwargs):
    """``triton.jit`` (also as ``@jit(do_not_specialize=...)``) when Triton is installed; otherwise a placeholder
    that fails when used."""
    if fn is None:
        return lambda f: jit(f, **kwargs)
    if HAVE_TRITON:
        return triton.jit(fn, **kwargs)

    def _missing(*args, **kwargs):
        raise RuntimeError(f"Triton is not installed: {INSTALL_HINT}")

    return _missing


def triton_usable(device: "torch.device") -> bool:  # noqa: F821
    """Whether the Triton path can run for tensors on ``device``."""
    if not HAVE_TRITON:
        return False
    if device.type == "cuda":
        return True
    # The interpreter runs CPU tensors; it is for tests, never picked automatically for speed.
    return device.type == "cpu" and INTERPRET
