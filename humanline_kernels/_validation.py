"""Argument checks: one set per loss (``check_dpo``, ``check_kto``, ``check_grpo``) and one per input level
(``check_logps``, ``check_logits_loss``, ``check_linear_loss``), used by every level and by the reference.

Each check raises ``ValueError`` naming the argument and what was expected, before any work is done. None of
them syncs with the device: they read shapes, dtypes and devices, and the one value check,
:func:`check_label_range`, is a device-side assert on accelerators (callers skip it with ``validate=False``).
"""
from __future__ import annotations

import math

import torch

from . import _objectives
from ._clip import HumanlineClip
from ._params import GRPO_AGGREGATION, GRPO_LOSS_TYPES

LOGITS_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
LOGP_DTYPES = (torch.float32, torch.float64)


def shape_of(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_tensor(name, t, *, ndim=None, dtypes=None, shape=None, device=None):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {shape_of(t)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {shape_of(t)}")
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
def check_dpo_rows(B):
    """``2P`` rows: chosen rows first, then their rejected partners."""
    if B == 0 or B % 2:
        raise ValueError(
            f"DPO expects an even, non-zero number of rows (chosen rows 0..P-1, rejected rows P..2P-1), got {B}"
        )


def check_dpo(p, B, like, inp=None):
    """DPO's options (TRL 1.16's loss types, mixtures, RPO, f-divergences, LD-DPO, WPO) and rows; ``like`` is a
    ``[B, T]`` log-prob input (the shape WPO's ``log_sum_sq_probs`` must have). Returns the mixture
    ``(loss_types, weights)``."""
    _check_loss(p)
    check_dpo_rows(B)
    if (p.fast and p.f_alpha_divergence_coef == 0.5 and p.discopop_tau == 0.05
            and (inp is None or inp.log_sum_sq_probs is None)):  # DPO / cDPO, every other option at its default
        check_real("label_smoothing", p.label_smoothing, low=0.0, high=0.5)
        if p.loss_weights is not None:  # ((True,) == (1.0,): a bool weight reaches this branch)
            check_real("loss_weights", p.loss_weights[0])
        return ["sigmoid"], [1.0]
    return check_dpo_options(
        like, clip=p.clip, beta=p.beta, label_smoothing=p.label_smoothing, loss_type=p.loss_type,
        loss_weights=p.loss_weights, rpo_alpha=p.rpo_alpha, f_divergence_type=p.f_divergence_type,
        f_alpha_divergence_coef=p.f_alpha_divergence_coef, ld_alpha=p.ld_alpha, discopop_tau=p.discopop_tau,
        use_weighting=p.use_weighting, log_sum_sq_probs=None if inp is None else inp.log_sum_sq_probs)


def check_fused_dpo(p, types=None):
    """What the logits and hidden-state levels cannot compute of DPO's options, refused with the reason: WPO before
    :func:`check_dpo` (whose message names the log-prob level's ``log_sum_sq_probs``), with ``types`` (the checked
    mixture) "aot" with LD weights."""
    if types is None:
        check_flag("use_weighting", p.use_weighting)
        if p.use_weighting:
            raise ValueError("use_weighting=True (WPO) needs each token's log sum_v p_v^2, which the logits and "
                             "hidden-state levels do not compute: use hk.losses.dpo, which takes it as "
                             "log_sum_sq_probs (TRL's WPO input)")
        return
    if "aot" in types and p.ld_alpha is not None:
        raise ValueError("loss_type 'aot' with ld_alpha needs the policy's and the reference's own LD-weighted sums, "
                         "which the sequence-level kernels do not form: use hk.losses.dpo")


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
    check_kto_options(loss_type=p.loss_type, kl_estimate=p.kl_estimate, has_kl_rows=all(given))


def check_sequence(p):
    """The sequence-level primitive's options."""
    check_clip(p.clip)
    check_flag("normalize", p.normalize)


def check_ipo(p, B):
    check_dpo_rows(B)
    check_clip(p.clip)
    check_real("beta", p.beta, low=0.0, low_open=True)  # IPO divides by beta


def check_simpo(p, B):
    check_dpo_rows(B)
    _check_loss(p)
    check_real("gamma_beta_ratio", p.gamma_beta_ratio)


def check_slic(p, B):
    check_dpo_rows(B)
    _check_loss(p)
    check_real("lambda_coef", p.lambda_coef)


def check_grpo(p, shape, like, inp):
    """GRPO's options, ``advantages`` ``[B]`` (per sequence) or ``[B, T]`` (per token), ``kl_ref_logps`` (shaped and
    typed like ``like``, the reference log-probs) and the normalizer (a number in ``p``, or a 1-element tensor in
    ``inp``)."""
    _check_loss(p)
    adv = check_tensor("advantages", inp.advantages, device=like.device)
    if tuple(adv.shape) not in ((shape[0],), tuple(shape)):
        raise ValueError(f"advantages must have shape [{shape[0]}] (one per sequence) or {list(shape)} (one per "
                         f"token), got {shape_of(adv)}")
    if not adv.is_floating_point():
        raise ValueError(f"advantages must be a floating-point tensor, got {adv.dtype}")
    if inp.kl_ref_logps is not None:
        check_tensor("kl_ref_logps", inp.kl_ref_logps, shape=shape, dtypes=(like.dtype,), device=like.device)
    check_grpo_band(p.epsilon_low, p.epsilon_high)
    if p.loss_type not in GRPO_AGGREGATION:
        raise ValueError(f"loss_type must be one of {tuple(GRPO_AGGREGATION)}, got {p.loss_type!r}"
                         + (" (the kernels aggregate these; every TRL loss type runs from per-token log-probs, "
                            "hk.losses.grpo)" if p.loss_type in GRPO_LOSS_TYPES else ""))
    norm = inp.normalizer if inp.normalizer is not None else p.normalizer
    if norm is not None:
        _check_normalizer(norm, like.device)
    if norm is not None and p.loss_type not in ("dapo", "bnpo"):
        raise ValueError(f"normalizer applies to loss_type 'dapo' or 'bnpo' only, got loss_type={p.loss_type!r}")
    check_max_completion_length(p.max_completion_length)


def check_grpo_band(epsilon_low, epsilon_high):
    """GRPO's ratio band ``[1 - epsilon_low, 1 + epsilon_high]``, at every level."""
    check_real("epsilon_low", epsilon_low, low=0.0, high=1.0)
    check_real("epsilon_high", epsilon_high, low=0.0)


def check_max_completion_length(m):
    """"dr_grpo"'s fixed length: a positive int or None (the rows' width), at every level."""
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
    def where():
        bad = ((labels < 0) | (labels >= V)) & (labels != ignore_index)
        idx = bad.nonzero()[0].tolist()
        return f"; got {int(labels[tuple(idx)])} at index {idx}"

    device_check((((labels >= 0) & (labels < V)) | (labels == ignore_index)).all(),
                 f"labels must lie in [0, {V}) or equal ignore_index={ignore_index}", where)


def device_check(ok, msg, detail=None):
    """``ok`` (a 0-d bool tensor) or fail: a device-side assert on an accelerator (no host sync), a ``ValueError``
    with ``msg`` (and ``detail()``, computed only then) on the CPU."""
    if ok.device.type != "cpu":
        torch._assert_async(ok, msg)
        return
    try:
        torch._assert_async(ok, msg)
    except RuntimeError:
        raise ValueError(msg + (detail() if detail else "")) from None


def check_flags(**flags):
    """Each a bool: a string or a number would pass through ``bool()`` (``inplace_backward="no"`` writes into the
    logits, ``validate=None`` skips the checks)."""
    for name, v in flags.items():
        check_flag(name, v)


def check_logits(logits, labels, p, validate, **flags):
    """``logits [..., V]`` with a contiguous last dimension, ``labels [...]`` int64 on the same device, the
    options ``p`` (temperature, ignore_index), ``validate`` and the call's other ``flags`` (:func:`check_flags`) and,
    with ``validate``, the label range."""
    check_flags(validate=validate, **flags)
    check_tensor("logits", logits, dtypes=LOGITS_DTYPES)
    if logits.dim() < 2:
        raise ValueError(f"logits must have shape [..., V] with at least 2 dimensions, got {shape_of(logits)}")
    if logits.shape[-1] == 0:
        raise ValueError("logits must have a non-empty last (vocabulary) dimension")
    if logits.stride(-1) != 1:
        raise ValueError(
            f"logits must have a contiguous last dimension (stride 1), got strides {tuple(logits.stride())}"
        )
    check_tensor("labels", labels, dtypes=(torch.int64,), device=logits.device)
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"labels must have shape {list(logits.shape[:-1])} (logits without V), got {shape_of(labels)}")
    check_tokens(p)
    if validate:
        check_label_range(labels, logits.shape[-1], p.ignore_index)


def check_ref(p, ref_logps, labels):
    """``ref_logps`` shaped like ``labels``, fp32/64; None only where the loss has no reference or takes None as
    one of 0 (``p.needs_ref``: the sequence-level primitive; SimPO and SLiC pass None themselves)."""
    if ref_logps is None and p.needs_ref:
        raise ValueError(f"ref_logps must be a torch.Tensor of the reference's log-probs shaped like labels "
                         f"{list(labels.shape)}, got None ({p.name} needs a reference)")
    if ref_logps is not None:
        check_tensor("ref_logps", ref_logps, shape=labels.shape, dtypes=LOGP_DTYPES, device=labels.device)


def check_logits_loss(logits, labels, ref_logps, p, validate, **flags):
    """:func:`check_logits` for a loss: ``logits [B, T, V]``, ``ref_logps`` (:func:`check_ref`)."""
    check_logits(logits, labels, p, validate, **flags)
    if labels.dim() != 2:
        raise ValueError(f"labels must have shape [B, T] (logits [B, T, V]) for a loss, got {list(labels.shape)}")
    check_ref(p, ref_logps, labels)


def check_linear(hidden, weight, bias, labels, p, chunk_bytes, validate, **flags):
    """``hidden [..., D]``, ``weight [V, D]`` and ``bias [V]`` of one dtype and device, ``labels`` shaped like
    ``hidden`` without ``D``, the options ``p``, a positive ``chunk_bytes``, ``validate`` and the call's other
    ``flags`` (:func:`check_flags`) and, with ``validate``, the labels."""
    check_flags(validate=validate, **flags)
    check_tensor("hidden", hidden, dtypes=LOGITS_DTYPES)
    if hidden.dim() < 2:
        raise ValueError(f"hidden must have shape [..., D] with at least 2 dimensions, got {shape_of(hidden)}")
    D = hidden.shape[-1]
    if D == 0:
        raise ValueError("hidden must have a non-empty hidden dimension (shape [..., D] with D > 0)")
    check_tensor("weight", weight, ndim=2, dtypes=(hidden.dtype,), device=hidden.device)
    if weight.shape[1] != D:
        raise ValueError(f"weight must have shape [V, D] with D = hidden.shape[-1] = {D}, got {shape_of(weight)}")
    if weight.shape[0] == 0:
        raise ValueError("weight must have a non-empty vocabulary dimension (shape [V, D] with V > 0)")
    if bias is not None:
        check_tensor("bias", bias, shape=(weight.shape[0],), dtypes=(hidden.dtype,), device=hidden.device)
    check_tensor("labels", labels, dtypes=(torch.int64,), device=hidden.device)
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"labels must have shape {list(hidden.shape[:-1])} (hidden without D), "
                         f"got {shape_of(labels)}")
    check_tokens(p)
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    if validate:
        check_label_range(labels, weight.shape[0], p.ignore_index)


