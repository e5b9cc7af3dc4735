"""The Triton kernels, one module per kernel family, each named for what it computes:

* :mod:`.logprobs` -- selected-token log-probs (online softmax), their backward (also a loss's backward), a row scale;
* :mod:`.token_terms` -- the per-token humanline terms (clipped log-ratio, GRPO's term) in the log-prob pass;
* :mod:`.dpo`, :mod:`.kto`, :mod:`.grpo` -- each loss's ``[B, T]`` tail (sums, loss, metrics, row weights): a launch
  after the row kernel, or folded into it, the forward in one launch (:mod:`.fold`: the counters and partial sums);
* :mod:`.sequence` -- the sequence-level primitive's per-row sums;
* :mod:`.common` -- the device functions and launch shapes they share, imported by name;
* :mod:`.kernels` -- every launcher under the names its eager twin shares (:mod:`humanline_kernels._eager`);
* :mod:`.linear` -- the pieces of the chunked lm_head loops of :mod:`humanline_kernels.fused_linear`;
* :mod:`.tuning` -- the per-card launch table; :mod:`.constants` -- the kernels' modes and layouts.

Each launcher is also a ``torch.library`` custom op (namespace ``humanline``) that writes into preallocated outputs,
so ``torch.compile`` traces it and it needs no fake implementation. A call decides once, in its public function,
between the kernels and the eager twins: :func:`use_kernels`. Kernel modules import Triton; this one, ``constants``,
``tuning`` and ``linear`` do not. Nothing here imports the package above ``ops``.
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
