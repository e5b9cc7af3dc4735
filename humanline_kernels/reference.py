r"""Eager PyTorch ground truth for humanline DPO, KTO and GRPO (HALOs semantics).

Plain and obvious on purpose: every fused path is tested against these functions. Notation (per token t of row
i): :math:`\ell` is the policy's log-prob of the label, :math:`\ell_{ref}` the reference's, ``m`` the mask,
:math:`\Delta = \ell - \ell_{ref}`, :math:`\hat\Delta = \mathrm{clamp}(\Delta, p, r)` with the clip band of
:class:`~humanline_kernels.HumanlineClip` (or :math:`\Delta` itself when ``clip=None``).

* ``unclipped_frac = sum(m * [p < Delta < r]) / sum(m)`` (strict; 1.0 without clipping or without tokens).
* DPO: ``s_i = sum_t m * Delta_hat``; ``h_j = beta * (s_j - s_{P+j})`` for chosen rows ``j < P`` and their
  rejected partners ``P + j``; ``loss = mean_j[-(1 - ls) logsigmoid(h_j) - ls logsigmoid(-h_j)]``.
* KTO: ``z0 = max(0, sum_k s^KL_k / #{k: s^KL_k != 0})`` over the KL rows (no gradient; 0 when no row is
  non-zero; sum and count are all-reduced under ``torch.distributed``); desirable rows give
  ``w_D (1 - sigmoid(beta (s_i - z0)))``, undesirable ones ``w_U (1 - sigmoid(beta (z0 - s_i)))``; mean over rows.
* GRPO: ``rho = exp(Delta_hat)``; ``u = -min(A rho, A clamp(rho, 1 - eps_low, 1 + eps_high))``;
  ``k3 = exp(l_kl - l) - (l_kl - l) - 1`` with ``l_kl = kl_ref_logps`` or ``ref_logps`` (never clipped);
  ``L = u + beta k3``, aggregated by ``loss_type`` ("dapo"/"bnpo": ``sum(m L) / (normalizer or sum(m))``;
  "grpo": mean over non-empty rows of the row means; "dr_grpo": ``sum(m L) / (rows * max_completion_length)``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _validation as V
from ._clip import DEFAULT_CLIP, HumanlineClip
from ._params import DPO, GRPO, KTO, GRPOInputs, KTOInputs, Tokens

__all__ = ["token_logprobs", "dpo", "kto", "grpo", "HumanlineClip"]


def token_logprobs(logits, labels, *, temperature=1.0, ignore_index=-100, return_entropy=False, validate=True):
    """fp32 ``log_softmax(logits / temperature)[label]`` shaped like ``labels``; 0 where ``labels == ignore_index``.

    With ``return_entropy`` also returns the (detached) entropy of ``softmax(logits / temperature)``, 0 where ignored.
    """
    V.check_logits(logits, labels, Tokens(temperature=temperature, ignore_index=ignore_index), validate)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    mask = labels != ignore_index
    logp_all = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)
    picked = logp_all.gather(-1, torch.where(mask, labels, 0).unsqueeze(-1)).squeeze(-1)
    logps = torch.where(mask, picked, 0.0)
    if not return_entropy:
        return logps
    with torch.no_grad():
        entropy = torch.special.entr(logp_all.exp()).sum(-1)
        entropy = torch.where(mask, entropy, 0.0)
    return logps, entropy


def _masked_ratio(num, den):
    return torch.where(den > 0, num / den.clamp(min=1), torch.ones_like(num))


def _clipped_log_ratio(logps, ref_logps, mask, clip):
    delta = logps - ref_logps
    if clip is None:
        clipped, inside = delta, mask
    else:
        clipped = torch.clamp(delta, clip.log_eps_p, clip.log_eps_r)
        inside = mask & (delta > clip.log_eps_p) & (delta < clip.log_eps_r)
    clipped = torch.where(mask, clipped, 0.0)
    n = mask.sum().to(logps.dtype)
    unclipped_frac = _masked_ratio(inside.sum().to(logps.dtype), n)
    return clipped, unclipped_frac


def dpo(logps, ref_logps, mask, *, clip=DEFAULT_CLIP, beta=0.1, label_smoothing=0.0):
    """Humanline DPO on ``2P`` rows: ``0..P-1`` chosen, ``P..2P-1`` their rejected partners."""
    V.check_logps(logps, ref_logps, mask)
    V.check_dpo(DPO(clip=clip, beta=beta, label_smoothing=label_smoothing), logps.shape[0])
    clipped, unclipped_frac = _clipped_log_ratio(logps, ref_logps, mask, clip)
    s = clipped.sum(dim=1)
    P = s.shape[0] // 2
    chosen, rejected = s[:P], s[P:]
    h = beta * (chosen - rejected)
    losses = -(1.0 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)
    loss = losses.mean()
    rc, rr = (beta * chosen).detach(), (beta * rejected).detach()
    metrics = {
        "unclipped_frac": unclipped_frac.detach(),
        "rewards_chosen": rc.mean(),
        "rewards_rejected": rr.mean(),
        "reward_margin": (rc - rr).mean(),
        "reward_accuracy": (rc > rr).to(s.dtype).mean(),
    }
    return loss, metrics


def kto(logps, ref_logps, mask, desirable, kl_logps=None, kl_ref_logps=None, kl_mask=None, *,
        clip=DEFAULT_CLIP, beta=0.1, desirable_weight=1.0, undesirable_weight=1.0):
    """Humanline KTO. ``desirable [B]`` bool; the KL rows (mismatched pairs) only set the baseline ``z0``."""
    V.check_logps(logps, ref_logps, mask)
    V.check_kto(KTO(clip=clip, beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight),
                logps.shape[0], logps.device, KTOInputs(desirable, kl_logps, kl_ref_logps, kl_mask))
    clipped, unclipped_frac = _clipped_log_ratio(logps, ref_logps, mask, clip)
    s = clipped.sum(dim=1)
    with torch.no_grad():
        if kl_logps is not None:
            kl_clipped, _ = _clipped_log_ratio(kl_logps, kl_ref_logps, kl_mask, clip)
            s_kl = kl_clipped.sum(dim=1).to(s.dtype)
        else:
            s_kl = s.new_zeros(0)
        total = torch.stack([s_kl.sum(), (s_kl != 0).sum().to(s.dtype)])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(total)
        z0 = torch.where(total[1] > 0, total[0] / total[1].clamp(min=1), 0.0).clamp(min=0.0)
    loss_d = desirable_weight * (1.0 - torch.sigmoid(beta * (s - z0)))
    loss_u = undesirable_weight * (1.0 - torch.sigmoid(beta * (z0 - s)))
    loss = torch.where(desirable, loss_d, loss_u).mean()
    r = (beta * s).detach()
    nd = desirable.sum().to(s.dtype)
    nu = (~desirable).sum().to(s.dtype)
    metrics = {
        "unclipped_frac": unclipped_frac.detach(),
        "kl": z0,
        "rewards_desirable": torch.where(desirable, r, 0.0).sum() / nd.clamp(min=1),
        "rewards_undesirable": torch.where(desirable, 0.0, r).sum() / nu.clamp(min=1),
    }
    return loss, metrics


def grpo(logps, ref_logps, advantages, mask, *, clip=DEFAULT_CLIP, beta=0.0, epsilon_low=0.2, epsilon_high=0.2,
         kl_ref_logps=None, loss_type="dapo", normalizer=None, max_completion_length=None):
    """Humanline GRPO: the ratio's denominator is the (humanline-synced) reference; ``advantages [B]``."""
    V.check_logps(logps, ref_logps, mask)
    B, T = logps.shape
    norm_t = normalizer if isinstance(normalizer, torch.Tensor) else None
    V.check_grpo(GRPO(clip=clip, beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high, loss_type=loss_type,
                      normalizer=None if norm_t is not None else normalizer,
                      max_completion_length=max_completion_length),
                 logps.shape, logps, GRPOInputs(advantages, kl_ref_logps, norm_t))
    clipped, unclipped_frac = _clipped_log_ratio(logps, ref_logps, mask, clip)
    A = advantages.to(logps.dtype).unsqueeze(1)
    ratio = torch.exp(clipped)
    u = -torch.minimum(A * ratio, A * torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high))
    l_kl = ref_logps if kl_ref_logps is None else kl_ref_logps
    x = torch.where(mask, l_kl - logps, 0.0)
    k3 = torch.exp(x) - x - 1.0
    per_token = u + beta * k3 if beta != 0 else u
    per_token = torch.where(mask, per_token, 0.0)

    mf = mask.to(logps.dtype)
    n = mf.sum()
    if loss_type in ("dapo", "bnpo"):
        den = n.clamp(min=1) if normalizer is None else torch.as_tensor(normalizer, dtype=logps.dtype).reshape(())
        loss = per_token.sum() / den
    elif loss_type == "grpo":
        row_n = mf.sum(dim=1)
        row_mean = per_token.sum(dim=1) / row_n.clamp(min=1)
        loss = row_mean.sum() / (row_n > 0).sum().clamp(min=1)
    else:  # dr_grpo
        loss = per_token.sum() / (B * (T if max_completion_length is None else max_completion_length))

    with torch.no_grad():
        low = mask & (ratio < 1.0 - epsilon_low) & (A < 0)
        high = mask & (ratio > 1.0 + epsilon_high) & (A > 0)
        den = n.clamp(min=1)
        metrics = {
            "unclipped_frac": unclipped_frac.detach(),
            "kl": torch.where(mask, k3, 0.0).sum() / den,
            "clip_frac_low": low.sum().to(logps.dtype) / den,
            "clip_frac_high": high.sum().to(logps.dtype) / den,
        }
    return loss, metrics
