"""Humanline DPO / KTO / GRPO from per-token log-probs (eager, any device, no host sync).

This is the level for people who already have per-token log-probs (TRL, verl, HALOs). The math is the one of
:mod:`humanline_kernels.reference`; it is factored here into the pieces that the fused paths reuse, so that the
sequence-level math exists once:

* :func:`clip_log_ratio` - the humanline clamp and the ``unclipped_frac`` counts;
* :func:`dpo_from_sums`, :func:`kto_from_sums`, :func:`kto_baseline` - DPO/KTO from per-row clipped sums;
* :func:`grpo_token_terms` and :func:`grpo_aggregate` - GRPO's per-token term (every TRL 1.16 loss type, from
  :func:`grpo_policy_term`) and its aggregations; the token weights (:func:`grpo_off_policy_mask`,
  :func:`grpo_high_entropy_mask`, VESPO's :func:`grpo_vespo_weights`) and :func:`grpo_entropy_bonus`;
* :func:`compute` - the loss a params object (:mod:`humanline_kernels._params`) names, on checked inputs: where
  the eager path of every input level ends (fused and fused-linear calls on CPU tensors, fp64).

The Triton kernels compute the same math in two launches (per token in the log-prob pass, then the ``[B, T]``
tail); their eager twins (``humanline_kernels.ops.*.eager``) are written with these functions.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import _layout, _objectives, _validation
from ._clip import clamp_band
from ._params import DPO, GRPO, IPO, KTO, DPOInputs, GRPOInputs, KTOInputs, Sequence, SimPO, SLiC, options
from .ops.constants import Terms

__all__ = ["dpo", "kto", "grpo", "ipo", "simpo", "slic", "sequence_logratios", "compute", "clip_log_ratio",
           "dpo_from_sums", "kto_from_sums", "kto_baseline", "kto_kl_baseline", "grpo_token_terms", "grpo_aggregate",
           "grpo_policy_term", "grpo_log_weights", "grpo_vespo_weights", "grpo_off_policy_mask",
           "grpo_high_entropy_mask", "grpo_entropy_bonus", "token_advantages"]


def _frac(num, den):
    """``num / den`` with 1.0 where ``den == 0`` (no tokens: nothing was clipped)."""
    return torch.where(den > 0, num / den.clamp(min=1), torch.ones_like(num))


def clip_log_ratio(logps, ref_logps, mask, clip):
    """Return ``(Delta_hat, n_inside, n_tokens)``: the clamped log-ratio (0 where masked out), the number of masked
    tokens strictly inside the band, and the number of masked tokens (both as tensors of ``logps.dtype``)."""
    delta = logps - ref_logps
    if clip is None:
        clipped, inside = delta, mask
    else:
        clipped = clamp_band(delta, clip.log_eps_p, clip.log_eps_r)
        inside = mask & (delta > clip.log_eps_p) & (delta < clip.log_eps_r)
    clipped = torch.where(mask, clipped, 0.0)
    return clipped, inside.sum().to(logps.dtype), mask.sum().to(logps.dtype)


def dpo_from_sums(s, *, beta, label_smoothing):
    """DPO loss and reward metrics from the per-row clipped sums ``s [2P]`` (chosen rows first)."""
    P = s.shape[0] // 2
    chosen, rejected = s[:P], s[P:]
    h = beta * (chosen - rejected)
    loss = (-(1.0 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)).mean()
    with torch.no_grad():
        rc, rr = beta * chosen, beta * rejected
        metrics = {
            "rewards_chosen": rc.mean(),
            "rewards_rejected": rr.mean(),
            "reward_margin": (rc - rr).mean(),
            "reward_accuracy": (rc > rr).to(s.dtype).mean(),
        }
    return loss, metrics


def distributed() -> bool:
    """Whether :func:`kto_baseline` all-reduces (torch.distributed initialised): the kernel paths then take ``z0``
    from it rather than from their own finalize kernel."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@torch.no_grad()
def kto_baseline(s_kl, kl_estimate="halos"):
    """KTO's detached baseline from the KL rows' clipped sums ``s_kl``: HALOs' ``max(0, sum(s_kl) / #{s_kl != 0})``
    (0 with no non-zero row; sum and count all-reduced across ranks), or TRL's ``max(0, mean(s_kl))`` over every
    row (a rank's mean, then the mean of the ranks' means)."""
    if kl_estimate == "halos":
        total = torch.stack([s_kl.sum(), (s_kl != 0).sum().to(s_kl.dtype)])
    else:
        local_mean = s_kl.sum() / max(s_kl.shape[0], 1)
        total = torch.stack([local_mean, torch.ones_like(local_mean)])
    if distributed():
        torch.distributed.all_reduce(total)
    return torch.where(total[1] > 0, total[0] / total[1].clamp(min=1), 0.0).clamp(min=0.0)


@torch.no_grad()
def kto_kl_baseline(kl_logps, kl_ref_logps, kl_mask, clip, like, kl_estimate="halos"):
    """:func:`kto_baseline` of the KL rows' clipped sums (no rows when ``kl_logps`` is None: ``z0 = 0``), detached,
    in ``like``'s dtype and device."""
    s_kl = like.new_zeros(0) if kl_logps is None else \
        clip_log_ratio(kl_logps, kl_ref_logps, kl_mask, clip)[0].sum(dim=1).to(like.dtype)
    return kto_baseline(s_kl, kl_estimate)


