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

Beyond these three, every objective is a function of the per-sequence sums of :func:`sequence_logratios`
(``s_i = sum_t m * Delta_hat``, optionally divided by ``sum_t m``; ``policy_sums_i = sum_t m * l``, never
clamped): :func:`ipo`, :func:`simpo` and :func:`slic` follow HALOs' trainers, :func:`dpo`'s ``loss_type`` follows
TRL 1.16's ``DPOTrainer``, :func:`kto`'s ``loss_type`` TRL 1.16's ``KTOTrainer`` and :func:`grpo`'s options TRL
1.16's ``GRPOTrainer``. The humanline rule is one substitution: wherever TRL or HALOs use a sequence's log-ratio
``logps_sum - ref_logps_sum`` (GRPO: the per-token ``log pi - log pi_old``), the clamped ``Delta_hat`` takes its
place; terms of the policy alone (SFT/RPO's NLL, SLiC's regulariser, WPO's weights, CISPO/VESPO's ``log pi``)
stay unclamped. A combination where no log-ratio exists to clamp is refused with a ``ValueError`` that says why.
``docs/objectives.md`` has the table.
"""
from __future__ import annotations

import math

import torch

from . import _objectives, _validation
from ._clip import DEFAULT_CLIP, HumanlineClip
from ._params import DPO, IPO, KTO, DPOInputs, KTOInputs, SimPO, SLiC, Tokens

__all__ = ["token_logprobs", "sequence_logratios", "dpo", "ipo", "simpo", "slic", "kto", "grpo",
           "adaptive_entropy_coef", "vllm_importance_sampling_ratio", "HumanlineClip"]


def token_logprobs(logits, labels, *, temperature=1.0, ignore_index=-100, return_entropy=False, validate=True):
    """fp32 ``log_softmax(logits / temperature)[label]`` shaped like ``labels``; 0 where ``labels == ignore_index``.

    With ``return_entropy`` also returns the entropy of ``softmax(logits / temperature)``, 0 where ignored,
    differentiable (``dH/dz = -p (log p + H) / temperature``: an entropy bonus trains through it).
    """
    _validation.check_logits(logits, labels, Tokens(temperature=temperature, ignore_index=ignore_index), validate,
                             return_entropy=return_entropy)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    mask = labels != ignore_index
    logp_all = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)
    inside = mask & (labels >= 0) & (labels < logits.shape[-1])  # (validate=False: a label outside [0, V) is NaN)
    picked = logp_all.gather(-1, torch.where(inside, labels, 0).unsqueeze(-1)).squeeze(-1)
    logps = torch.where(mask, torch.where(inside, picked, float("nan")), 0.0)
    if not return_entropy:
        return logps
    p = logp_all.exp()
    entropy = -(p * torch.where(p > 0, logp_all, 0.0)).sum(-1)  # (p = 0 adds 0: no 0 * -inf, in value or gradient)
    return logps, torch.where(mask, entropy, 0.0)


def _masked_ratio(num, den):
    return torch.where(den > 0, num / den.clamp(min=1), torch.ones_like(num))


def _clamp(x, lo=None, hi=None):
    """``clamp(x, lo, hi)`` with gradient ``1[lo <= x <= hi]``: the band's ends pass it. Written as an explicit
    inclusive mask, not through torch.clamp, whose gradient at a bound is 0 (or 0.5) from torch 2.14."""
    inside = torch.ones_like(x, dtype=torch.bool)
    if lo is not None:
        inside = inside & ~(x < lo)
    if hi is not None:
        inside = inside & ~(x > hi)
    bounded = x.detach()
    if lo is not None:
        bounded = torch.where(bounded < lo, lo, bounded)
    if hi is not None:
        bounded = torch.where(bounded > hi, hi, bounded)
    return torch.where(inside, x, bounded)


def _clip_counts(logps, ref_logps, mask, clip):
    """``(Delta_hat, n_inside, n)``: the clamped log-ratio (0 where masked out), the masked tokens strictly inside
    the band (all masked tokens without clipping) and the masked tokens, both in ``logps.dtype``."""
    delta = logps - ref_logps
    if clip is None:
        clipped, inside = delta, mask
    else:
        clipped = _clamp(delta, clip.log_eps_p, clip.log_eps_r)
        inside = mask & (delta > clip.log_eps_p) & (delta < clip.log_eps_r)
    clipped = torch.where(mask, clipped, 0.0)
    return clipped, inside.sum().to(logps.dtype), mask.sum().to(logps.dtype)


def _clipped_log_ratio(logps, ref_logps, mask, clip):
    clipped, n_inside, n = _clip_counts(logps, ref_logps, mask, clip)
    return clipped, _masked_ratio(n_inside, n)


# ---------------------------------------------------------------------------------------------------------------
# The sequence-level primitive and the objectives built on it (HALOs' IPO, SimPO, SLiC)


def sequence_logratios(logps, ref_logps, mask, *, clip=None, normalize=False):
    r"""Per-sequence sums of the clamped log-ratio: ``(s [B], policy_sums [B], metrics)``, all differentiable.

    ``s_i = sum_t m * Delta_hat`` (divided by ``sum_t m`` when ``normalize``; 0 for an empty row);
    ``policy_sums_i = sum_t m * l``, the policy alone, never clamped. ``ref_logps=None`` is a reference of 0, so
    that ``Delta = l`` (HALOs' implicit reference for SimPO and SLiC). Metrics (detached 0-d): ``unclipped_frac``
    (masked tokens strictly inside the band / masked tokens; 1.0 without clipping or without tokens), ``n_tokens``
    (masked tokens) and ``n_unclipped`` (masked tokens strictly inside the band; all of them without clipping).
    """
    _validation.check_logps(logps, logps if ref_logps is None else ref_logps, mask)
    _validation.check_clip(clip)
    _validation.check_flag("normalize", normalize)
    if ref_logps is None:
        ref_logps = torch.zeros_like(logps)
    clipped, n_inside, n = _clip_counts(logps, ref_logps, mask, clip)
    s = clipped.sum(dim=1)
    if normalize:
        s = s / mask.sum(dim=1).to(logps.dtype).clamp(min=1)
    policy_sums = torch.where(mask, logps, 0.0).sum(dim=1)
    metrics = {"unclipped_frac": _masked_ratio(n_inside, n).detach(), "n_tokens": n.detach(),
               "n_unclipped": n_inside.detach()}
    return s, policy_sums, metrics


def ipo(logps, ref_logps, mask, *, clip=None, beta=0.1):
    r"""IPO on ``2P`` rows: ``mean_j (s̄_j - s̄_{P+j} - 1 / (2 beta))^2`` with ``s̄`` the normalised clamped sums.

    Follows HALOs ``IPOTrainer.loss`` (its ``tau`` is ``beta``); TRL 1.16 ``DPOTrainer._compute_loss`` loss_type
    ``"ipo"`` is the same form (``dpo(..., loss_type="ipo")`` gives the same loss). HALOs divides each sum by the
    number of tokens whose (clamped) log-ratio is non-zero, this function by the number of masked tokens: the two
    agree unless a masked token's log-ratio is exactly 0. Rewards in the metrics are ``s̄`` (HALOs' IPO rewards,
    without ``beta``).
    """
    _validation.check_logps(logps, ref_logps, mask)
    _validation.check_ipo(IPO(clip=clip, beta=beta), logps.shape[0])
    s, _, m = sequence_logratios(logps, ref_logps, mask, clip=clip, normalize=True)
    loss, metrics = _objectives.ipo_from_sums(s, beta=beta)
    return loss, {"unclipped_frac": m["unclipped_frac"], **metrics}


def simpo(logps, mask, *, clip=None, beta=2.0, gamma_beta_ratio=0.25):
    r"""SimPO on ``2P`` rows: ``mean_j -logsigmoid(beta (s̄_j - s̄_{P+j} - gamma_beta_ratio))``, reference 0.

    ``s̄`` is the normalised sum of ``clamp(l, p, r)`` (the reference is 0, so humanline floors each token's
    log-prob at ``log_eps_p``, and a token below the floor gets no gradient). Follows HALOs ``SimPOTrainer.loss``
    (which normalises by the count of non-zero clamped log-probs, this function by the masked tokens). Rewards in
    the metrics are ``s̄`` (HALOs' SimPO rewards, without ``beta``). The defaults are the package's; HALOs'
    ``config/loss/simpo.yaml`` has ``beta: 10.0``, ``gamma_beta_ratio: 0.3``.
    """
    _validation.check_logps(logps, logps, mask)
    _validation.check_simpo(SimPO(clip=clip, beta=beta, gamma_beta_ratio=gamma_beta_ratio), logps.shape[0])
    s, _, m = sequence_logratios(logps, None, mask, clip=clip, normalize=True)
    loss, metrics = _objectives.simpo_from_sums(s, beta=beta, gamma_beta_ratio=gamma_beta_ratio)
    return loss, {"unclipped_frac": m["unclipped_frac"], **metrics}


def slic(logps, mask, *, clip=None, beta=1.0, lambda_coef=0.1):
    r"""SLiC on ``2P`` rows: ``mean_j [max(0, beta - s_j + s_{P+j}) - lambda_coef * policy_sums_j]``, reference 0.

    The calibration term uses the clamped sums ``s`` of ``clamp(l, p, r)``; the regulariser is the chosen
    sequence's NLL, ``-policy_sums_j``, never clamped. Follows HALOs ``SLiCTrainer.loss`` as its docstring states
    it ("the NLL of the chosen sequence"); its code adds the per-token ``[P, T]`` log-probs to the ``[P]``
    calibration losses instead, which broadcasts only when ``T == P`` (or ``P == 1``) and then averages a token-level
    NLL. Rewards in the metrics are ``s`` (HALOs' SLiC rewards).
    """
    _validation.check_logps(logps, logps, mask)
    _validation.check_slic(SLiC(clip=clip, beta=beta, lambda_coef=lambda_coef), logps.shape[0])
    s, policy_sums, m = sequence_logratios(logps, None, mask, clip=clip)
    loss, metrics = _objectives.slic_from_sums(s, policy_sums, beta=beta, lambda_coef=lambda_coef)
    return loss, {"unclipped_frac": m["unclipped_frac"], **metrics}


# ---------------------------------------------------------------------------------------------------------------
# DPO and TRL 1.16's DPO loss types


def _ld_sum(x, mask, ld_alpha):
    """Per-row sum of ``x`` over masked tokens, LD-DPO's tails weighted (:func:`_objectives.ld_weights`)."""
    x = torch.where(mask, x, 0.0)
    return x.sum(dim=1) if ld_alpha is None else (x * _objectives.ld_weights(mask, ld_alpha, x.dtype)).sum(dim=1)


def dpo(logps, ref_logps, mask, *, clip=DEFAULT_CLIP, beta=0.1, label_smoothing=0.0, loss_type="sigmoid",
        loss_weights=None, rpo_alpha=None, f_divergence_type="reverse_kl", f_alpha_divergence_coef=0.5,
        ld_alpha=None, discopop_tau=0.05, use_weighting=False, log_sum_sq_probs=None):
    r"""Humanline DPO on ``2P`` rows: ``0..P-1`` chosen, ``P..2P-1`` their rejected partners.

    ``s_i = sum_t m * Delta_hat`` (the clamped log-ratio sums); with defaults
    ``loss = mean_j [-(1 - ls) logsigmoid(h_j) - ls logsigmoid(-h_j)]``, ``h_j = beta (s_j - s_{P+j})``: DPO, and
    cDPO with ``label_smoothing = ls`` (HALOs ``CDPOTrainer``, whose ``loss.epsilon`` is ``label_smoothing``; TRL
    0.x's "sigmoid"). TRL 1.16's "sigmoid" ignores ``label_smoothing`` (it reads it only in "robust", "exo_pair",
    "aot" and "aot_unpaired"), so the two agree on "sigmoid" only with ``label_smoothing=0``.

    The other keywords follow TRL 1.16 ``DPOTrainer._compute_loss`` (and ``DPOConfig``'s names), each on the
    clamped sums wherever TRL uses ``chosen_logps - ref_chosen_logps``:

    * ``loss_type``: one of ``_validation.DPO_LOSS_TYPES`` or a list of them, mixed as ``sum_k loss_weights[k] *
      mean_j loss_k`` (``loss_weights`` defaults to ones). "ipo" and "sigmoid_norm" divide each score by the row's
      masked-token count (TRL counts the unshifted ``completion_mask``, the same tokens when the prompt is not
      empty). "sft" is the mean NLL of the chosen tokens, policy only and unclamped (0 when there is none; TRL
      gives NaN). "aot" sorts the policy's and the reference's chosen-minus-rejected sums separately, so no
      per-token log-ratio exists to clamp: it is refused when ``clip`` is set. "aot_unpaired" sorts the chosen and
      the rejected log-ratios, which are clamped.
    * ``rpo_alpha``: RPO's NLL term. TRL 1.16 has no ``rpo_alpha``; its RPO is ``loss_type=[..., "sft"]`` with
      ``loss_weights=[..., rpo_alpha]``, which is what this keyword appends.
    * ``f_divergence_type`` / ``f_alpha_divergence_coef`` (TRL's default 0.5): the scores are ``f'(exp(s))``
      ("reverse_kl": ``s``; "forward_kl": ``1 - exp(-s)``; "js_divergence": ``log 2 + logsigmoid(s)``;
      "alpha_divergence": ``(exp(min((a - 1) s, 80)) - 1) / (a - 1)``), for the loss types in
      ``_validation.F_DIVERGENCE_LOSS_TYPES`` only (TRL refuses the others); "nca_pair", "bco_pair", "sppo_hard",
      "apo_*" read the log-ratio sums themselves.
    * ``ld_alpha`` (LD-DPO): in each pair, tokens past the shorter completion's length count ``ld_alpha`` times in
      ``s`` (and in the policy and reference sums that "aot" reads); the clamp applies per token first.
    * ``use_weighting`` (WPO): each pair's loss is multiplied by ``w_j w_{P+j}`` with
      ``w_i = exp(mean_t m (l - log_sum_sq_probs))``, detached and unclamped (policy only); ``log_sum_sq_probs`` is
      the per-token ``log sum_v p_v^2`` TRL's fused LM head returns.
    * ``discopop_tau``: DiscoPOP's temperature.

    Metrics: ``unclipped_frac`` and the rewards ``beta * s`` of the chosen and rejected rows (means, margin,
    accuracy), as TRL logs them (``s`` LD-weighted when ``ld_alpha`` is set).
    """
    _validation.check_logps(logps, ref_logps, mask)
    loss_types, weights = _validation.check_dpo(
        DPO(clip=clip, beta=beta, label_smoothing=label_smoothing, loss_type=loss_type, loss_weights=loss_weights,
            rpo_alpha=rpo_alpha, f_divergence_type=f_divergence_type, f_alpha_divergence_coef=f_alpha_divergence_coef,
            ld_alpha=ld_alpha, discopop_tau=discopop_tau, use_weighting=use_weighting),
        logps.shape[0], logps, DPOInputs(log_sum_sq_probs))
    clipped, n_inside, n = _clip_counts(logps, ref_logps, mask, clip)
    s = _ld_sum(clipped, mask, ld_alpha)
    aot = aot_ref = wpo = None
    if "aot" in loss_types:  # clip is None here: the policy's and the reference's own (LD-weighted) sums
        aot, aot_ref = _ld_sum(logps, mask, ld_alpha), _ld_sum(ref_logps, mask, ld_alpha)
    if use_weighting:
        with torch.no_grad():
            count = mask.sum(dim=1).to(logps.dtype).clamp(min=1)
            wpo = torch.exp(torch.where(mask, logps - log_sum_sq_probs, 0.0).sum(dim=1) / count)
    rows = _objectives.Rows(s, torch.where(mask, logps, 0.0).sum(dim=1), mask.sum(dim=1).to(logps.dtype), aot, aot_ref,
                            wpo)
    loss, metrics = _objectives.dpo_from_rows(rows, beta=beta, label_smoothing=label_smoothing, loss_types=loss_types,
                                              weights=weights, f_divergence_type=f_divergence_type,
                                              f_alpha_divergence_coef=f_alpha_divergence_coef,
                                              discopop_tau=discopop_tau)
    return loss, {"unclipped_frac": _masked_ratio(n_inside, n).detach(), **metrics}


# ---------------------------------------------------------------------------------------------------------------
# KTO


def kto(logps, ref_logps, mask, desirable, kl_logps=None, kl_ref_logps=None, kl_mask=None, *,
        clip=DEFAULT_CLIP, beta=0.1, desirable_weight=1.0, undesirable_weight=1.0, loss_type="kto",
        kl_estimate="halos"):
    r"""Humanline KTO. ``desirable [B]`` bool; the KL rows (mismatched pairs) only set the baseline ``z0``.

    ``loss_type="kto"``: desirable rows give ``w_D (1 - sigmoid(beta (s_i - z0)))``, undesirable ones
    ``w_U (1 - sigmoid(beta (z0 - s_i)))``, mean over rows (HALOs ``KTOTrainer.loss``; TRL 1.16
    ``KTOTrainer._compute_loss`` loss_type "kto"). ``z0`` (detached) by ``kl_estimate``:

    * ``"halos"`` (default): ``max(0, sum_k s^KL_k / #{k : s^KL_k != 0})`` over the clamped KL sums (HALOs:
      all-zero rows, i.e. empty ones, do not count); sum and count are all-reduced under ``torch.distributed``.
    * ``"trl"``: ``max(0, mean_k s^KL_k)`` over all KL rows (TRL 1.16), and under ``torch.distributed`` the mean of
      the ranks' means (TRL's ``gather_for_metrics(kl).mean()``). The two agree on one rank when no KL row sums to
      exactly 0.

    Without KL rows ``z0 = 0``. ``loss_type="apo_zero_unpaired"`` (TRL 1.16 ``KTOTrainer``; APO-zero, unpaired)
    has no baseline: desirable rows give ``w_D (1 - sigmoid(beta s_i))``, undesirable ones
    ``w_U sigmoid(beta s_i)``; KL rows are refused. Humanline clamps every ``s`` (the KL rows' too).
    """
    _validation.check_logps(logps, ref_logps, mask)
    p = KTO(clip=clip, beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
            loss_type=loss_type, kl_estimate=kl_estimate)
    _validation.check_kto(p, logps.shape[0], logps.device, KTOInputs(desirable, kl_logps, kl_ref_logps, kl_mask))
    clipped, unclipped_frac = _clipped_log_ratio(logps, ref_logps, mask, clip)
    s = clipped.sum(dim=1)
    with torch.no_grad():
        if kl_logps is not None:
            kl_clipped, _ = _clipped_log_ratio(kl_logps, kl_ref_logps, kl_mask, clip)
            s_kl = kl_clipped.sum(dim=1).to(s.dtype)
        else:
            s_kl = s.new_zeros(0)
        if kl_estimate == "halos":
            total = torch.stack([s_kl.sum(), (s_kl != 0).sum().to(s.dtype)])
        else:  # a rank's mean (0 without rows), then the mean over ranks
            local_mean = s_kl.sum() / max(s_kl.shape[0], 1)
            total = torch.stack([local_mean, torch.ones_like(local_mean)])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(total)
        z0 = torch.where(total[1] > 0, total[0] / total[1].clamp(min=1), 0.0).clamp(min=0.0)
    if loss_type == "kto":
        loss_d = desirable_weight * (1.0 - torch.sigmoid(beta * (s - z0)))
        loss_u = undesirable_weight * (1.0 - torch.sigmoid(beta * (z0 - s)))
    else:  # apo_zero_unpaired: push desirable log-ratios up and undesirable ones down, no baseline
        loss_d = desirable_weight * (1.0 - torch.sigmoid(beta * s))
        loss_u = undesirable_weight * torch.sigmoid(beta * s)
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


# ---------------------------------------------------------------------------------------------------------------
# GRPO and TRL 1.16's GRPO options


@torch.no_grad()
def _vespo_weights(clipped, mask, A, importance_sampling_ratio, *, vespo_k_pos, vespo_lambda_pos, vespo_k_neg,
                   vespo_lambda_neg):
    """VESPO's detached per-sequence gamma weight ``phi(w) = exp(lambda + k log w - lambda w)`` (``phi(1) = 1``),
    ``w`` the sequence's importance ratio ``exp(sum_t m Delta_hat)`` times the vLLM weights' product (TRL 1.16
    ``GRPOTrainer.get_gamma_weights``: log-ratios clamped to +-20, ``log w`` to ``[log 1e-8, 20]``); ``k`` and
    ``lambda`` by the advantage's sign."""
    lowest = math.log(1e-8)
    log_w = torch.where(mask, torch.clamp(clipped, -20.0, 20.0), 0.0).sum(dim=1, keepdim=True)
    if importance_sampling_ratio is not None:
        log_is = torch.clamp(torch.log(importance_sampling_ratio), lowest, 20.0)
        log_w = log_w + torch.where(mask, log_is, 0.0).sum(dim=1, keepdim=True)
    log_w = torch.clamp(log_w, lowest, 20.0)
    nonneg = A >= 0
    k = torch.where(nonneg, A.new_tensor(vespo_k_pos), A.new_tensor(vespo_k_neg))
    lam = torch.where(nonneg, A.new_tensor(vespo_lambda_pos), A.new_tensor(vespo_lambda_neg)).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@torch.no_grad()
def _off_policy_mask(logps, sampling_logps, mask, A, threshold):
    """DeepSeek-V3.2's off-policy sequence mask (TRL 1.16 ``GRPOTrainer.get_off_policy_mask``): keep a sequence when
    its advantage is >= 0 or its mean ``log pi_sampler - log pi`` over masked tokens is <= ``threshold`` (NaN
    sampler log-probs count as 0)."""
    kl = torch.nan_to_num(sampling_logps - logps, nan=0.0)
    mean_kl = torch.where(mask, kl, 0.0).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
    return ((A >= 0) | (mean_kl <= threshold)).to(logps.dtype)


@torch.no_grad()
def _high_entropy_mask(entropies, mask, quantile):
    """Masked tokens whose entropy is >= the ``quantile`` of the masked tokens' entropies (TRL 1.16
    ``GRPOTrainer.get_high_entropy_mask``, which takes the quantile over all ranks' tokens; here one rank's)."""
    values = entropies[mask]
    if values.numel() == 0:
        return torch.zeros_like(mask)
    return (entropies >= torch.quantile(values, quantile)) & mask


def grpo(logps, ref_logps, advantages, mask, *, clip=DEFAULT_CLIP, beta=0.0, epsilon_low=0.2, epsilon_high=0.2,
         kl_ref_logps=None, loss_type="dapo", normalizer=None, max_completion_length=None,
         importance_sampling_level="token", delta=None, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
         vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, importance_sampling_ratio=None,
         tool_mask=None, off_policy_mask_threshold=None, sampling_per_token_logps=None, top_entropy_quantile=1.0,
         entropies=None, entropy_coef=0.0, use_adaptive_entropy=False, entropy_target=0.2,
         last_world_entropy=math.inf, use_bias_correction_kl=False):
    r"""Humanline GRPO: TRL 1.16 ``GRPOTrainer._compute_loss`` with its log-ratio ``log pi - log pi_old`` replaced by
    ``Delta_hat = clamp(log pi - log pi_ref, p, r)``, ``ref_logps`` the ratio's denominator. With ``clip=None`` and
    ``ref_logps`` = TRL's old log-probs this is TRL's loss for one micro-batch (before TRL's division by the
    gradient-accumulation steps; see below). Keywords are named after ``GRPOConfig``'s fields and the trainer's
    input keys.

    ``advantages`` is ``[B]`` (one per sequence) or ``[B, T]`` (one per token, as PPO/verl). The log importance
    weight is ``Delta_hat`` per token (``importance_sampling_level="token"``) or, per sequence (GSPO, "sequence"),
    ``mean_t m Delta_hat``; ``rho = exp(.)``. Per-token policy term by ``loss_type``:

    * "grpo", "bnpo", "dr_grpo", "dapo", "luspo": ``-min(A rho', A clamp(rho, 1 - epsilon_low, 1 + epsilon_high))``
      with ``rho' = min(rho, delta)`` when ``delta`` is set (INTELLECT-2's two-sided clipping), else ``rho``;
    * "cispo": ``-sg(min(rho, epsilon_high)) A l`` (``epsilon_high`` is the cap on the ratio itself, as in TRL);
    * "sapo": ``-(4 / tau) sigmoid(tau (rho - 1)) A`` with ``tau = sapo_temperature_pos`` where ``A > 0``, else
      ``sapo_temperature_neg``;
    * "vespo": ``-sg(phi) A l`` with VESPO's gamma weight ``phi`` of the sequence ratio ``exp(sum_t m Delta_hat)``
      times the product of the per-token ``importance_sampling_ratio`` (``vespo_k_*``, ``vespo_lambda_*``).

    CISPO and VESPO weight the policy's own log-prob ``l`` (not a log-ratio), so under humanline the clamp shapes
    only their detached weight and a token outside the band still gets a gradient (CISPO's point: it clips the
    weight, never the gradient). Then, in TRL's order: times the off-policy sequence mask (when
    ``off_policy_mask_threshold`` is set: a sequence with ``A < 0`` whose mean ``sampling_per_token_logps - l`` over
    its tokens exceeds the threshold is dropped; without ``sampling_per_token_logps`` the mask reads ``ref_logps``,
    TRL's old log-probs, which humanline refuses: its reference is not the policy that sampled), times the
    high-entropy mask (``top_entropy_quantile < 1``: tokens whose ``entropies`` reach that top quantile), times the
    vLLM importance-sampling weight ``importance_sampling_ratio`` (``[B, T]``, ``[B]`` or ``[B, 1]``; not for VESPO,
    which folds it into ``phi``; see :func:`vllm_importance_sampling_ratio`), plus ``beta * k3`` with
    ``k3 = exp(l_kl - l) - (l_kl - l) - 1``, ``l_kl = kl_ref_logps`` or ``ref_logps`` (never clipped), multiplied by
    ``rho`` when ``use_bias_correction_kl`` (TRL's default is True, this function's False, as before the keyword
    existed; inert when ``beta == 0``, as in TRL). ``tool_mask`` (0 on tool-output tokens) is and-ed into ``mask``.

    Aggregation over the masked tokens: "dapo", "bnpo", "cispo", "vespo": ``sum(m L) / (normalizer or sum(m))``
    (TRL's "dapo"/"cispo"/"vespo" divide by ``num_items_in_batch / num_processes * grad_accum /
    steps_per_generation``: pass that as ``normalizer``); "grpo" and "sapo": the mean over non-empty rows of the
    row means (TRL averages over all rows, empty ones as 0: the two differ only with an empty row); "dr_grpo":
    ``sum(m L) / (B * (max_completion_length or T))``; "luspo": ``sum(m L) / B``. TRL divides "grpo", "sapo",
    "bnpo", "dr_grpo", "luspo" and the entropy bonus by the gradient-accumulation steps as well: the trainer's job.

    Entropy bonus (when ``entropy_coef != 0`` or ``use_adaptive_entropy``): ``loss -= c * H`` with ``H`` the mean of
    ``entropies`` over the masked (and high-entropy, when that mask is on) tokens; gradients flow through
    ``entropies`` if it requires them (TRL's fused LM head differentiates its entropy, and so do
    ``hk.token_logprobs`` and ``hk.fused_linear.token_logprobs``). ``c = entropy_coef``, except with
    ``use_adaptive_entropy`` where ``c = 0`` while ``last_world_entropy > entropy_target``. The function is
    stateless: the trainer keeps TRL's controller state (``entropy_coef``, ``last_world_entropy`` starting at inf,
    and the window totals): it adds each micro-batch's
    metrics ``entropy_sum`` and ``entropy_tokens`` to the window, and at each optimizer step all-reduces them,
    sets ``last_world_entropy = sum / max(count, 1)`` and ``entropy_coef = adaptive_entropy_coef(entropy_coef,
    last_world_entropy, ...)``, and passes both to the next step's calls (TRL checkpoints both).

    Metrics: ``unclipped_frac`` (over ``mask`` and ``tool_mask``), ``kl`` (mean of the KL term, corrected when
    ``use_bias_correction_kl``), ``clip_frac_low``/``clip_frac_high`` (fraction of masked tokens where the
    epsilon-clip is the active side; for "cispo" ``clip_frac_high`` is where the ratio cap binds with ``A > 0``;
    0 for "sapo"/"vespo"; token-weighted also at sequence level, where TRL counts sequences); with ``entropies``:
    ``entropy`` (mean over masked tokens), ``entropy_sum``/``entropy_tokens``; with the entropy bonus:
    ``policy_loss`` (the loss before it); for "vespo": ``vespo_phi_mean``.
    """
    _validation.check_logps(logps, ref_logps, mask)
    B, T = logps.shape
    _validation.check_clip(clip)
    _validation.check_real("beta", beta, low=0.0)
    vespo = {"vespo_k_pos": vespo_k_pos, "vespo_lambda_pos": vespo_lambda_pos, "vespo_k_neg": vespo_k_neg,
             "vespo_lambda_neg": vespo_lambda_neg}
    _validation.check_grpo_options(
        logps, advantages, clip=clip, epsilon_low=epsilon_low, epsilon_high=epsilon_high, loss_type=loss_type,
        normalizer=normalizer, max_completion_length=max_completion_length,
        importance_sampling_level=importance_sampling_level, delta=delta, sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg, vespo=vespo, importance_sampling_ratio=importance_sampling_ratio,
        tool_mask=tool_mask, off_policy_mask_threshold=off_policy_mask_threshold,
        sampling_per_token_logps=sampling_per_token_logps, top_entropy_quantile=top_entropy_quantile,
        entropies=entropies, entropy_coef=entropy_coef, use_adaptive_entropy=use_adaptive_entropy,
        entropy_target=entropy_target, last_world_entropy=last_world_entropy,
        use_bias_correction_kl=use_bias_correction_kl)
    if kl_ref_logps is not None:
        _validation.check_tensor("kl_ref_logps", kl_ref_logps, shape=logps.shape, dtypes=(logps.dtype,),
                                 device=logps.device)
    if tool_mask is not None:
        mask = mask & (tool_mask != 0)
    dtype = logps.dtype
    clipped, unclipped_frac = _clipped_log_ratio(logps, ref_logps, mask, clip)
    A = advantages.to(dtype)
    A = A if A.dim() == 2 else A.unsqueeze(1)  # [B, 1] per sequence or [B, T] per token
    mf = mask.to(dtype)
    row_n = mf.sum(dim=1, keepdim=True)
    if importance_sampling_level == "token":
        ratio = torch.exp(clipped)
    else:  # GSPO: one ratio per sequence, the exp of the mean clamped log-ratio
        ratio = torch.exp(clipped.sum(dim=1, keepdim=True) / row_n.clamp(min=1))
    policy_logps = torch.where(mask, logps, 0.0)  # CISPO/VESPO's log pi (0 where masked, so no NaN leaks)

    zero = torch.zeros_like(mask)
    low, high = zero, zero
    if loss_type == "cispo":
        per_token = -torch.clamp(ratio, max=epsilon_high).detach() * A * policy_logps
        high = mask & (ratio > epsilon_high) & (A > 0)
    elif loss_type == "sapo":
        tau = torch.where(A > 0, A.new_tensor(sapo_temperature_pos), A.new_tensor(sapo_temperature_neg))
        per_token = -(torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau) * A
    elif loss_type == "vespo":
        phi = _vespo_weights(clipped, mask, A, importance_sampling_ratio, **vespo)
        per_token = -phi * A * policy_logps
    else:
        capped = ratio if delta is None else _clamp(ratio, hi=delta)
        per_token = -torch.minimum(A * capped, A * _clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high))
        low = mask & (capped < 1.0 - epsilon_low) & (A < 0)
        high = mask & (capped > 1.0 + epsilon_high) & (A > 0)
    if off_policy_mask_threshold is not None:
        sampling = ref_logps if sampling_per_token_logps is None else sampling_per_token_logps
        per_token = per_token * _off_policy_mask(logps, sampling, mask, A, off_policy_mask_threshold)
    entropy_mask = None
    if top_entropy_quantile < 1.0:
        entropy_mask = _high_entropy_mask(entropies, mask, 1.0 - top_entropy_quantile)
        per_token = per_token * entropy_mask
    if importance_sampling_ratio is not None and loss_type != "vespo":
        weight = importance_sampling_ratio.to(dtype)
        per_token = per_token * (weight if weight.dim() == 2 else weight.reshape(B, 1))
    l_kl = ref_logps if kl_ref_logps is None else kl_ref_logps
    x = torch.where(mask, l_kl - logps, 0.0)
    kl_term = torch.exp(x) - x - 1.0
    if use_bias_correction_kl and beta != 0:
        kl_term = kl_term * ratio
    if beta != 0:
        per_token = per_token + beta * kl_term
    per_token = torch.where(mask, per_token, 0.0)

    n = mf.sum()
    if loss_type in ("dapo", "bnpo", "cispo", "vespo"):
        den = n.clamp(min=1) if normalizer is None else torch.as_tensor(normalizer, dtype=dtype).reshape(())
        loss = per_token.sum() / den
    elif loss_type in ("grpo", "sapo"):
        row_mean = per_token.sum(dim=1) / row_n.squeeze(1).clamp(min=1)
        loss = row_mean.sum() / (row_n > 0).sum().clamp(min=1)
    elif loss_type == "dr_grpo":
        loss = per_token.sum() / (B * (T if max_completion_length is None else max_completion_length))
    else:  # luspo: each sequence's summed loss, averaged over the rows
        loss = per_token.sum() / B

    metrics = {}
    if entropy_coef != 0.0 or use_adaptive_entropy:
        metrics["policy_loss"] = loss.detach()
        effective = mask if entropy_mask is None else mask & entropy_mask
        H = torch.where(effective, entropies, 0.0).sum() / effective.sum().clamp(min=1)
        applies = not use_adaptive_entropy or last_world_entropy <= entropy_target
        loss = loss - (entropy_coef if applies else 0.0) * H

    with torch.no_grad():
        den = n.clamp(min=1)
        metrics.update({
            "unclipped_frac": unclipped_frac.detach(),
            "kl": torch.where(mask, kl_term, 0.0).sum() / den,
            "clip_frac_low": low.expand(B, T).sum().to(dtype) / den,
            "clip_frac_high": high.expand(B, T).sum().to(dtype) / den,
        })
        if entropies is not None:
            effective = mask if entropy_mask is None else mask & entropy_mask
            metrics["entropy"] = torch.where(mask, entropies, 0.0).sum() / den
            metrics["entropy_sum"] = torch.where(effective, entropies, 0.0).sum()
            metrics["entropy_tokens"] = effective.sum().to(dtype)
        if loss_type == "vespo":
            metrics["vespo_phi_mean"] = phi.mean() if phi.shape[1] == 1 else (phi * mf).sum() / den
    return loss, metrics


def adaptive_entropy_coef(entropy_coef, world_entropy, *, entropy_target=0.2, entropy_coef_delta=0.005,
                          entropy_coef_min=0.0, entropy_coef_max=1.0):
    """The entropy coefficient for the next optimizer step under adaptive entropy control (Skywork-OR1; TRL 1.16
    ``GRPOTrainer._compute_loss``): up by ``entropy_coef_delta`` (at most ``entropy_coef_max``) when the window's
    all-reduced mean entropy ``world_entropy`` is at or below ``entropy_target``, else down (at least
    ``entropy_coef_min``). See :func:`grpo` for the state a trainer keeps."""
    for name, v in (("entropy_coef", entropy_coef), ("world_entropy", world_entropy),
                    ("entropy_target", entropy_target), ("entropy_coef_delta", entropy_coef_delta),
                    ("entropy_coef_min", entropy_coef_min), ("entropy_coef_max", entropy_coef_max)):
        _validation.check_real(name, v)
    if world_entropy <= entropy_target:
        return min(entropy_coef + entropy_coef_delta, entropy_coef_max)
    return max(entropy_coef - entropy_coef_delta, entropy_coef_min)


@torch.no_grad()
def vllm_importance_sampling_ratio(old_logps, sampling_logps, mask, *, vllm_importance_sampling_mode="sequence_mask",
                                   vllm_importance_sampling_clip_min=None, vllm_importance_sampling_clip_max=3.0):
    """The vLLM importance-sampling weight that :func:`grpo` takes as ``importance_sampling_ratio`` (detached).

    TRL 1.16 forms it at generation time (``GRPOTrainer._generate_and_score_completions``) from the training
    model's log-probs at generation ``old_logps`` and the sampler's ``sampling_logps``: ``d = m (old - sampling)``
    (NaN sampler log-probs give 0). "token_*" modes: ``rho_t = exp(d_t)`` (``[B, T]``); "sequence_*" modes:
    ``rho = exp(sum_t d_t)`` (``[B, 1]``). "*_truncate" clamps ``rho`` to ``[clip_min, clip_max]``; "*_mask" sets
    ``rho`` outside that range to 0 (a missing bound is open). Humanline does not touch it: it corrects the
    sampler's mismatch, not the policy's drift from the reference.
    """
    _validation.check_tensor("old_logps", old_logps, ndim=2, dtypes=_validation.LOGP_DTYPES)
    _validation.check_tensor("sampling_logps", sampling_logps, shape=old_logps.shape, dtypes=(old_logps.dtype,),
                             device=old_logps.device)
    _validation.check_tensor("mask", mask, shape=old_logps.shape, dtypes=(torch.bool,), device=old_logps.device)
    if vllm_importance_sampling_mode not in _validation.VLLM_IS_MODES:
        raise ValueError(f"vllm_importance_sampling_mode must be in {_validation.VLLM_IS_MODES}, "
                         f"got {vllm_importance_sampling_mode!r}")
    lo, hi = vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max
    for name, v in (("vllm_importance_sampling_clip_min", lo), ("vllm_importance_sampling_clip_max", hi)):
        if v is not None:
            _validation.check_real(name, v, low=0.0)
    if lo is not None and hi is not None and lo >= hi:
        raise ValueError(f"vllm_importance_sampling_clip_min ({lo}) must be < vllm_importance_sampling_clip_max ({hi})")
    truncate = vllm_importance_sampling_mode.endswith("_truncate")
    if truncate and lo is None and hi is None:
        raise ValueError("a *_truncate vllm_importance_sampling_mode needs vllm_importance_sampling_clip_min or _max")
    d = torch.nan_to_num(torch.where(mask, old_logps - sampling_logps, 0.0), nan=0.0)
    if vllm_importance_sampling_mode.startswith("sequence"):
        d = d.sum(dim=1, keepdim=True)
    rho = torch.exp(d)
    if truncate:
        return torch.clamp(rho, min=lo, max=hi)
    outside = (rho < (-math.inf if lo is None else lo)) | (rho > (math.inf if hi is None else hi))
    return rho.masked_fill(outside, 0.0)
