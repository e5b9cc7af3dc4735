r"""Humanline losses and token log-probs straight from logits.

``logits [..., V]`` (bf16/fp16/fp32, last dimension contiguous, any other strides: a ``logits[:, :-1]`` view is
used as is), ``labels [...]`` int64 with ``ignore_index`` marking tokens that do not count. CUDA tensors (and CPU
tensors under ``TRITON_INTERPRET=1``) go through the Triton kernels (see ``docs/kernels.md``); other CPU tensors,
fp64 logits and fp64 reference log-probs through an eager path (chunked :mod:`humanline_kernels.ops.eager` log-probs
and :mod:`humanline_kernels.losses`).

Kernel path of the losses: one pass over the logits gives, per token, the log-prob, the humanline clamp, the
loss term ``val`` and its derivative ``coef = d val / d logp`` (``humanline::token_terms``). One more launch, the
loss's finalize kernel (``humanline::{dpo,kto,grpo}_finalize``, :mod:`humanline_kernels.ops.finalize_kernels`),
does the ``[B, T]`` tail: per-sequence sums, the loss, the metrics and the row weights ``w = d loss / d val``
(its eager twin goes through :mod:`humanline_kernels.losses`; tests pin both to :mod:`humanline_kernels.reference`).
The backward is one launch (``humanline::loss_bwd``) that recomputes the softmax from the saved per-row logsumexp:
``dlogits = grad_loss * w[b] * coef * (onehot - softmax) / temperature``.

Extra keywords (not in the log-prob level): ``inplace_backward=True`` writes the logits' gradient into the logits'
own storage (zero extra memory; the logits must be an intermediate that nothing else uses afterwards, e.g. the
lm_head output; their version counter is bumped so a later use fails loudly instead of reading garbage).
GRPO's ``grad_in_forward=True`` forms the gradient during the forward pass, see :func:`grpo`.
``validate=False`` skips the label range check, the only check that synchronises with the device.
"""
from __future__ import annotations

import torch

from . import _validation as V
from . import losses, ops
from ._clip import DEFAULT_CLIP
from .ops import custom_ops  # noqa: F401  (registers torch.ops.humanline.*)

__all__ = ["token_logprobs", "grpo", "dpo", "kto"]
_hl = torch.ops.humanline


def _as_3d(logits, labels):
    """View ``[..., V]`` as ``[B, T, V]`` without copying the 2-D and 3-D cases."""
    if logits.dim() == 2:
        return logits.unsqueeze(0), labels.unsqueeze(0)
    if logits.dim() == 3:
        return logits, labels
    return logits.reshape(-1, *logits.shape[-2:]), labels.reshape(-1, labels.shape[-1])


def _clip_args(clip):
    return (clip is not None, float(clip.log_eps_p) if clip else 0.0, float(clip.log_eps_r) if clip else 0.0)


def _bwd(logits, labels, lse, g, temperature, ignore_index, inplace):
    """Gradient of the logits for per-token log-prob gradient ``g [B, T]`` (into the logits when ``inplace``)."""
    if inplace:
        _hl.logprobs_bwd_(logits, labels, lse, g, temperature, ignore_index)  # the op bumps the version counter
        return logits
    return _hl.logprobs_bwd(logits, labels, lse, g, temperature, ignore_index)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature, ignore_index, return_entropy, inplace_backward):
        l3, y3 = _as_3d(logits, labels)
        logp, lse, ent = _hl.logprobs_fwd(l3, y3, temperature, ignore_index, return_entropy)
        ctx.save_for_backward(logits, labels, lse)
        ctx.cfg = (temperature, ignore_index, inplace_backward)
        ent = ent.view(labels.shape) if return_entropy else ent
        ctx.mark_non_differentiable(ent)
        ctx.set_materialize_grads(False)  # no zero-filled gradient for the entropy
        return logp.view(labels.shape), ent

    @staticmethod
    def backward(ctx, grad_logp, _grad_ent):
        if grad_logp is None:
            return (None,) * 6
        logits, labels, lse = ctx.saved_tensors
        temperature, ignore_index, inplace = ctx.cfg
        l3, y3 = _as_3d(logits, labels)
        d = _bwd(l3, y3, lse, grad_logp.reshape(y3.shape), temperature, ignore_index, inplace)
        # in place, ``d`` is ``l3``: a view of ``logits``, or a copy when ``[..., T, V]`` could not be flattened
        # without one (then the gradient lives in the copy, not in ``logits``)
        return d.view(logits.shape), None, None, None, None, None