def kto_from_sums(s, z0, desirable, *, beta, desirable_weight, undesirable_weight, loss_type="kto"):
    """KTO loss and reward metrics from per-row clipped sums ``s [B]`` and the detached baseline ``z0``;
    ``loss_type="apo_zero_unpaired"`` (TRL 1.16) has no baseline (``z0`` is 0 then)."""
    if loss_type == "kto":
        loss_d = desirable_weight * (1.0 - torch.sigmoid(beta * (s - z0)))
        loss_u = undesirable_weight * (1.0 - torch.sigmoid(beta * (z0 - s)))
    else:  # push desirable log-ratios up and undesirable ones down
        loss_d = desirable_weight * (1.0 - torch.sigmoid(beta * s))
        loss_u = undesirable_weight * torch.sigmoid(beta * s)
    loss = torch.where(desirable, loss_d, loss_u).mean()
    with torch.no_grad():
        r = beta * s
        nd = desirable.sum().to(s.dtype).clamp(min=1)
        nu = (~desirable).sum().to(s.dtype).clamp(min=1)
        metrics = {
            "kl": z0,
            "rewards_desirable": torch.where(desirable, r, 0.0).sum() / nd,
            "rewards_undesirable": torch.where(desirable, 0.0, r).sum() / nu,
        }
    return loss, metrics


def token_advantages(advantages, like):
    """``advantages`` ``[B]`` (one per sequence) as ``[B, 1]``, or ``[B, T]`` (one per token: PPO, verl) as it is,
    in ``like``'s dtype."""
    A = advantages.to(like.dtype)
    return A if A.dim() == like.dim() else A.unsqueeze(-1)


def grpo_log_weights(clipped, mask, importance_sampling_level="token"):
    """The log importance weight: ``Delta_hat`` per token (``[B, T]``), or GSPO's ``mean_t m Delta_hat`` per
    sequence (``[B, 1]``, 0 for an empty row). ``clipped`` is 0 where masked out."""
    if importance_sampling_level == "token":
        return clipped
    n = mask.sum(dim=1, keepdim=True).to(clipped.dtype)
    return clipped.sum(dim=1, keepdim=True) / n.clamp(min=1)


def grpo_policy_term(logps, log_w, A, mask, *, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2, delta=None,
                     sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, phi=None):
    """The per-token policy term ``u`` of TRL 1.16's ``loss_type`` (before the token weights and the KL term) and
    the masked tokens where a clip is the active branch, ``(u, low, high)``. ``rho = exp(log_w)``:

    * PPO clip ("dapo", "bnpo", "grpo", "dr_grpo", "luspo"): ``-min(A rho', A clamp(rho, 1 - eps_low,
      1 + eps_high))``, ``rho' = min(rho, delta)`` with two-sided clipping (INTELLECT-2), else ``rho``;
    * "cispo": ``-sg(min(rho, eps_high)) A l`` (the cap clips the weight, never the gradient of ``l``);
    * "sapo": ``-(4 / tau) sigmoid(tau (rho - 1)) A``, ``tau`` by the sign of ``A``;
    * "vespo": ``-phi A l`` with the detached sequence weight ``phi`` (:func:`grpo_vespo_weights`).
    """
    ratio = torch.exp(log_w)
    none = torch.zeros_like(mask)
    if loss_type in ("cispo", "vespo"):  # they weight the policy's own log-prob, not a ratio
        weight = torch.clamp(ratio, max=epsilon_high).detach() if loss_type == "cispo" else phi
        u = -weight * A * torch.where(mask, logps, 0.0)
        high = mask & (ratio > epsilon_high) & (A > 0) if loss_type == "cispo" else none
        return u, none, high
    if loss_type == "sapo":  # a soft gate instead of the clip: no clipped tokens to count
        tau = torch.where(A > 0, A.new_tensor(sapo_temperature_pos), A.new_tensor(sapo_temperature_neg))
        return -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * A, none, none
    capped = ratio if delta is None else clamp_band(ratio, hi=delta)
    u = -torch.minimum(A * capped, A * clamp_band(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high))
    with torch.no_grad():
        low = mask & (capped < 1.0 - epsilon_low) & (A < 0)
        high = mask & (capped > 1.0 + epsilon_high) & (A > 0)
    return u, low, high