def check_supervised(labels, covered, ignore_index):
    """No label outside the ``supervised`` ranges: ``covered`` (the labels at the ranges' positions) holds every
    label of ``labels`` that is not ``ignore_index``. A device-side assert, as :func:`check_label_range`."""
    device_check((labels != ignore_index).sum() == (covered != ignore_index).sum(),
                 "labels outside the supervised ranges must equal ignore_index (a range misses a labelled position)")


def check_linear_loss(hidden, weight, bias, labels, ref_logps, p, chunk_bytes, validate):
    """:func:`check_linear` for a loss: ``hidden [B, T, D]``, ``ref_logps`` (:func:`check_ref`)."""
    check_linear(hidden, weight, bias, labels, p, chunk_bytes, validate)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must have shape [B, T, D] for a loss, got {shape_of(hidden)}")
    check_ref(p, ref_logps, labels)


# ------------------------------------------------------------------ TRL 1.16's loss options (hk.reference, hk.losses)

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                  "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
F_DIVERGENCE_TYPES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# the loss types built on the chosen-minus-rejected score, the only ones with an f-divergence form (TRL 1.16)
F_DIVERGENCE_LOSS_TYPES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
KTO_KL_ESTIMATES = ("halos", "trl")
GRPO_PPO_CLIP_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
GRPO_NORMALIZER_TYPES = ("dapo", "bnpo", "cispo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
VLLM_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def check_flag(name, v):
    if not isinstance(v, bool):
        raise ValueError(f"{name} must be a bool, got {v!r}")


def check_optional_logps(name, t, logps):
    """An optional per-token input shaped and typed like ``logps`` (None passes)."""
    if t is not None:
        check_tensor(name, t, shape=logps.shape, dtypes=(logps.dtype,), device=logps.device)


def check_dpo_options(logps, *, clip, beta, label_smoothing, loss_type, loss_weights, rpo_alpha, f_divergence_type,
                      f_alpha_divergence_coef, ld_alpha, discopop_tau, use_weighting, log_sum_sq_probs):
    """TRL 1.16 DPO options; returns the ``(loss_types, loss_weights)`` lists the loss sums over (``rpo_alpha`` is
    TRL's ``"sft"`` term with that weight)."""
    check_real("label_smoothing", label_smoothing, low=0.0, high=0.5)
    types = [loss_type] if isinstance(loss_type, str) else loss_type
    if not isinstance(types, (list, tuple)) or not types or not all(isinstance(t, str) for t in types):
        raise ValueError(f"loss_type must be a name or a non-empty list of names, got {loss_type!r}")
    for t in types:
        if t not in DPO_LOSS_TYPES:
            raise ValueError(f"loss_type must be in {DPO_LOSS_TYPES}, got {t!r}")
    if loss_weights is not None:
        if not isinstance(loss_weights, (list, tuple)) or len(loss_weights) != len(types):
            raise ValueError(f"loss_weights must be a list with one weight per loss_type ({len(types)}), "
                             f"got {loss_weights!r}")
        for w in loss_weights:
            check_real("loss_weights", w)
    if rpo_alpha is not None:
        check_real("rpo_alpha", rpo_alpha, low=0.0)
    types, weights = _objectives.mixture(loss_type, loss_weights, rpo_alpha)
    if clip is not None and "aot" in types:
        raise ValueError("loss_type 'aot' has no humanline form: it sorts the policy's and the reference's "
                         "chosen-minus-rejected sums separately, so no per-token log-ratio exists to clamp; "
                         "pass clip=None")
    if beta == 0 and any(t in ("ipo", "sppo_hard") for t in types):
        raise ValueError("beta must be > 0 for loss_type 'ipo' and 'sppo_hard' (they divide by beta)")
    if "exo_pair" in types and label_smoothing == 0:
        raise ValueError("label_smoothing must be > 0 for loss_type 'exo_pair' (it takes log(label_smoothing))")
    if "robust" in types and label_smoothing >= 0.5:
        raise ValueError("label_smoothing must be < 0.5 for loss_type 'robust' (it divides by 1 - 2 label_smoothing)")
    if f_divergence_type not in F_DIVERGENCE_TYPES:
        raise ValueError(f"f_divergence_type must be in {F_DIVERGENCE_TYPES}, got {f_divergence_type!r}")
    bad = [t for t in types if t not in F_DIVERGENCE_LOSS_TYPES]
    if f_divergence_type != "reverse_kl" and bad:
        raise ValueError(f"f_divergence_type={f_divergence_type!r} applies to loss types {F_DIVERGENCE_LOSS_TYPES} "
                         f"only (the others have no f-divergence form), got {bad}")
    check_real("f_alpha_divergence_coef", f_alpha_divergence_coef)
    if ld_alpha is not None:
        check_real("ld_alpha", ld_alpha, low=0.0, high=1.0)
    check_real("discopop_tau", discopop_tau, low=0.0, low_open=True)
    check_flag("use_weighting", use_weighting)
    if use_weighting:
        if log_sum_sq_probs is None:
            raise ValueError("use_weighting=True needs log_sum_sq_probs (per-token log sum_v p_v^2, TRL's WPO input)")
        if any(t in ("aot", "aot_unpaired") for t in types):
            raise ValueError("use_weighting does not apply to loss_type 'aot'/'aot_unpaired': they sort the pairs, "
                             "which would misalign the per-pair weights")
    elif log_sum_sq_probs is not None:
        raise ValueError("log_sum_sq_probs is read only with use_weighting=True")
    check_optional_logps("log_sum_sq_probs", log_sum_sq_probs, logps)
    return types, weights


def check_kto_options(*, loss_type, kl_estimate, has_kl_rows):
    if loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"loss_type must be in {KTO_LOSS_TYPES}, got {loss_type!r}")
    if kl_estimate not in KTO_KL_ESTIMATES:
        raise ValueError(f"kl_estimate must be in {KTO_KL_ESTIMATES}, got {kl_estimate!r}")
    if loss_type == "apo_zero_unpaired" and has_kl_rows:
        raise ValueError("loss_type 'apo_zero_unpaired' has no KL baseline: pass no kl_logps/kl_ref_logps/kl_mask")


