"""Eager fallback of :func:`.losses_kernels.token_terms_fwd` (CPU without the interpreter, fp64 logits).

Reuses :func:`humanline_kernels.losses.clip_log_ratio` / :func:`~humanline_kernels.losses.grpo_token_terms` for
the per-token values; ``coef = d val / d logp`` comes from autograd on the small ``[B, T]`` tensors (each
``val[b, t]`` depends on ``logp[b, t]`` only, so the gradient of the sum is the elementwise derivative).
"""
from __future__ import annotations

import torch

from .. import losses
from . import eager

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
                    advantages=None, beta=0.0, epsilon_low=0.2, epsilon_high=0.2, row_weight=None, grad_out=None):
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
    return val.detach(), coef, lse, aux