def grpo_token_terms(logps, clipped, kl_ref_logps, advantages, mask, *, beta, epsilon_low, epsilon_high,
                     loss_type="dapo", importance_sampling_level="token", delta=None, sapo_temperature_pos=1.0,
                     sapo_temperature_neg=1.05, phi=None, weight=None, use_bias_correction_kl=False):
    """Per-token GRPO term ``L = w u + beta k3`` (0 where masked out), the per-token KL term (detached) and the clip
    indicators: ``(L, kl, low, high)``. ``advantages`` is ``[B]`` (one per sequence) or shaped like ``logps`` (one
    per token); ``u`` is :func:`grpo_policy_term`'s (``loss_type``, the importance level and its options), ``w``
    the detached token ``weight`` (masks and the vLLM importance weight; None: 1).

    ``clipped`` is the clamped log-ratio against the ratio's reference; ``kl_ref_logps`` is the (unclipped)
    reference of the k3 estimator ``k3 = exp(l_kl - l) - (l_kl - l) - 1``, multiplied by the importance weight
    ``rho`` when ``use_bias_correction_kl`` (and ``beta != 0``), as TRL does.
    """
    A = token_advantages(advantages, logps)
    log_w = grpo_log_weights(clipped, mask, importance_sampling_level)
    u, low, high = grpo_policy_term(logps, log_w, A, mask, loss_type=loss_type, epsilon_low=epsilon_low,
                                    epsilon_high=epsilon_high, delta=delta, sapo_temperature_pos=sapo_temperature_pos,
                                    sapo_temperature_neg=sapo_temperature_neg, phi=phi)
    if weight is not None:
        u = u * weight
    x = torch.where(mask, kl_ref_logps - logps, 0.0)
    kl = torch.exp(x) - x - 1.0
    if beta != 0 and use_bias_correction_kl:
        kl = kl * torch.exp(log_w)
    per_token = torch.where(mask, u + beta * kl if beta != 0 else u, 0.0)
    return per_token, kl.detach(), low, high


def grpo_aggregate(per_token, mask, *, loss_type, normalizer, max_completion_length):
    """GRPO aggregation of ``per_token [B, T]`` (already 0 where masked out) by ``loss_type``: over the tokens
    ("dapo", "bnpo", "cispo", "vespo": ``normalizer`` or the token count), the mean of the non-empty rows' means
    ("grpo", "sapo"), over ``B * max_completion_length`` ("dr_grpo"; ``T`` when not given), over the rows
    ("luspo": each sequence's sum, averaged)."""
    B, T = per_token.shape
    if loss_type in ("dapo", "bnpo", "cispo", "vespo"):
        if normalizer is None:
            den = mask.sum().to(per_token.dtype).clamp(min=1)
        else:  # a 1-element tensor (e.g. an all-reduced token count) must still give a 0-d loss
            den = normalizer.reshape(()) if isinstance(normalizer, torch.Tensor) else normalizer
        return per_token.sum() / den
    if loss_type in ("grpo", "sapo"):
        row_n = mask.sum(dim=1).to(per_token.dtype)
        row_mean = per_token.sum(dim=1) / row_n.clamp(min=1)
        return row_mean.sum() / (row_n > 0).sum().to(per_token.dtype).clamp(min=1)
    if loss_type == "luspo":
        return per_token.sum() / B
    return per_token.sum() / (B * (T if max_completion_length is None else max_completion_length))


@torch.no_grad()
def grpo_vespo_weights(clipped, mask, A, importance_sampling_ratio, *, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
                       vespo_k_neg=3.0, vespo_lambda_neg=2.0):
    """VESPO's sequence weight ``phi(w) = exp(lambda (1 - w)) w^k`` (shaped like ``A``, detached; ``phi(1) = 1``) of the
    sequence ratio ``w = exp(sum_t m Delta_hat)`` times the product of the per-token vLLM weights, computed in log
    space with TRL's bounds (each log-ratio within +-20, ``log w`` within ``[log 1e-8, 20]``); ``k`` and ``lambda``
    by the sign of the row's advantage, ``lambda >= 1e-4``. A non-finite ``phi`` counts as 0."""
    floor = math.log(1e-8)
    log_w = torch.where(mask, clipped.clamp(-20.0, 20.0), 0.0).sum(dim=1, keepdim=True)
    if importance_sampling_ratio is not None:
        log_is = torch.log(importance_sampling_ratio.to(clipped.dtype)).clamp(floor, 20.0)
        log_w = log_w + torch.where(mask, log_is, 0.0).sum(dim=1, keepdim=True)
    log_w = log_w.clamp(floor, 20.0)
    pos = A >= 0  # [B, 1], or [B, T] with per-token advantages (then phi is per token, as in TRL)
    k = torch.where(pos, A.new_tensor(vespo_k_pos), A.new_tensor(vespo_k_neg))
    lam = torch.where(pos, A.new_tensor(vespo_lambda_pos), A.new_tensor(vespo_lambda_neg)).clamp(min=1e-4)
    phi = torch.exp(lam * (1.0 - torch.exp(log_w)) + k * log_w)
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


@torch.no_grad()
def grpo_off_policy_mask(logps, sampling_logps, mask, A, threshold):
    """DeepSeek-V3.2's off-policy sequence mask (TRL 1.16 ``GRPOTrainer.get_off_policy_mask``), detached:
    a row is dropped (0) when its advantage is negative and its mean ``sampling_logps - l`` over the masked tokens
    (NaN sampler log-probs count as 0) exceeds ``threshold``; else kept (1). Shaped like ``A``'s rows."""
    gap = torch.where(mask, torch.nan_to_num(sampling_logps - logps, nan=0.0), 0.0)
    mean_gap = gap.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1).to(gap.dtype)
    return ((A >= 0) | (mean_gap <= threshold)).to(logps.dtype)


