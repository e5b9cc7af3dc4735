"""Eager fallback of :func:`.losses_kernels.token_terms_fwd` (CPU without the interpreter, fp64 logits).

Reuses :func:`humanline_kernels.losses.clip_log_ratio` / :func:`~humanline_kernels.losses.grpo_token_terms` for
the per-token values; ``coef = d val / d logp`` comes from autograd on the small ``[B, T]`` tensors (each
``val[b, t]`` depends on ``logp[b, t]`` only, so the gradient of the sum is the elementwise derivative).
"""
from __future__ import annotations

import torch

from .. import losses
from . import METRICS, eager

MODE_RATIO, MODE_GRPO = 1, 2


def _terms(logp, ref, mask, *, mode, clip, kl_ref_logps, advantages, beta, epsilon_low, epsilon_high):
    clipped = losses.clip_log_ratio(logp, ref, mask, clip)[0]
    if mode == MODE_RATIO:
        return clipped, None, None, None
    per_token, k3, low, high = losses.grpo_token_terms(
        logp, clipped, ref if kl_ref_logps is None else kl_ref_logps.to(logp.dtype), advantages, mask, beta=beta,
        epsilon_low=epsilon_low, epsilon_high=epsilon_high)
    return per_token, k3, low, high


def token_terms_fwd(logits, labels, ref_logps, *, mode, clip, temperature, ignore_index, kl_ref_logps=None,
                    advantages=None, beta=0.0, epsilon_low=0.2, epsilon_high=0.2, row_weight=None, grad_out=None,
                    out=None):
    logp, lse, _ = eager.logprobs_fwd(logits, labels, temperature, ignore_index, False)
    mask = labels != ignore_index
    ref = ref_logps.to(logp.dtype)
    with torch.enable_grad():
        lp = logp.detach().requires_grad_()
        val, k3, low, high = _terms(lp, ref, mask, mode=mode, clip=clip, kl_ref_logps=kl_ref_logps,
                                    advantages=advantages, beta=beta, epsilon_low=epsilon_low,
                                    epsilon_high=epsilon_high)
        (coef,) = torch.autograd.grad(val.sum(), lp, allow_unused=True)
    coef = torch.zeros_like(logp) if coef is None else coef
    delta = logp - ref
    inside = mask if clip is None else mask & (delta > clip.log_eps_p) & (delta < clip.log_eps_r)
    aux = torch.zeros((4, *logp.shape), dtype=logp.dtype, device=logp.device)
    aux[0] = inside
    if mode == MODE_GRPO:
        aux[1], aux[2], aux[3] = low, high, k3
    if grad_out is not None:
        eager.logprobs_bwd(logits, labels, lse, coef * row_weight.to(coef.dtype).unsqueeze(1), temperature,
                           ignore_index, out=grad_out)
    res = (val.detach(), coef, lse, aux)
    if out is not None:
        for dst, src in zip(out, res):
            dst.copy_(src)
        return out
    return res


# ---------------------------------------------------------------- the [B, T] tail (eager twins of finalize_kernels)
def _w(loss_fn, x):
    """``(loss, metrics, d loss / d x)`` of ``loss_fn(x) -> (loss, metrics)`` for a small tensor ``x``."""
    with torch.enable_grad():
        x = x.detach().requires_grad_()
        loss, metrics = loss_fn(x)
        (w,) = torch.autograd.grad(loss, x)
    return loss.detach(), metrics, w


def _pack(name, metrics, unclipped):
    metrics = dict(metrics, unclipped_frac=unclipped)
    return torch.stack([metrics[k].detach().reshape(()).to(unclipped.dtype) for k in METRICS[name]])


def _unclipped(aux, mask, dtype):
    return losses._frac(aux[0].to(dtype).sum(), mask.sum().to(dtype))


def dpo_finalize(val, aux, labels, *, ignore_index, beta, label_smoothing):
    mask = labels != ignore_index
    loss, m, w = _w(lambda s: losses.dpo_from_sums(s, beta=beta, label_smoothing=label_smoothing), val.sum(1))
    return loss, _pack("dpo", m, _unclipped(aux, mask, val.dtype)), w


def kto_finalize(val, aux, labels, desirable, kl_logps, kl_ref_logps, kl_mask, z0, *, ignore_index, beta,
                 desirable_weight, undesirable_weight, clip):
    mask = labels != ignore_index
    if z0 is None:
        z0 = losses.kto_kl_baseline(kl_logps, kl_ref_logps, kl_mask, clip, val)
    weights = dict(beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)
    loss, m, w = _w(lambda s: losses.kto_from_sums(s, z0.to(val.dtype).reshape(()), desirable, **weights),
                    val.sum(1))
    return loss, _pack("kto", m, _unclipped(aux, mask, val.dtype)), w


def grpo_finalize(val, aux, labels, *, ignore_index, loss_type, normalizer=None, max_completion_length=None):
    from . import grpo_row_weights
    mask = labels != ignore_index
    w = grpo_row_weights(mask, loss_type=loss_type, normalizer=normalizer,
                         max_completion_length=max_completion_length)
    if val is None:
        return w.new_zeros(()), w.new_zeros(len(METRICS["grpo"])), w
    loss = losses.grpo_aggregate(val, mask, loss_type=loss_type, normalizer=normalizer,
                                 max_completion_length=max_completion_length)
    den = mask.sum().to(val.dtype).clamp(min=1)
    m = {"kl": aux[3].sum() / den, "clip_frac_low": aux[1].sum() / den, "clip_frac_high": aux[2].sum() / den}
    return loss.to(val.dtype), _pack("grpo", m, _unclipped(aux, mask, val.dtype)), w.to(val.dtype)