def token_logprobs(logits, labels, *, temperature=1.0, ignore_index=-100, return_entropy=False,
                   inplace_backward=False, validate=True):
    """Per-token ``log_softmax(logits / temperature)[labels]`` in fp32, shaped like ``labels``, 0 where ignored.

    Differentiable with respect to ``logits``. With ``return_entropy=True`` returns ``(logps, entropy)``, the
    entropy detached. ``inplace_backward=True`` (opt-in) writes the gradient into ``logits``' own storage: the
    logits must not be used afterwards (their version counter is bumped). ``validate=False`` skips the label
    range check, the only check that synchronises with the device.
    """
    V.check_logits_labels(logits, labels, ignore_index=ignore_index)
    V.check_common(clip=None, temperature=temperature)
    if validate:
        V.check_label_range(labels, logits.shape[-1], ignore_index)
    logp, ent = _TokenLogprobs.apply(logits, labels, float(temperature), ignore_index, bool(return_entropy),
                                     bool(inplace_backward))
    return (logp, ent) if return_entropy else logp


class _FusedLoss(torch.autograd.Function):
    """``(loss, metrics [K])`` of one loss on the kernel path: the row kernel (``humanline::token_terms``), then the
    loss's finalize kernel (``humanline::{dpo,kto,grpo}_finalize``: sums, loss, metrics and the row weights
    ``w = d loss / d val``); the backward is one launch (``humanline::loss_bwd``: ``grad_loss * w * coef``).
    ``t1..t5`` are the finalize's optional tensors: KTO ``desirable, kl_logps, kl_ref_logps, kl_mask, z0``, GRPO
    ``t1`` = a tensor normalizer."""

    @staticmethod
    def forward(ctx, logits, labels, ref, kl_ref, adv, t1, t2, t3, t4, t5, kind, terms, fin, inplace):
        mode, clip_args, eps_lo, eps_hi, beta, temperature, ignore_index = terms
        val, coef, lse, aux = _hl.token_terms(logits, labels, ref, kl_ref, adv, mode, *clip_args, eps_lo, eps_hi,
                                              beta, temperature, ignore_index)
        if kind == "dpo":
            loss, met, w = _hl.dpo_finalize(val, aux, labels, ignore_index, *fin)
        elif kind == "kto":
            loss, met, w = _hl.kto_finalize(val, aux, labels, t1, t2, t3, t4, t5, ignore_index, *fin, *clip_args)
        else:
            loss, met, w = _hl.grpo_finalize(val, aux, labels, t1, fin[0], ignore_index, *fin[1:])
        ctx.save_for_backward(logits, labels, lse, coef, w)
        ctx.cfg = (temperature, ignore_index, inplace)
        ctx.mark_non_differentiable(met)
        ctx.set_materialize_grads(False)  # no zero-filled gradient for the metrics
        return loss, met

    @staticmethod
    def backward(ctx, grad_loss, _grad_met):
        logits, labels, lse, coef, w = ctx.saved_tensors
        temperature, ignore_index, inplace = ctx.cfg
        if grad_loss is None:
            return (None,) * 14
        if inplace:
            _hl.loss_bwd_(logits, labels, lse, coef, w, grad_loss, temperature, ignore_index)  # bumps the version
            d = logits
        else:
            d = _hl.loss_bwd(logits, labels, lse, coef, w, grad_loss, temperature, ignore_index)
        return (d,) + (None,) * 13


