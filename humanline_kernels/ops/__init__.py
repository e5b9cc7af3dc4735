"""The kernels, one folder per op family, each kernel beside its eager twin:

* :mod:`.logprobs` -- selected-token log-probs (online softmax) and their backward, the loss backward;
* :mod:`.token_terms` -- per-token humanline terms (clipped log-ratio, GRPO term) in the log-prob pass;
* :mod:`.finalize` -- the ``[B, T]`` tail of each loss: sums, loss, metrics, row weights, in one launch;
* :mod:`.linear` -- the chunked lm_head driver of :mod:`humanline_kernels.fused_linear`;
* :mod:`.constants` -- the constants every layer shares.

``kernel.py`` in a folder holds the Triton kernels and their launchers; each launcher is also a ``torch.library``
custom op (namespace ``humanline``) that writes into preallocated outputs, so ``torch.compile`` traces it and it
needs no fake implementation. ``eager.py`` is the plain-PyTorch twin of the same signature (the CPU path of
the log-probs; the per-op oracle of the tests for the others). A call decides once, in its public function,
between the kernels and the eager path: :func:`use_kernels`. Kernel modules import Triton; this one does not.
"""
from __future__ import annotations

import importlib.util
import os

import torch

_JIT = None  # the ops._jit module once triton imported, False when it cannot


def triton_available() -> bool:
    global _JIT
    if _JIT is None:
        try:
            from . import _jit  # imports triton
            _JIT = _jit
        except Exception:  # pragma: no cover - triton missing or broken
            _JIT = False
    return _JIT is not False


# CPU tensors take the interpreted kernels when TRITON_INTERPRET=1 (read at call time); while the variable is unset,
# this default decides. A GPU machine's test suite sets it instead of the variable, which would also make Triton
# build other libraries' kernels (Inductor's, Liger's) as interpreted ones.
INTERPRET_CPU_DEFAULT = False

_NUMPY = importlib.util.find_spec("numpy") is not None  # looked up once: torch.compile cannot trace find_spec


def _numpy_available() -> bool:
    return _NUMPY


def _triton_device(t: torch.Tensor) -> bool:
    """Whether ``t``'s device runs the Triton kernels: compiled for CUDA tensors, interpreted for CPU tensors under
    ``TRITON_INTERPRET=1`` (see :mod:`._jit`)."""
    if not triton_available():
        return False
    if t.device.type in _JIT.COMPILED_DEVICES:
        return True
    if t.device.type != "cpu":
        return False
    flag = os.environ.get("TRITON_INTERPRET")
    if flag is None:
        return INTERPRET_CPU_DEFAULT
    if flag == "1" and not _numpy_available():
        raise ModuleNotFoundError(
            "TRITON_INTERPRET=1 runs the Triton kernels in Triton's interpreter, which needs NumPy: "
            "pip install numpy (or unset TRITON_INTERPRET to use the eager CPU path)", name="numpy")
    return flag == "1"


def use_kernels(x: torch.Tensor, *logps) -> bool:
    """The one Triton-or-eager decision of a call: Triton for ``x``'s device (logits or hidden states) unless ``x``
    is fp64, and every log-prob input (``None`` allowed) fp32 -- fp64 inputs keep the eager path, which
    accumulates in fp64."""
    return (x.dtype != torch.float64 and all(t is None or t.dtype == torch.float32 for t in logps)
            and _triton_device(x))