def _check_normalizer(normalizer, device):
    if isinstance(normalizer, torch.Tensor):
        if normalizer.numel() != 1:
            raise ValueError(f"normalizer must be a number or a 1-element tensor, got shape {shape_of(normalizer)}")
        if normalizer.device != device:
            raise ValueError(f"normalizer must be on device {device}, got {normalizer.device}")
    else:
        check_real("normalizer", normalizer, low=0.0, low_open=True)


def check_grpo_options(logps, advantages, *, clip, epsilon_low, epsilon_high, loss_type, normalizer,
                       max_completion_length, importance_sampling_level, delta, sapo_temperature_pos,
                       sapo_temperature_neg, vespo, importance_sampling_ratio, tool_mask, off_policy_mask_threshold,
                       sampling_per_token_logps, top_entropy_quantile, entropies, entropy_coef,
                       use_adaptive_entropy, entropy_target, last_world_entropy, use_bias_correction_kl):
    """TRL 1.16 GRPO options (``vespo``: its four k/lambda values by name)."""
    B, T = logps.shape
    dev = logps.device
    check_tensor("advantages", advantages, device=dev)
    if tuple(advantages.shape) not in ((B,), (B, T)) or not advantages.is_floating_point():
        raise ValueError(f"advantages must be a floating-point tensor of shape [{B}] or [{B}, {T}], got "
                         f"{shape_of(advantages)} {advantages.dtype}")
    check_grpo_band(epsilon_low, epsilon_high)
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {GRPO_LOSS_TYPES}, got {loss_type!r}")
    if normalizer is not None:
        _check_normalizer(normalizer, dev)
        if loss_type not in GRPO_NORMALIZER_TYPES:
            raise ValueError(f"normalizer applies to loss_type in {GRPO_NORMALIZER_TYPES} only (the others fix "
                             f"their own denominator), got loss_type={loss_type!r}")
    check_max_completion_length(max_completion_length)
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level must be in {IMPORTANCE_SAMPLING_LEVELS}, "
                         f"got {importance_sampling_level!r}")
    if delta is not None:
        check_real("delta", delta, low=0.0, low_open=True)
        if loss_type not in GRPO_PPO_CLIP_TYPES:
            raise ValueError(f"delta (two-sided clipping) applies to loss_type in {GRPO_PPO_CLIP_TYPES} only, "
                             f"got loss_type={loss_type!r}")
    check_real("sapo_temperature_pos", sapo_temperature_pos, low=0.0, low_open=True)
    check_real("sapo_temperature_neg", sapo_temperature_neg, low=0.0, low_open=True)
    for name, v in vespo.items():
        check_real(name, v, low=0.0)
    if importance_sampling_ratio is not None:
        check_tensor("importance_sampling_ratio", importance_sampling_ratio, dtypes=LOGP_DTYPES, device=dev)
        if tuple(importance_sampling_ratio.shape) not in ((B,), (B, 1), (B, T)):
            raise ValueError(f"importance_sampling_ratio must have shape [{B}], [{B}, 1] or [{B}, {T}], "
                             f"got {shape_of(importance_sampling_ratio)}")
        if loss_type == "vespo" and tuple(importance_sampling_ratio.shape) != (B, T):
            raise ValueError("loss_type 'vespo' folds a per-token importance_sampling_ratio [B, T] into its "
                             "sequence weight (TRL's token_* vLLM modes); a per-sequence ratio has no place in it")
    if tool_mask is not None:
        check_tensor("tool_mask", tool_mask, shape=logps.shape, device=dev)
        if tool_mask.is_floating_point() or tool_mask.is_complex():
            raise ValueError(f"tool_mask must be a bool or integer (0/1) tensor, got {tool_mask.dtype}")
    if off_policy_mask_threshold is not None:
        check_real("off_policy_mask_threshold", off_policy_mask_threshold)
        if clip is not None and sampling_per_token_logps is None:
            raise ValueError("off_policy_mask_threshold with humanline (clip set) needs sampling_per_token_logps: "
                             "the ratio's denominator is then the synced reference, not the policy that sampled")
    elif sampling_per_token_logps is not None:
        raise ValueError("sampling_per_token_logps is read only by the off-policy mask: pass "
                         "off_policy_mask_threshold too")
    check_optional_logps("sampling_per_token_logps", sampling_per_token_logps, logps)
    check_real("top_entropy_quantile", top_entropy_quantile, low=0.0, high=1.0)
    check_real("entropy_coef", entropy_coef)
    check_flag("use_adaptive_entropy", use_adaptive_entropy)
    check_real("entropy_target", entropy_target)
    if isinstance(last_world_entropy, bool) or not isinstance(last_world_entropy, (int, float)) \
            or math.isnan(last_world_entropy):
        raise ValueError(f"last_world_entropy must be a real number (inf before the first measurement), "
                         f"got {last_world_entropy!r}")
    needs_entropy = top_entropy_quantile < 1.0 or entropy_coef != 0.0 or use_adaptive_entropy
    if needs_entropy and entropies is None:
        raise ValueError("entropies [B, T] is needed with top_entropy_quantile < 1, entropy_coef != 0 or "
                         "use_adaptive_entropy")
    check_optional_logps("entropies", entropies, logps)
    check_flag("use_bias_correction_kl", use_bias_correction_kl)