class _GrpoGradInForward(torch.autograd.Function):
    """GRPO loss whose logits gradient is written during the forward; backward only scales it by grad_output.
    The row weights come first, from the labels (``grpo_finalize`` without terms); the loss and metrics after."""

    @staticmethod
    def forward(ctx, logits, labels, ref, kl_ref, adv, norm_t, clip_args, eps_lo, eps_hi, beta, temperature,
                ignore_index, fin, inplace):
        _loss, _met, weight = _hl.grpo_finalize(None, None, labels, norm_t, fin[0], ignore_index, *fin[1:])
        args = (clip_args[0], clip_args[1], clip_args[2], eps_lo, eps_hi, beta, temperature, ignore_index)
        if inplace:
            grad = logits
            val, _c, _l, aux = _hl.grpo_grad_fwd_(logits, labels, ref, kl_ref, adv, weight, *args)
        else:
            grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
            val, _c, _l, aux = _hl.grpo_grad_fwd(logits, labels, ref, kl_ref, adv, weight, grad, *args)
        loss, met, _w = _hl.grpo_finalize(val, aux, labels, norm_t, fin[0], ignore_index, *fin[1:])
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(met)
        ctx.set_materialize_grads(False)
        return loss, met

    @staticmethod
    def backward(ctx, grad_loss, _grad_met):
        (grad,) = ctx.saved_tensors
        if grad_loss is None:
            return (None,) * 14
        _hl.scale_rows_(grad, grad_loss.reshape(()).to(torch.float32))  # device-side no-op when grad_loss == 1
        return (grad,) + (None,) * 13


def _distinct(*ts):
    """The tensors, a repeated one as a view of itself (free): Dynamo refuses the same tensor twice in the inputs
    of an autograd.Function (e.g. ``kl_ref_logps=ref_logps``)."""
    out = []
    for t in ts:
        # `is`, not id(): torch 2.11's Dynamo cannot trace id() of None or of a tensor made inside the graph
        if t is not None and any(t is u for u in out):
            t = t.view(t.shape)
        out.append(t)
    return out


def _check_loss_inputs(logits, labels, ref_logps, ignore_index, validate):
    V.check_logits_labels(logits, labels, ignore_index=ignore_index)
    if labels.dim() != 2:
        raise ValueError(f"labels must have shape [B, T] (logits [B, T, V]) for a loss, got {list(labels.shape)}")
    V.check_ref_logps(ref_logps, labels)
    if validate:
        V.check_label_range(labels, logits.shape[-1], ignore_index)


def _eager_logps(logits, labels, ref_logps, temperature, ignore_index):
    logps = token_logprobs(logits, labels, temperature=temperature, ignore_index=ignore_index, validate=False)
    return logps.to(ref_logps.dtype), labels != ignore_index


def grpo(logits, labels, ref_logps, advantages, *, clip=DEFAULT_CLIP, beta=0.0, epsilon_low=0.2, epsilon_high=0.2,
         kl_ref_logps=None, loss_type="dapo", normalizer=None, max_completion_length=None, temperature=1.0,
         ignore_index=-100, validate=True, grad_in_forward=False, inplace_backward=False):
    """Humanline GRPO from ``logits [B, T, V]``; same keywords and result as :func:`humanline_kernels.losses.grpo`.

    ``grad_in_forward=True`` (kernel path, when grad is enabled and ``logits`` requires it) writes
    ``d loss / d logits`` for ``grad_output = 1`` during the forward pass: GRPO's per-token term depends only on its
    own token and the aggregation weights ``d loss / d L_t`` come from the mask alone, so this is exact for every
    ``loss_type``. The backward multiplies the stored gradient by ``grad_output`` in place with a kernel that
    reads ``grad_output`` on the device and does nothing when it is 1 (no host sync, no extra pass in the usual
    case). The gradient buffer is new (``inplace_backward=False``) or the logits themselves (``True``: the
    logits are overwritten already during the forward). Backward may then run only once for this loss.
    """
    _check_loss_inputs(logits, labels, ref_logps, ignore_index, validate)
    V.check_common(clip=clip, beta=beta, temperature=temperature)
    B = labels.shape[0]
    V.check_grpo_args(B, labels.device, advantages, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
                      loss_type=loss_type, normalizer=normalizer, max_completion_length=max_completion_length)
    if kl_ref_logps is not None:
        V.check_tensor("kl_ref_logps", kl_ref_logps, shape=labels.shape, dtypes=(ref_logps.dtype,),
                       device=labels.device)
    agg = dict(loss_type=loss_type, normalizer=normalizer, max_completion_length=max_completion_length)
    if not ops.kernels_ok(logits, ref_logps, kl_ref_logps):
        logps, mask = _eager_logps(logits, labels, ref_logps, temperature, ignore_index)
        return losses.grpo(logps, ref_logps, advantages, mask, clip=clip, beta=beta, epsilon_low=epsilon_low,
                           epsilon_high=epsilon_high, kl_ref_logps=kl_ref_logps, **agg)
    norm_t = normalizer.reshape(()) if isinstance(normalizer, torch.Tensor) else None
    fin = (None if normalizer is None or norm_t is not None else float(normalizer), loss_type, max_completion_length)
    if grad_in_forward and torch.is_grad_enabled() and logits.requires_grad:
        loss, met = _GrpoGradInForward.apply(logits, labels, *_distinct(ref_logps, kl_ref_logps, advantages, norm_t),
                                             _clip_args(clip), float(epsilon_low), float(epsilon_high), float(beta),
                                             float(temperature), ignore_index, fin, bool(inplace_backward))
    else:
        terms = (ops.MODE_GRPO, _clip_args(clip), float(epsilon_low), float(epsilon_high), float(beta),
                 float(temperature), ignore_index)
        loss, met = _FusedLoss.apply(logits, labels, *_distinct(ref_logps, kl_ref_logps, advantages, norm_t), None,
                                     None, None, None, "grpo", terms, fin, bool(inplace_backward))
    return loss, ops.named_metrics("grpo", met)


