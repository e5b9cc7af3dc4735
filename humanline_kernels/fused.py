"""Humanline losses and token log-probs straight from logits.

``logits [..., V]`` (bf16/fp16/fp32, last dimension contiguous, any other strides: a ``logits[:, :-1]`` view is
used as is), ``labels [...]`` int64 with ``ignore_index`` marking tokens that do not count. CUDA tensors (and CPU
tensors under ``TRITON_INTERPRET=1``) go through the Triton kernels; other CPU tensors through a chunked eager
path that never builds an fp32 copy of the whole logits tensor.
"""
from __future__ import annotations

import torch

from . import _validation as V
from . import losses, ops
from ._clip import DEFAULT_CLIP

__all__ = ["token_logprobs", "grpo", "dpo", "kto"]


def _as_3d(logits, labels):
    """View ``[..., V]`` as ``[B, T, V]`` without copying the 2-D and 3-D cases."""
    if logits.dim() == 2:
        return logits.unsqueeze(0), labels.unsqueeze(0)
    if logits.dim() == 3:
        return logits, labels
    return logits.reshape(-1, *logits.shape[-2:]), labels.reshape(-1, labels.shape[-1])


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature, ignore_index, return_entropy, inplace_backward):
        l3, y3 = _as_3d(logits, labels)
        logp, lse, ent = ops.logprobs_fwd(l3, y3, temperature, ignore_index, return_entropy)
        ctx.save_for_backward(logits, labels, lse)
        ctx.cfg = (temperature, ignore_index, inplace_backward)
        logp = logp.view(labels.shape)
        if ent is not None:
            ent = ent.view(labels.shape)
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, _grad_ent):
        logits, labels, lse = ctx.saved_tensors
        temperature, ignore_index, inplace = ctx.cfg
        l3, y3 = _as_3d(logits, labels)
        g3 = grad_logp.reshape(y3.shape)
        if inplace:
            ops.logprobs_bwd(l3, y3, lse, g3, temperature, ignore_index, out=l3)
            torch.autograd.graph.increment_version(logits)  # a later use of the old logits must fail loudly
            dlogits = logits
        else:
            dlogits = ops.logprobs_bwd(l3, y3, lse, g3, temperature, ignore_index).view(logits.shape)
        return dlogits, None, None, None, None, None


def token_logprobs(logits, labels, *, temperature=1.0, ignore_index=-100, return_entropy=False,
                   inplace_backward=False, validate=True):
    """Per-token ``log_softmax(logits / temperature)[labels]`` in fp32, shaped like ``labels``, 0 where ignored.

    Differentiable with respect to ``logits``. With ``return_entropy=True`` returns ``(logps, entropy)``, the
    entropy detached. ``inplace_backward=True`` (opt-in) writes the gradient into ``logits``' own storage: the
    logits must not be used afterwards. ``validate=False`` skips the label range check, the only check that
    synchronises with the device.
    """
    V.check_logits_labels(logits, labels, ignore_index=ignore_index)
    V.check_common(clip=None, temperature=temperature)
    if validate:
        V.check_label_range(labels, logits.shape[-1], ignore_index)
    logp, ent = _TokenLogprobs.apply(logits, labels, float(temperature), ignore_index, bool(return_entropy),
                                     bool(inplace_backward))
    return (logp, ent) if return_entropy else logp


def _loss_inputs(logits, labels, ref_logps, temperature, ignore_index, validate):
    V.check_logits_labels(logits, labels, ignore_index=ignore_index)
    if labels.dim() != 2:
        raise ValueError(f"labels must have shape [B, T] (logits [B, T, V]) for a loss, got {list(labels.shape)}")
    V.check_ref_logps(ref_logps, labels)
    logps = token_logprobs(logits, labels, temperature=temperature, ignore_index=ignore_index, validate=validate)
    return logps.to(ref_logps.dtype), labels != ignore_index


def grpo(logits, labels, ref_logps, advantages, *, clip=DEFAULT_CLIP, beta=0.0, epsilon_low=0.2, epsilon_high=0.2,
         kl_ref_logps=None, loss_type="dapo", normalizer=None, max_completion_length=None, temperature=1.0,
         ignore_index=-100, validate=True):
    """Humanline GRPO from ``logits [B, T, V]``; same keywords and result as :func:`humanline_kernels.losses.grpo`."""
    logps, mask = _loss_inputs(logits, labels, ref_logps, temperature, ignore_index, validate)
    return losses.grpo(logps, ref_logps, advantages, mask, clip=clip, beta=beta, epsilon_low=epsilon_low,
                       epsilon_high=epsilon_high, kl_ref_logps=kl_ref_logps, loss_type=loss_type,
                       normalizer=normalizer, max_completion_length=max_completion_length)


def dpo(logits, labels, ref_logps, *, clip=DEFAULT_CLIP, beta=0.1, label_smoothing=0.0, temperature=1.0,
        ignore_index=-100, validate=True):
    """Humanline DPO from ``logits [2P, T, V]``; same keywords and result as :func:`humanline_kernels.losses.dpo`."""
    logps, mask = _loss_inputs(logits, labels, ref_logps, temperature, ignore_index, validate)
    return losses.dpo(logps, ref_logps, mask, clip=clip, beta=beta, label_smoothing=label_smoothing)


def kto(logits, labels, ref_logps, desirable, kl_logps=None, kl_ref_logps=None, kl_mask=None, *, clip=DEFAULT_CLIP,
        beta=0.1, desirable_weight=1.0, undesirable_weight=1.0, temperature=1.0, ignore_index=-100, validate=True):
    """Humanline KTO from ``logits [B, T, V]``; the KL rows come as log-probs from a separate no-grad pass."""
    logps, mask = _loss_inputs(logits, labels, ref_logps, temperature, ignore_index, validate)
    return losses.kto(logps, ref_logps, mask, desirable, kl_logps, kl_ref_logps, kl_mask, clip=clip, beta=beta,
                      desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)
