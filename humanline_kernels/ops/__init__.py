"""Kernel dispatch: Triton for CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``), eager otherwise.

``logprobs_fwd`` / ``logprobs_bwd`` take canonical 3-D views ``logits [B, T, V]`` (last stride 1) and
``labels [B, T]``; see :mod:`humanline_kernels.ops.eager` for the math and the exact signatures.
"""
from __future__ import annotations

import os

import torch

from . import eager


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - triton missing or broken
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    """True when ``t`` should go through the Triton kernels."""
    if t.is_cuda:
        return triton_available()
    return t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and triton_available()


def _triton_ok(logits: torch.Tensor) -> bool:
    # fp64 has no Triton path (the eager one accumulates in fp64)
    return logits.dtype != torch.float64 and use_triton(logits)


def logprobs_fwd(logits, labels, temperature, ignore_index, return_entropy):
    """``(logp [B, T] fp32, lse [B, T] fp32, entropy [B, T] or None)`` of ``logits [B, T, V]`` / ``labels [B, T]``."""
    if _triton_ok(logits):
        from . import logprobs
        return logprobs.logprobs_fwd(logits, labels, temperature, ignore_index, return_entropy)
    return eager.logprobs_fwd(logits, labels, temperature, ignore_index, return_entropy)


def logprobs_bwd(logits, labels, lse, grad_logp, temperature, ignore_index, out=None):
    """``dlogits = g * (onehot - softmax) / temperature`` in the logits' dtype; into ``out`` (may be ``logits``)."""
    if _triton_ok(logits):
        from . import logprobs
        return logprobs.logprobs_bwd(logits, labels, lse, grad_logp, temperature, ignore_index, out=out)
    return eager.logprobs_bwd(logits, labels, lse, grad_logp, temperature, ignore_index, out=out)
