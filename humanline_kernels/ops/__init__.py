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


def logprobs_fwd(logits, labels, temperature, ignore_index, return_entropy):
    return eager.logprobs_fwd(logits, labels, temperature, ignore_index, return_entropy)


def logprobs_bwd(logits, labels, lse, grad_logp, temperature, ignore_index, out=None):
    return eager.logprobs_bwd(logits, labels, lse, grad_logp, temperature, ignore_index, out=out)
