"""Argument checks shared by every input level (reference, losses, fused, fused_linear).

Each check raises ``ValueError`` naming the argument and what was expected, before any work is done. None of
them syncs with the device: they read shapes, dtypes and devices, and the one value check,
:func:`check_label_range`, is a device-side assert on accelerators (callers skip it with ``validate=False``).
"""
from __future__ import annotations

import math

import torch

from ._clip import HumanlineClip

LOSS_TYPES = ("dapo", "bnpo", "grpo", "dr_grpo")
LOGITS_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
LOGP_DTYPES = (torch.float32, torch.float64)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_tensor(name, t, *, ndim=None, dtypes=None, shape=None, device=None):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {_shape(t)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {_shape(t)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({allowed}), got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on device {device} like the other inputs, got {t.device}")
    return t


def check_clip(clip):
    if clip is not None and not isinstance(clip, HumanlineClip):
        raise ValueError(f"clip must be a humanline_kernels.HumanlineClip or None, got {type(clip).__name__}")


def check_real(name, v, *, low=None, high=None, low_open=False):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite real number, got {v!r}")
    if low is not None and (v < low or (low_open and v == low)):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {v}")
    if high is not None and v > high:
        raise ValueError(f"{name} must be <= {high}, got {v}")


def check_logps(logps, ref_logps, mask, *, prefix=""):
    """``[B, T]`` float32/64 log-probs, reference of the same shape and dtype, bool mask of the same shape."""
    check_tensor(prefix + "logps", logps, ndim=2, dtypes=LOGP_DTYPES)
    dev = logps.device
    check_tensor(prefix + "ref_logps", ref_logps, shape=logps.shape, dtypes=(logps.dtype,), device=dev)
    check_tensor(prefix + "mask", mask, shape=logps.shape, dtypes=(torch.bool,), device=dev)


def check_ref_logps(ref_logps, labels, name="ref_logps"):
    """Reference log-probs given next to logits: shaped like ``labels``, float32/64, same device."""
    check_tensor(name, ref_logps, shape=labels.shape, dtypes=LOGP_DTYPES, device=labels.device)


def check_common(*, clip, beta=None, temperature=None):
    check_clip(clip)
    if beta is not None:
        check_real("beta", beta, low=0.0)
    if temperature is not None:
        check_real("temperature", temperature, low=0.0, low_open=True)


def check_grpo_args(B, device, advantages, *, epsilon_low, epsilon_high, loss_type, normalizer,
                    max_completion_length):
    check_tensor("advantages", advantages, shape=(B,), device=device)
    if not advantages.is_floating_point():
        raise ValueError(f"advantages must be a floating-point tensor, got {advantages.dtype}")
    check_real("epsilon_low", epsilon_low, low=0.0, high=1.0)
    check_real("epsilon_high", epsilon_high, low=0.0)
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if normalizer is not None:
        if isinstance(normalizer, torch.Tensor):
            if normalizer.numel() != 1:
                raise ValueError(f"normalizer must be a number or a 1-element tensor, got shape {_shape(normalizer)}")
            if normalizer.device != device:
                raise ValueError(f"normalizer must be on device {device}, got {normalizer.device}")
        else:
            check_real("normalizer", normalizer, low=0.0, low_open=True)
        if loss_type not in ("dapo", "bnpo"):
            raise ValueError(f"normalizer applies to loss_type 'dapo' or 'bnpo' only, got loss_type={loss_type!r}")
    if max_completion_length is not None:
        if isinstance(max_completion_length, bool) or not isinstance(max_completion_length, int) \
                or max_completion_length <= 0:
            raise ValueError(f"max_completion_length must be a positive int or None, got {max_completion_length!r}")


def check_dpo_rows(B):
    if B == 0 or B % 2:
        raise ValueError(
            f"DPO expects an even, non-zero number of rows (chosen rows 0..P-1, rejected rows P..2P-1), got {B}"
        )


def check_dpo_args(label_smoothing):
    check_real("label_smoothing", label_smoothing, low=0.0, high=0.5)


def check_kto_args(B, device, desirable, kl_logps, kl_ref_logps, kl_mask, *, desirable_weight,
                   undesirable_weight):
    check_tensor("desirable", desirable, shape=(B,), dtypes=(torch.bool,), device=device)
    given = [x is not None for x in (kl_logps, kl_ref_logps, kl_mask)]
    if any(given) and not all(given):
        raise ValueError("kl_logps, kl_ref_logps and kl_mask must be given together (or all None)")
    if all(given):
        check_tensor("kl_logps", kl_logps, ndim=2, dtypes=LOGP_DTYPES, device=device)
        check_tensor("kl_ref_logps", kl_ref_logps, shape=kl_logps.shape, dtypes=(kl_logps.dtype,), device=device)
        check_tensor("kl_mask", kl_mask, shape=kl_logps.shape, dtypes=(torch.bool,), device=device)
    check_real("desirable_weight", desirable_weight, low=0.0)
    check_real("undesirable_weight", undesirable_weight, low=0.0)


def check_logits_labels(logits, labels, *, ignore_index):
    """``logits [..., V]`` with a contiguous last dimension, ``labels [...]`` int64 on the same device."""
    check_tensor("logits", logits, dtypes=LOGITS_DTYPES)
    if logits.dim() < 2:
        raise ValueError(f"logits must have shape [..., V] with at least 2 dimensions, got {_shape(logits)}")
    if logits.shape[-1] == 0:
        raise ValueError("logits must have a non-empty last (vocabulary) dimension")
    if logits.stride(-1) != 1:
        raise ValueError(
            f"logits must have a contiguous last dimension (stride 1), got strides {tuple(logits.stride())}"
        )
    check_tensor("labels", labels, dtypes=(torch.int64,), device=logits.device)
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"labels must have shape {list(logits.shape[:-1])} (logits without V), got {_shape(labels)}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")


def check_label_range(labels, V, ignore_index):
    """Labels must lie in ``[0, V)`` or equal ``ignore_index``, checked without a host sync.

    CPU tensors: a ``ValueError`` right away (there is no device to wait for). CUDA tensors: an asynchronous
    device-side assert (``torch._assert_async``), so the check is CUDA-graph capturable and the host never waits; a
    bad label then fails at the next synchronisation with ``RuntimeError: CUDA error: device-side assert
    triggered`` (as ``torch.nn.functional.cross_entropy`` does) and the CUDA context is unusable afterwards.
    """
    msg = f"labels must lie in [0, {V}) or equal ignore_index={ignore_index}"
    ok = (((labels >= 0) & (labels < V)) | (labels == ignore_index)).all()
    if labels.device.type != "cpu":
        torch._assert_async(ok, msg)
        return
    try:
        torch._assert_async(ok, msg)
    except RuntimeError:
        bad = ((labels < 0) | (labels >= V)) & (labels != ignore_index)
        idx = bad.nonzero()[0].tolist()
        raise ValueError(f"{msg}; got {int(labels[tuple(idx)])} at index {idx}") from None