def check_grpo_losses(p, logps, inp):
    """GRPO at the log-prob level (``hk.losses.grpo``): every TRL 1.16 option (:func:`check_grpo_options`) from the
    params ``p`` and the inputs ``inp``, ``kl_ref_logps``, and a caller's ``entropy_mask``."""
    _check_loss(p)
    check_grpo_options(
        logps, inp.advantages, clip=p.clip, epsilon_low=p.epsilon_low, epsilon_high=p.epsilon_high,
        loss_type=p.loss_type, normalizer=inp.normalizer if inp.normalizer is not None else p.normalizer,
        max_completion_length=p.max_completion_length, importance_sampling_level=p.importance_sampling_level,
        delta=p.delta, sapo_temperature_pos=p.sapo_temperature_pos, sapo_temperature_neg=p.sapo_temperature_neg,
        vespo=p.vespo, importance_sampling_ratio=inp.importance_sampling_ratio, tool_mask=inp.tool_mask,
        off_policy_mask_threshold=p.off_policy_mask_threshold, sampling_per_token_logps=inp.sampling_per_token_logps,
        top_entropy_quantile=p.top_entropy_quantile, entropies=inp.entropies, entropy_coef=p.entropy_coef,
        use_adaptive_entropy=p.use_adaptive_entropy, entropy_target=p.entropy_target,
        last_world_entropy=p.last_world_entropy, use_bias_correction_kl=p.use_bias_correction_kl)
    check_optional_logps("kl_ref_logps", inp.kl_ref_logps, logps)
    if inp.entropy_mask is not None:
        check_tensor("entropy_mask", inp.entropy_mask, shape=logps.shape, dtypes=(torch.bool,), device=logps.device)
        if p.top_entropy_quantile >= 1.0:
            raise ValueError("entropy_mask is a high-entropy mask: it needs top_entropy_quantile < 1 (the quantile "
                             "it was computed for)")