@torch.no_grad()
def grpo_high_entropy_mask(entropies, mask, top_entropy_quantile):
    """The masked tokens in the top ``top_entropy_quantile`` of this batch's masked entropies: entropy at least the
    ``1 - top_entropy_quantile`` quantile (TRL 1.16 ``GRPOTrainer.get_high_entropy_mask`` takes the quantile over
    every rank's tokens; a trainer that wants that passes its mask as ``entropy_mask``)."""
    values = entropies[mask]
    if values.numel() == 0:
        return torch.zeros_like(mask)
    values = values if values.dtype in (torch.float32, torch.float64) else values.float()  # (what quantile takes)
    return mask & (entropies >= torch.quantile(values, 1.0 - top_entropy_quantile).to(entropies.dtype))


def grpo_entropy_bonus(entropies, mask, *, entropy_coef, use_adaptive_entropy=False, entropy_target=0.2,
                       last_world_entropy=math.inf):
    """``(c H, H)``: the entropy bonus subtracted from the loss and the mean entropy ``H`` over ``mask`` (the tokens
    the policy term acts on); gradients flow through ``entropies`` when it requires them. ``c = entropy_coef``,
    but 0 under adaptive control while ``last_world_entropy > entropy_target`` (the last optimizer step's
    all-reduced mean entropy; inf before the first: no bonus until a measurement exists)."""
    H = torch.where(mask, entropies, 0.0).sum() / mask.sum().to(entropies.dtype).clamp(min=1)
    gated = use_adaptive_entropy and not last_world_entropy <= entropy_target
    return (0.0 if gated else entropy_coef) * H, H


def input_grads(p, logps, ref_logps, mask, inp, g, needs):
    """The gradients a kernel path owes the loss's ``[B, T]`` inputs besides the logits (the row kernels
    differentiate only the policy's log-probs): ``d/dx sum(g * val)`` for ``x`` in ``(ref_logps, advantages,
    kl_ref_logps)``, each where ``needs`` asks for it (else None). ``val`` is the loss's masked per-token term, the
    clamped log-ratio or GRPO's term, from the functions the eager path runs, at the policy log-probs ``logps`` that
    the row kernel wrote; ``g = d loss / d val`` (``[B, 1]`` or ``[B, T]``). Small ``[B, T]`` tensors only."""
    with torch.enable_grad():
        ref = ref_logps.detach().requires_grad_(needs[0])
        val = clip_log_ratio(logps, ref, mask, p.clip)[0]
        leaves = [ref]
        if p.mode == Terms.GRPO:
            A = inp.advantages.detach().requires_grad_(needs[1])
            klr = ref if inp.kl_ref_logps is None else inp.kl_ref_logps.detach().requires_grad_(needs[2])
            val = grpo_token_terms(logps, val, klr, A, mask, beta=p.beta, epsilon_low=p.epsilon_low,
                                   epsilon_high=p.epsilon_high)[0]
            leaves += [A, klr]
        want = [t for t, n in zip(leaves, needs) if n]
        got = torch.autograd.grad(val, want, g.to(val.dtype).expand_as(val), allow_unused=True)
    got = iter(torch.zeros_like(t) if d is None else d for t, d in zip(want, got))  # unused: an exact 0
    return [next(got) if n else None for n in needs]


# ------------------------------------------------------------------ the sequence-level primitive
def sequence_metrics(n_inside, n):
    """The primitive's metrics (detached 0-d): ``unclipped_frac``, ``n_tokens``, ``n_unclipped``."""
    return {"unclipped_frac": _frac(n_inside, n).detach(), "n_tokens": n.detach(), "n_unclipped": n_inside.detach()}


def sequence_rows(logps, ref_logps, mask, clip, token_weights=None):
    """``(Rows, metrics)`` of per-token log-probs: ``s = sum_t m w Delta_hat`` (``w`` the token weights, else 1;
    ``ref_logps=None`` is a reference of 0), the policy's sums and the token counts (:class:`._objectives.Rows`)."""
    ref = torch.zeros_like(logps) if ref_logps is None else ref_logps
    clipped, n_in, n = clip_log_ratio(logps, ref, mask, clip)
    s = (clipped if token_weights is None else clipped * token_weights.to(logps.dtype)).sum(dim=1)
    rows = _objectives.Rows(s, torch.where(mask, logps, 0.0).sum(dim=1), mask.sum(dim=1).to(logps.dtype))
    return rows, sequence_metrics(n_in, n)


def mean_sums(rows):
    """``s`` divided by each row's token count (0 for an empty row)."""
    return rows.s / rows.counts.clamp(min=1)


