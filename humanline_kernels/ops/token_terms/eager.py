"""Eager twin of :func:`.kernel.token_terms` (same signature and results): the fused-linear losses' path on CPU
tensors and fp64, and the per-op oracle of the tests.

The per-token values come from :func:`humanline_kernels.losses.clip_log_ratio` and
:func:`humanline_kernels.losses.grpo_token_terms` (the losses' own math); ``coef = d val / d logp`` from autograd on
the small ``[B, T]`` tensors (each ``val[b, t]`` depends on ``logp[b, t]`` only, so the gradient of the sum is the
elementwise derivative).
"""
from __future__ import annotations

import torch

from ... import losses
from ..constants import AUX_PLANES, MODE_GRPO
from ..logprobs import eager as logprobs_eager


def _terms(logits, labels, ref, p, adv, klref, w_tok, grad_out):
    """``(val, coef, lse, aux)`` of ``logits [B, T, V]``; ``adv`` and ``klref`` shaped like ``labels`` (GRPO),
    ``w_tok`` the per-token weight of the gradient written into ``grad_out``."""
    logp, lse, _ = logprobs_eager.logprobs_fwd(logits, labels, p.temperature, p.ignore_index, False)
    mask = labels != p.ignore_index
    ref = ref.to(logp.dtype)
    grpo = p.mode == MODE_GRPO
    with torch.enable_grad():
        lp = logp.detach().requires_grad_()
        val = losses.clip_log_ratio(lp, ref, mask, p.clip)[0]
        if grpo:
            klr = ref if klref is None else klref.to(logp.dtype)
            val, k3, low, high = losses.grpo_token_terms(lp, val, klr, adv, mask, beta=p.beta,
                                                         epsilon_low=p.epsilon_low, epsilon_high=p.epsilon_high)
        (coef,) = torch.autograd.grad(val.sum(), lp, allow_unused=True)
    coef = torch.zeros_like(logp) if coef is None else coef
    delta = logp - ref
    c = p.clip
    inside = mask if c is None else mask & (delta > c.log_eps_p) & (delta < c.log_eps_r)
    aux = torch.zeros((AUX_PLANES[p.mode], *logp.shape), dtype=logp.dtype, device=logp.device)
    aux[0] = inside
    if grpo:
        aux[1], aux[2], aux[3], aux[4] = low, high, k3, torch.where(mask, logp, 0.0)
    else:
        aux[1] = torch.where(mask, logp, 0.0)
    if grad_out is not None:
        logprobs_eager.logprobs_bwd(logits, labels, lse, coef * w_tok.to(coef.dtype), p.temperature,
                                    p.ignore_index, out=grad_out)
    return val.detach(), coef, lse, aux


def token_terms(logits, labels, ref_logps, p, inp=None, *, out=None, segs=None, row_weight=None, grad_out=None):
    grpo = p.mode == MODE_GRPO
    B, T = labels.shape
    adv = klref = None
    if grpo:
        adv = inp.advantages
        adv = adv if adv.dim() == 2 else adv.unsqueeze(1).expand(B, T)
        klref = inp.kl_ref_logps
    w_tok = None if row_weight is None else row_weight.unsqueeze(1).expand(B, T)
    if segs is None:
        res = _terms(logits, labels, ref_logps, p, adv, klref, w_tok, grad_out)
        if out is None:
            return res
        for dst, src in zip(out, res):
            dst.copy_(src)
        return out
    # a fused-linear chunk or a packed batch: its [n, V] rows hold the tokens idx of the whole batch's [B, T] tensors
    idx = logprobs_eager.chunk_tokens(segs, logits.device)
    n, V = logits.shape
    if out is None:  # (zeros: the positions no row maps to)
        dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
        out = tuple(torch.zeros(shape, dtype=dt, device=logits.device)
                    for shape in ((B, T),) * 3 + ((AUX_PLANES[p.mode], B, T),))

    def pick(t):
        return None if t is None else t.reshape(-1)[idx].view(1, n)
    res = _terms(logits.view(1, n, V), pick(labels), pick(ref_logps), p, pick(adv), pick(klref), pick(w_tok),
                 None if grad_out is None else grad_out.view(1, n, V))
    for dst, src in zip(out, res):
        dst.view(*dst.shape[:-2], -1)[..., idx] = src.view(*src.shape[:-2], -1).to(dst.dtype)  # (fp64 hidden states,
        # fp32 planes: as the dense path's copy_)
    return out