def _ratio_terms(clip, temperature, ignore_index):
    return (ops.MODE_RATIO, _clip_args(clip), 0.2, 0.2, 0.0, float(temperature), ignore_index)


def dpo(logits, labels, ref_logps, *, clip=DEFAULT_CLIP, beta=0.1, label_smoothing=0.0, temperature=1.0,
        ignore_index=-100, validate=True, inplace_backward=False):
    """Humanline DPO from ``logits [2P, T, V]``; same keywords and result as :func:`humanline_kernels.losses.dpo`."""
    _check_loss_inputs(logits, labels, ref_logps, ignore_index, validate)
    V.check_dpo_rows(labels.shape[0])
    V.check_common(clip=clip, beta=beta, temperature=temperature)
    V.check_dpo_args(label_smoothing)
    if not ops.kernels_ok(logits, ref_logps):
        logps, mask = _eager_logps(logits, labels, ref_logps, temperature, ignore_index)
        return losses.dpo(logps, ref_logps, mask, clip=clip, beta=beta, label_smoothing=label_smoothing)
    loss, met = _FusedLoss.apply(logits, labels, ref_logps, None, None, None, None, None, None, None, "dpo",
                                 _ratio_terms(clip, temperature, ignore_index),
                                 (float(beta), float(label_smoothing)), bool(inplace_backward))
    return loss, ops.named_metrics("dpo", met)


def kto(logits, labels, ref_logps, desirable, kl_logps=None, kl_ref_logps=None, kl_mask=None, *, clip=DEFAULT_CLIP,
        beta=0.1, desirable_weight=1.0, undesirable_weight=1.0, temperature=1.0, ignore_index=-100, validate=True,
        inplace_backward=False):
    """Humanline KTO from ``logits [B, T, V]``; the KL rows come as log-probs from a separate no-grad pass."""
    _check_loss_inputs(logits, labels, ref_logps, ignore_index, validate)
    V.check_common(clip=clip, beta=beta, temperature=temperature)
    V.check_kto_args(labels.shape[0], labels.device, desirable, kl_logps, kl_ref_logps, kl_mask,
                     desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)
    weights = dict(beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)
    if not ops.kernels_ok(logits, ref_logps, kl_logps, kl_ref_logps):
        logps, mask = _eager_logps(logits, labels, ref_logps, temperature, ignore_index)
        return losses.kto(logps, ref_logps, mask, desirable, kl_logps, kl_ref_logps, kl_mask, clip=clip, **weights)
    z0 = None
    if losses._distributed():  # the baseline's sum and count are all-reduced across ranks first
        z0 = losses.kto_kl_baseline(kl_logps, kl_ref_logps, kl_mask, clip, ref_logps)
    fin = (float(beta), float(desirable_weight), float(undesirable_weight))
    ref, *kto_tensors = _distinct(ref_logps, desirable, kl_logps, kl_ref_logps, kl_mask, z0)
    loss, met = _FusedLoss.apply(logits, labels, ref, None, None, *kto_tensors, "kto",
                                 _ratio_terms(clip, temperature, ignore_index), fin, bool(inplace_backward))
    return loss, ops.named_metrics("kto", met)
