"""Argument checks: one set per loss (``check_dpo``, ``check_kto``, ``check_grpo``) and one per input level
(``check_logps``, ``check_logits_loss``, ``check_linear_loss``), used by every level and by the reference.

Each check raises ``ValueError`` naming the argument and what was expected, before any work is done. None of
them syncs with the device: they read shapes, dtypes and devices, and the one value check,
:func:`check_label_range`, is a device-side assert on accelerators (callers skip it with ``validate=False``).
"""
from __future__ import annotations

import math

import torch

from ._clip import HumanlineClip
from .ops.constants import GRPO_LOSS_TYPES

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


def check_tokens(p):
    """``temperature`` and ``ignore_index`` of a :class:`~._params.Tokens` (or any params object)."""
    check_real("temperature", p.temperature, low=0.0, low_open=True)
    if isinstance(p.ignore_index, bool) or not isinstance(p.ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {p.ignore_index!r}")


def _check_loss(p):
    check_clip(p.clip)
    check_real("beta", p.beta, low=0.0)


# ------------------------------------------------------------------ one set of checks per loss, every level
def check_dpo(p, B):
    """DPO's options and rows (``2P``: chosen rows first, then their rejected partners)."""
    _check_loss(p)
    check_real("label_smoothing", p.label_smoothing, low=0.0, high=0.5)
    if B == 0 or B % 2:
        raise ValueError(
            f"DPO expects an even, non-zero number of rows (chosen rows 0..P-1, rejected rows P..2P-1), got {B}"
        )


def check_kto(p, B, device, inp):
    """KTO's options, ``desirable [B]`` bool and the optional KL rows (all three or none)."""
    _check_loss(p)
    check_tensor("desirable", inp.desirable, shape=(B,), dtypes=(torch.bool,), device=device)
    kl = (inp.kl_logps, inp.kl_ref_logps, inp.kl_mask)
    given = [x is not None for x in kl]
    if any(given) and not all(given):
        raise ValueError("kl_logps, kl_ref_logps and kl_mask must be given together (or all None)")
    if all(given):
        check_tensor("kl_logps", kl[0], ndim=2, dtypes=LOGP_DTYPES, device=device)
        check_tensor("kl_ref_logps", kl[1], shape=kl[0].shape, dtypes=(kl[0].dtype,), device=device)
        check_tensor("kl_mask", kl[2], shape=kl[0].shape, dtypes=(torch.bool,), device=device)
    check_real("desirable_weight", p.desirable_weight, low=0.0)
    check_real("undesirable_weight", p.undesirable_weight, low=0.0)


def check_grpo(p, shape, like, inp):
    """GRPO's options, ``advantages`` ``[B]`` (per sequence) or ``[B, T]`` (per token), ``kl_ref_logps`` (shaped and
    typed like ``like``, the reference log-probs) and the normalizer (a number in ``p``, or a 1-element tensor in
    ``inp``)."""
    _check_loss(p)
    adv = check_tensor("advantages", inp.advantages, device=like.device)
    if tuple(adv.shape) not in ((shape[0],), tuple(shape)):
        raise ValueError(f"advantages must have shape [{shape[0]}] (one per sequence) or {list(shape)} (one per "
                         f"token), got {_shape(adv)}")
    if not adv.is_floating_point():
        raise ValueError(f"advantages must be a floating-point tensor, got {adv.dtype}")
    if inp.kl_ref_logps is not None:
        check_tensor("kl_ref_logps", inp.kl_ref_logps, shape=shape, dtypes=(like.dtype,), device=like.device)
    check_real("epsilon_low", p.epsilon_low, low=0.0, high=1.0)
    check_real("epsilon_high", p.epsilon_high, low=0.0)
    if p.loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {GRPO_LOSS_TYPES}, got {p.loss_type!r}")
    norm = inp.normalizer
    if norm is not None:
        if norm.numel() != 1:
            raise ValueError(f"normalizer must be a number or a 1-element tensor, got shape {_shape(norm)}")
        if norm.device != like.device:
            raise ValueError(f"normalizer must be on device {like.device}, got {norm.device}")
    elif p.normalizer is not None:
        check_real("normalizer", p.normalizer, low=0.0, low_open=True)
    if (norm is not None or p.normalizer is not None) and p.loss_type not in ("dapo", "bnpo"):
        raise ValueError(f"normalizer applies to loss_type 'dapo' or 'bnpo' only, got loss_type={p.loss_type!r}")
    m = p.max_completion_length
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m <= 0):
        raise ValueError(f"max_completion_length must be a positive int or None, got {m!r}")


# ------------------------------------------------------------------ the inputs of each level
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


def check_logits(logits, labels, p, validate):
    """``logits [..., V]`` with a contiguous last dimension, ``labels [...]`` int64 on the same device, the
    options ``p`` (temperature, ignore_index) and, with ``validate``, the label range."""
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
    check_tokens(p)
    if validate:
        check_label_range(labels, logits.shape[-1], p.ignore_index)


def check_logits_loss(logits, labels, ref_logps, p, validate):
    """:func:`check_logits` for a loss: ``logits [B, T, V]``, ``ref_logps`` shaped like ``labels``, fp32/64."""
    check_logits(logits, labels, p, validate)
    if labels.dim() != 2:
        raise ValueError(f"labels must have shape [B, T] (logits [B, T, V]) for a loss, got {list(labels.shape)}")
    check_tensor("ref_logps", ref_logps, shape=labels.shape, dtypes=LOGP_DTYPES, device=labels.device)


def check_linear(hidden, weight, bias, labels, p, chunk_bytes, validate):
    """``hidden [..., D]``, ``weight [V, D]`` and ``bias [V]`` of one dtype and device, ``labels`` shaped like
    ``hidden`` without ``D``, the options ``p``, a positive ``chunk_bytes`` and, with ``validate``, the labels."""
    check_tensor("hidden", hidden, dtypes=LOGITS_DTYPES)
    if hidden.dim() < 2:
        raise ValueError(f"hidden must have shape [..., D] with at least 2 dimensions, got {_shape(hidden)}")
    D = hidden.shape[-1]
    check_tensor("weight", weight, ndim=2, dtypes=(hidden.dtype,), device=hidden.device)
    if weight.shape[1] != D:
        raise ValueError(f"weight must have shape [V, D] with D = hidden.shape[-1] = {D}, got {_shape(weight)}")
    if weight.shape[0] == 0:
        raise ValueError("weight must have a non-empty vocabulary dimension (shape [V, D] with V > 0)")
    if bias is not None:
        check_tensor("bias", bias, shape=(weight.shape[0],), dtypes=(hidden.dtype,), device=hidden.device)
    check_tensor("labels", labels, dtypes=(torch.int64,), device=hidden.device)
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"labels must have shape {list(hidden.shape[:-1])} (hidden without D), "
                         f"got {_shape(labels)}")
    check_tokens(p)
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    if validate:
        check_label_range(labels, weight.shape[0], p.ignore_index)


def check_linear_loss(hidden, weight, bias, labels, ref_logps, p, chunk_bytes, validate):
    """:func:`check_linear` for a loss: ``hidden [B, T, D]``, ``ref_logps`` shaped like ``labels``, fp32/64."""
    check_linear(hidden, weight, bias, labels, p, chunk_bytes, validate)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must have shape [B, T, D] for a loss, got {_shape(hidden)}")
    check_tensor("ref_logps", ref_logps, shape=labels.shape, dtypes=LOGP_DTYPES, device=labels.device)