def from_rows(p, rows, metrics, inp=None, mixture=None):
    """The objective ``p`` names from per-row sums (:class:`._objectives.Rows`, from any level's primitive):
    ``(loss, metrics)``. ``mixture``: DPO's checked ``(loss_types, weights)``; ``inp``: KTO's inputs."""
    if p.name == "ipo":
        loss, m = _objectives.ipo_from_sums(mean_sums(rows), beta=p.beta)
    elif p.name == "simpo":
        loss, m = _objectives.simpo_from_sums(mean_sums(rows), beta=p.beta, gamma_beta_ratio=p.gamma_beta_ratio)
    elif p.name == "slic":
        loss, m = _objectives.slic_from_sums(rows.s, rows.policy, beta=p.beta, lambda_coef=p.lambda_coef)
    elif p.name == "dpo":
        types, weights = mixture
        loss, m = _objectives.dpo_from_rows(rows, beta=p.beta, label_smoothing=p.label_smoothing, loss_types=types,
                                            weights=weights, f_divergence_type=p.f_divergence_type,
                                            f_alpha_divergence_coef=p.f_alpha_divergence_coef,
                                            discopop_tau=p.discopop_tau)
    else:  # KTO apo_zero_unpaired: no baseline
        loss, m = kto_from_sums(rows.s, rows.s.new_zeros(()), inp.desirable, beta=p.beta,
                                desirable_weight=p.desirable_weight, undesirable_weight=p.undesirable_weight,
                                loss_type=p.loss_type)
    return loss, {"unclipped_frac": metrics["unclipped_frac"], **m}


def dpo_rows(logps, ref_logps, mask, clip, *, ld_alpha=None, aot=False, log_sum_sq_probs=None):
    """``(Rows, metrics, token_weights)`` that DPO's loss types read, from per-token log-probs: the clamped sums
    (LD-DPO's token weights with ``ld_alpha``, returned too, else None), with ``aot`` the policy's and the
    reference's own sums (``clip`` must be None: "aot" sorts them apart), with ``log_sum_sq_probs`` WPO's detached
    pair weights ``exp(mean_t (log p - log sum_v p_v^2))``. The TRL trainer calls it too."""
    tw = None if ld_alpha is None else _objectives.ld_weights(mask, ld_alpha, logps.dtype)
    rows, m = sequence_rows(logps, ref_logps, mask, clip, tw)
    if aot:
        rows = rows._replace(aot_policy=_weighted_sum(logps, mask, tw),
                             aot_reference=_weighted_sum(ref_logps, mask, tw))
    if log_sum_sq_probs is not None:
        with torch.no_grad():
            lssp = log_sum_sq_probs.to(logps.dtype)
            rows = rows._replace(wpo=torch.exp(_weighted_sum(logps - lssp, mask, None) / rows.counts.clamp(min=1)))
    return rows, m, tw


# ------------------------------------------------------------------ each loss given its checked params
def _dpo(p, logps, ref_logps, mask, inp):
    if not p.fast:  # TRL's loss types and options: the sequence sums, then the batch math of _objectives
        types, weights = _objectives.mixture(p.loss_type, p.loss_weights, p.rpo_alpha)
        rows, m, _ = dpo_rows(logps, ref_logps, mask, p.clip, ld_alpha=p.ld_alpha, aot="aot" in types,
                              log_sum_sq_probs=inp.log_sum_sq_probs if p.use_weighting else None)
        return from_rows(p, rows, m, mixture=(types, weights))
    clipped, n_in, n = clip_log_ratio(logps, ref_logps, mask, p.clip)
    loss, metrics = dpo_from_sums(clipped.sum(dim=1), beta=p.beta, label_smoothing=p.label_smoothing)
    metrics["unclipped_frac"] = _frac(n_in, n).detach()
    return loss, metrics


def _weighted_sum(x, mask, token_weights):
    x = torch.where(mask, x, 0.0)
    return (x if token_weights is None else x * token_weights).sum(dim=1)


def _kto(p, logps, ref_logps, mask, inp):
    clipped, n_in, n = clip_log_ratio(logps, ref_logps, mask, p.clip)
    s = clipped.sum(dim=1)
    z0 = inp.z0
    if z0 is None:
        z0 = kto_kl_baseline(inp.kl_logps, inp.kl_ref_logps, inp.kl_mask, p.clip, s, p.kl_estimate)
    loss, metrics = kto_from_sums(s, z0.to(s.dtype), inp.desirable, beta=p.beta, desirable_weight=p.desirable_weight,
                                  undesirable_weight=p.undesirable_weight, loss_type=p.loss_type)
    metrics["unclipped_frac"] = _frac(n_in, n).detach()
    return loss, metrics


def _sequence_loss(p, logps, ref_logps, mask, inp):
    rows, m = sequence_rows(logps, ref_logps if p.name == "ipo" else None, mask, p.clip)
    return from_rows(p, rows, m, inp)


def _grpo(p, logps, ref_logps, mask, inp):
    """GRPO with every TRL 1.16 option the params and inputs carry (the defaults are the kernels' four loss types
    on a token-level ratio); see :func:`grpo`."""
    if inp.tool_mask is not None:
        mask = mask & (inp.tool_mask != 0)
    clipped, n_in, n = clip_log_ratio(logps, ref_logps, mask, p.clip)
    A = token_advantages(inp.advantages, logps)
    weight, entropy_mask = _grpo_token_weights(p, logps, ref_logps, mask, A, inp)
    phi = None
    if p.loss_type == "vespo":
        phi = grpo_vespo_weights(clipped, mask, A, inp.importance_sampling_ratio, **p.vespo)
    klr = ref_logps if inp.kl_ref_logps is None else inp.kl_ref_logps
    per_token, kl, low, high = grpo_token_terms(
        logps, clipped, klr, A, mask, beta=p.beta, epsilon_low=p.epsilon_low, epsilon_high=p.epsilon_high,
        loss_type=p.loss_type, importance_sampling_level=p.importance_sampling_level, delta=p.delta,
        sapo_temperature_pos=p.sapo_temperature_pos, sapo_temperature_neg=p.sapo_temperature_neg, phi=phi,
        weight=weight, use_bias_correction_kl=p.use_bias_correction_kl)
    norm = inp.normalizer if inp.normalizer is not None else p.normalizer
    loss = grpo_aggregate(per_token, mask, loss_type=p.loss_type, normalizer=norm,
                          max_completion_length=p.max_completion_length)
    den = n.clamp(min=1)
    metrics = {
        "unclipped_frac": _frac(n_in, n).detach(),
        "kl": torch.where(mask, kl, 0.0).sum() / den,
        "clip_frac_low": low.expand_as(mask).sum().to(n.dtype) / den,
        "clip_frac_high": high.expand_as(mask).sum().to(n.dtype) / den,
    }
    acting = mask if entropy_mask is None else mask & entropy_mask  # the tokens the policy term acts on
    if p.entropy_coef != 0.0 or p.use_adaptive_entropy:
        bonus, _ = grpo_entropy_bonus(inp.entropies, acting, entropy_coef=p.entropy_coef,
                                      use_adaptive_entropy=p.use_adaptive_entropy, entropy_target=p.entropy_target,
                                      last_world_entropy=p.last_world_entropy)
        metrics["policy_loss"] = loss.detach()
        loss = loss - bonus
    if inp.entropies is not None:
        metrics.update(_entropy_metrics(inp.entropies.detach(), mask, acting, den))
    if phi is not None:
        metrics["vespo_phi_mean"] = phi.mean() if phi.shape[1] == 1 else torch.where(mask, phi, 0.0).sum() / den
    return loss, metrics


@torch.no_grad()
def _grpo_token_weights(p, logps, ref_logps, mask, A, inp):
    """The detached weight of the policy term (TRL's order: the off-policy mask, the high-entropy mask, the vLLM
    importance weight; None when none applies) and the high-entropy mask (or None)."""
    weight = None
    if p.off_policy_mask_threshold is not None:
        sampling = ref_logps if inp.sampling_per_token_logps is None else inp.sampling_per_token_logps
        weight = grpo_off_policy_mask(logps, sampling, mask, A, p.off_policy_mask_threshold)
    entropy_mask = inp.entropy_mask
    if entropy_mask is None and p.top_entropy_quantile < 1.0:
        entropy_mask = grpo_high_entropy_mask(inp.entropies, mask, p.top_entropy_quantile)
    if entropy_mask is not None:
        entropy_mask = entropy_mask & mask
        weight = _times(weight, entropy_mask.to(logps.dtype))
    if inp.importance_sampling_ratio is not None and p.loss_type != "vespo":  # VESPO folds it into phi
        ratio = inp.importance_sampling_ratio.to(logps.dtype)
        weight = _times(weight, ratio if ratio.dim() == 2 else ratio.reshape(-1, 1))
    return weight, entropy_mask


def _times(a, b):
    return b if a is None else a * b


def _entropy_metrics(entropies, mask, acting, den):
    """``entropy`` (mean over the masked tokens), and the adaptive controller's window terms over the tokens the
    policy term acts on: ``entropy_sum``, ``entropy_tokens``."""
    return {"entropy": torch.where(mask, entropies, 0.0).sum() / den,
            "entropy_sum": torch.where(acting, entropies, 0.0).sum(),
            "entropy_tokens": acting.sum().to(entropies.dtype)}


_LOSSES = {"dpo": _dpo, "kto": _kto, "grpo": _grpo, "ipo": _sequence_loss, "simpo": _sequence_loss,
           "slic": _sequence_loss}


def compute(p, logps, ref_logps, mask, inp):
    """The loss that the params object ``p`` names (:mod:`humanline_kernels._params`), on checked per-token inputs:
    ``(loss, metrics)``. Every level's eager path ends here."""
    return _LOSSES[p.name](p, logps, ref_logps, mask, inp)


# ------------------------------------------------------------------ layouts: a packed batch on the padded rows
def unpacked(packed, logps, *per_token, per_sequence=(), names=("packed", "logps")):
    """The per-token tensors of a packed batch (``[N]`` or ``[1, N]``, shaped like ``logps``; others, e.g. one
    advantage per sequence, pass as they are) on the padded rows ``[S, T]`` that every loss is defined on (a scatter,
    differentiable; :class:`~humanline_kernels.Packed`); all as given without one. ``per_sequence``: the positions
    in ``per_token`` of inputs that may hold one value per sequence (:func:`._layout.unpack_like`). ``names``: the
    arguments ``packed`` and ``logps`` were given as, for the messages."""
    if packed is None:
        return (logps, *per_token)
    _layout.check_packed(names[1], logps, logps, None, packed, packed_name=names[0])
    tm = _layout.packed_map(packed, logps.numel(), logps.device, name=names[0])
    return (_layout.unpack_like(logps, tm, logps),
            *(_layout.unpack_like(t, tm, logps, i in per_sequence) for i, t in enumerate(per_token)))


def kl_rows(kl_logps, kl_ref_logps, kl_mask, kl_packed):
    """KTO's KL rows on padded rows (``kl_packed``: they come packed, with boundaries of their own)."""
    if kl_packed is None:
        return kl_logps, kl_ref_logps, kl_mask
    if kl_logps is None and kl_ref_logps is None and kl_mask is None:
        raise ValueError("kl_packed gives the boundaries of the KL rows: pass kl_logps, kl_ref_logps and kl_mask "
                         "with it (or kl_packed=None)")
    if kl_logps is None:  # (the three come together or not at all: check_kto names them)
        return kl_logps, kl_ref_logps, kl_mask
    return unpacked(kl_packed, kl_logps, kl_ref_logps, kl_mask, names=("kl_packed", "kl_logps"))


# ------------------------------------------------------------------ the public functions of this level
@options(Sequence)
def sequence_logratios(logps, ref_logps, mask, *, clip, normalize, packed=None):
    """``(s [B], policy_sums [B], metrics)``: per-sequence sums of the clamped log-ratio (divided by the token count
    when ``normalize``) and of the policy's log-probs (never clamped); ``ref_logps=None`` is a reference of 0.
    Differentiable; see :func:`humanline_kernels.reference.sequence_logratios`. ``packed``
    (:class:`~humanline_kernels.Packed`): the per-token tensors are a padding-free batch ``[N]``, one sum per
    sequence (the same at every loss of this level)."""
    logps, ref_logps, mask = unpacked(packed, logps, ref_logps, mask)
    p = Sequence(clip=clip, normalize=normalize)
    _validation.check_logps(logps, logps if ref_logps is None else ref_logps, mask)
    _validation.check_sequence(p)
    rows, metrics = sequence_rows(logps, ref_logps, mask, clip)
    return (mean_sums(rows) if normalize else rows.s), rows.policy, metrics


@options(IPO)
def ipo(logps, ref_logps, mask, *, clip, beta, packed=None):
    """Humanline IPO from ``[2P, T]`` log-probs (HALOs' IPO; TRL's "ipo"); see
    :func:`humanline_kernels.reference.ipo`."""
    logps, ref_logps, mask = unpacked(packed, logps, ref_logps, mask)
    p = IPO(clip=clip, beta=beta)
    _validation.check_logps(logps, ref_logps, mask)
    _validation.check_ipo(p, logps.shape[0])
    return _sequence_loss(p, logps, ref_logps, mask, None)


@options(SimPO)
def simpo(logps, mask, *, clip, beta, gamma_beta_ratio, packed=None):
    """Humanline SimPO (a reference of 0); see :func:`humanline_kernels.reference.simpo`."""
    logps, _, mask = unpacked(packed, logps, None, mask)
    p = SimPO(clip=clip, beta=beta, gamma_beta_ratio=gamma_beta_ratio)
    _validation.check_logps(logps, logps, mask)
    _validation.check_simpo(p, logps.shape[0])
    return _sequence_loss(p, logps, None, mask, None)


@options(SLiC)
def slic(logps, mask, *, clip, beta, lambda_coef, packed=None):
    """Humanline SLiC (a reference of 0); see :func:`humanline_kernels.reference.slic`."""
    logps, _, mask = unpacked(packed, logps, None, mask)
    p = SLiC(clip=clip, beta=beta, lambda_coef=lambda_coef)
    _validation.check_logps(logps, logps, mask)
    _validation.check_slic(p, logps.shape[0])
    return _sequence_loss(p, logps, None, mask, None)


@options(DPO)
def dpo(logps, ref_logps, mask, *, clip, beta, label_smoothing, loss_type, loss_weights, rpo_alpha, f_divergence_type,
        f_alpha_divergence_coef, ld_alpha, discopop_tau, use_weighting, log_sum_sq_probs=None, packed=None):
    """Humanline DPO from ``[2P, T]`` log-probs, TRL 1.16's loss types and options too; returns ``(loss,
    metrics)``. See :func:`humanline_kernels.reference.dpo`. ``packed``: ``2P`` packed sequences, chosen first."""
    logps, ref_logps, mask, log_sum_sq_probs = unpacked(packed, logps, ref_logps, mask, log_sum_sq_probs)
    p = DPO(clip=clip, beta=beta, label_smoothing=label_smoothing, loss_type=loss_type, loss_weights=loss_weights,
            rpo_alpha=rpo_alpha, f_divergence_type=f_divergence_type, f_alpha_divergence_coef=f_alpha_divergence_coef,
            ld_alpha=ld_alpha, discopop_tau=discopop_tau, use_weighting=use_weighting)
    inp = DPOInputs(log_sum_sq_probs)
    _validation.check_logps(logps, ref_logps, mask)
    _validation.check_dpo(p, logps.shape[0], logps, inp)
    return _dpo(p, logps, ref_logps, mask, inp)


@options(KTO)
def kto(logps, ref_logps, mask, desirable, kl_logps=None, kl_ref_logps=None, kl_mask=None, *, clip, beta,
        desirable_weight, undesirable_weight, loss_type, kl_estimate, packed=None, kl_packed=None):
    """Humanline KTO; the KL rows (``kl_*``, optional) only set the detached baseline ``z0`` (``kl_estimate``:
    HALOs' or TRL's); ``loss_type="apo_zero_unpaired"`` has none. See :func:`humanline_kernels.reference.kto`.
    ``packed`` / ``kl_packed``: the rows / the KL rows come packed, each with boundaries of its own."""
    logps, ref_logps, mask = unpacked(packed, logps, ref_logps, mask)
    kl_logps, kl_ref_logps, kl_mask = kl_rows(kl_logps, kl_ref_logps, kl_mask, kl_packed)
    p = KTO(clip=clip, beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
            loss_type=loss_type, kl_estimate=kl_estimate)
    inp = KTOInputs(desirable, kl_logps, kl_ref_logps, kl_mask)
    _validation.check_logps(logps, ref_logps, mask)
    _validation.check_kto(p, logps.shape[0], logps.device, inp)
    return _kto(p, logps, ref_logps, mask, inp)


@options(GRPO)
def grpo(logps, ref_logps, advantages, mask, *, clip, beta, epsilon_low, epsilon_high, kl_ref_logps=None, loss_type,
         normalizer, max_completion_length, importance_sampling_level, delta, sapo_temperature_pos,
         sapo_temperature_neg, vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg,
         importance_sampling_ratio=None, tool_mask=None, off_policy_mask_threshold, sampling_per_token_logps=None,
         top_entropy_quantile, entropies=None, entropy_coef, use_adaptive_entropy, entropy_target, last_world_entropy,
         use_bias_correction_kl, entropy_mask=None, packed=None):
    r"""Humanline GRPO from ``[B, T]`` log-probs and ``advantages`` ``[B]`` or ``[B, T]``, with every option of TRL
    1.16's ``GRPOTrainer`` (the keywords and defaults of :func:`humanline_kernels.reference.grpo`, which documents
    each); returns ``(loss, metrics)``.

    TRL's loss with its log-ratio ``log pi - log pi_old`` replaced by ``Delta_hat = clamp(log pi - log pi_ref, p,
    r)``: ``ref_logps`` is the ratio's denominator (with ``clip=None`` and TRL's old log-probs, TRL's loss of one
    micro-batch, before its division by the gradient-accumulation steps). Per token ``L = w u + beta k3``: ``u``
    the policy term of ``loss_type`` (:func:`grpo_policy_term`) on ``rho = exp(Delta_hat)`` (or GSPO's sequence
    ratio), ``w`` the detached token weights (the off-policy mask, the high-entropy mask, the vLLM
    ``importance_sampling_ratio``: a ``[B, T]`` input of the loss, so nothing is recomputed over the vocabulary),
    ``k3`` against ``kl_ref_logps`` or ``ref_logps``; aggregated by :func:`grpo_aggregate`; minus the entropy
    bonus (:func:`grpo_entropy_bonus`, differentiable through ``entropies``).

    One keyword beyond the reference's: ``entropy_mask`` (``[B, T]`` bool), a high-entropy mask computed by the
    caller (TRL's takes its quantile over every rank's tokens); it replaces the quantile of this batch that
    ``top_entropy_quantile`` asks for, and needs ``top_entropy_quantile < 1``.

    ``packed`` (:class:`~humanline_kernels.Packed`): a padding-free batch, every per-token input ``[N]`` or ``[1, N]``
    (moved to the padded rows; a 1-D ``advantages`` or ``importance_sampling_ratio`` of ``S`` values is one per
    sequence, also when ``N == S``); "dr_grpo" without ``max_completion_length`` then divides by the padded width:
    ``max_seqlen`` when given, else the longest sequence.

    Metrics: ``unclipped_frac``, ``kl``, ``clip_frac_low``, ``clip_frac_high``; with ``entropies``: ``entropy``,
    ``entropy_sum``, ``entropy_tokens`` (an adaptive-entropy controller's window terms); with the entropy bonus:
    ``policy_loss``; with "vespo": ``vespo_phi_mean``.
    """
    (logps, ref_logps, mask, advantages, kl_ref_logps, importance_sampling_ratio, tool_mask, sampling_per_token_logps,
     entropies, entropy_mask) = unpacked(packed, logps, ref_logps, mask, advantages, kl_ref_logps,
                                         importance_sampling_ratio, tool_mask, sampling_per_token_logps, entropies,
                                         entropy_mask, per_sequence=(2, 4))
    p, norm = GRPO.of(
        clip=clip, beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high, loss_type=loss_type,
        normalizer=normalizer, max_completion_length=max_completion_length,
        importance_sampling_level=importance_sampling_level, delta=delta, sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg, vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos,
        vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg, off_policy_mask_threshold=off_policy_mask_threshold,
        top_entropy_quantile=top_entropy_quantile, entropy_coef=entropy_coef, use_adaptive_entropy=use_adaptive_entropy,
        entropy_target=entropy_target, last_world_entropy=last_world_entropy,
        use_bias_correction_kl=use_bias_correction_kl)
    inp = GRPOInputs(advantages, kl_ref_logps, norm, importance_sampling_ratio=importance_sampling_ratio,
                     tool_mask=tool_mask, sampling_per_token_logps=sampling_per_token_logps, entropies=entropies,
                     entropy_mask=entropy_mask)
    _validation.check_logps(logps, ref_logps, mask)
    _validation.check_grpo_losses(p, logps, inp)
    return _grpo(p, logps, ref_logps, mask, inp)
