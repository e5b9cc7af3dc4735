r"""The batch-level math of the sequence-level objectives: each a loss of per-row sums, written once.

Every input level computes the per-row sums its own way -- :mod:`humanline_kernels.reference` plainly, the fused
levels with the sequence-level primitive's kernels -- and hands them here (:class:`Rows`), so the objectives'
formulas exist once; :mod:`humanline_kernels.reference`'s tests hold them to TRL 1.16's and HALOs' own code. Rows
``0..P-1`` are chosen and ``P..2P-1`` their rejected partners wherever pairs are meant.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor


class Rows(NamedTuple):
    """Per-row quantities of a batch of sequences (``[B]`` each): ``s = sum_t m w Delta_hat`` (``w`` LD-DPO's
    token weights, else 1), ``policy = sum_t m l`` (never clamped), ``counts = sum_t m``; for DPO's "aot" (no clip)
    the policy's and the reference's own sums (LD-weighted) and for WPO the detached weights
    ``exp(mean_t m (l - log sum_v p_v^2))``."""

    s: Tensor
    policy: Tensor
    counts: Tensor
    aot_policy: Optional[Tensor] = None
    aot_reference: Optional[Tensor] = None
    wpo: Optional[Tensor] = None


def pairs(s):
    P = s.shape[0] // 2
    return s[:P], s[P:]


def pair_metrics(rewards_chosen, rewards_rejected):
    """Means of the per-pair rewards (detached): chosen, rejected, margin and how often chosen wins."""
    rc, rr = rewards_chosen.detach(), rewards_rejected.detach()
    return {
        "rewards_chosen": rc.mean(),
        "rewards_rejected": rr.mean(),
        "reward_margin": (rc - rr).mean(),
        "reward_accuracy": (rc > rr).to(rc.dtype).mean(),
    }


def f_divergence_score(logratio, f_divergence_type, alpha):
    """f'(exp(logratio)) of the f-DPO paper, as TRL 1.16 ``DPOTrainer._compute_loss`` forms its scores."""
    if f_divergence_type == "reverse_kl" or (f_divergence_type == "alpha_divergence" and abs(alpha - 1.0) < 1e-6):
        return logratio  # f'(u) = log u (the alpha-divergence's limit at alpha = 1)
    if f_divergence_type == "forward_kl":
        return 1.0 - torch.exp(-logratio)  # f'(u) = 1 - 1/u
    if f_divergence_type == "js_divergence":
        return math.log(2.0) + F.logsigmoid(logratio)  # f'(u) = log(2u / (1 + u))
    # alpha_divergence: f'(u) = (u^(alpha-1) - 1) / (alpha - 1); TRL caps the exponent at 80 so exp stays finite
    t = torch.clamp((alpha - 1.0) * logratio, max=80.0)
    return (torch.exp(t) - 1.0) / (alpha - 1.0)


def smoothed_sigmoid(h, label_smoothing):
    """``-(1 - ls) logsigmoid(h) - ls logsigmoid(-h)``: cDPO / HALOs ``CDPOTrainer``; also TRL's AOT forms."""
    return -(1.0 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)


def dpo_pair_losses(loss_type, q, *, beta, label_smoothing, discopop_tau):
    """Per-pair loss ``[P]`` of one TRL 1.16 DPO loss type; ``q`` holds the per-pair quantities (see :func:`dpo`)."""
    sc, sr = q["chosen"], q["rejected"]  # clamped log-ratio sums (LD-weighted)
    h = beta * q["score_margin"]  # beta times the f-divergence score margin (the log-ratio margin for reverse_kl)
    ls = label_smoothing
    if loss_type == "sigmoid":
        return smoothed_sigmoid(h, ls)  # cDPO; TRL 1.16 ignores label_smoothing here
    if loss_type == "hinge":
        return torch.relu(1.0 - h)
    if loss_type == "ipo":
        return (q["score_chosen_mean"] - q["score_rejected_mean"] - 1.0 / (2.0 * beta)) ** 2
    if loss_type == "exo_pair":  # KL(softmax over {chosen, rejected} of the rewards || [1 - ls, ls])
        return (torch.sigmoid(h) * (F.logsigmoid(h) - math.log1p(-ls))
                + torch.sigmoid(-h) * (F.logsigmoid(-h) - math.log(ls)))
    if loss_type == "nca_pair":
        return -F.logsigmoid(beta * sc) - 0.5 * F.logsigmoid(-beta * sc) - 0.5 * F.logsigmoid(-beta * sr)
    if loss_type == "robust":
        return (-(1.0 - ls) * F.logsigmoid(h) + ls * F.logsigmoid(-h)) / (1.0 - 2.0 * ls)
    if loss_type == "bco_pair":
        return -F.logsigmoid(beta * sc) - F.logsigmoid(-beta * sr)
    if loss_type == "sppo_hard":
        return (sc - 0.5 / beta) ** 2 + (sr + 0.5 / beta) ** 2
    if loss_type == "aot":  # sorts the policy's and the reference's margins apart (refused with clipping)
        margin = torch.sort(q["policy_margin"]).values - torch.sort(q["reference_margin"]).values
        return smoothed_sigmoid(beta * margin, ls)
    if loss_type == "aot_unpaired":  # sorts the chosen and the rejected log-ratios apart
        margin = torch.sort(sc).values - torch.sort(sr).values
        return smoothed_sigmoid(beta * margin, ls)
    if loss_type == "apo_zero":
        return 1.0 - torch.sigmoid(beta * sc) + torch.sigmoid(beta * sr)
    if loss_type == "apo_down":
        return torch.sigmoid(beta * sc) + 1.0 - torch.sigmoid(beta * (sc - sr))
    if loss_type == "discopop":  # logistic and exponential losses mixed by sigmoid(h / tau)
        mix = torch.sigmoid(h / discopop_tau)
        return -F.logsigmoid(h) * (1.0 - mix) + torch.exp(-h) * mix
    if loss_type == "sft":  # the chosen tokens' mean NLL over the batch, one value for every pair
        return q["chosen_nll"].expand(sc.shape[0])
    # sigmoid_norm
    return -F.logsigmoid(beta * (q["score_chosen_mean"] - q["score_rejected_mean"]))


def ld_weights(mask, ld_alpha, dtype=torch.float32):
    """LD-DPO's token weights ``[2P, T]`` (TRL 1.16 ``DPOTrainer._compute_loss``, ``ld_alpha``): 1 for the tokens a
    pair shares, ``ld_alpha`` past the shorter completion -- a pair's shared length is the smaller of its two token
    counts, and a token is shared while its position among its row's masked tokens is at most that length."""
    position = mask.cumsum(dim=1)
    chosen_count, rejected_count = pairs(mask.sum(dim=1))
    shared = torch.minimum(chosen_count, rejected_count).repeat(2)
    in_shared = position <= shared.unsqueeze(1)
    return torch.where(in_shared, 1.0, float(ld_alpha)).to(dtype)


def dpo_from_rows(rows, *, beta, label_smoothing, loss_types, weights, f_divergence_type, f_alpha_divergence_coef,
                  discopop_tau):
    """DPO's loss and reward metrics from per-row sums, for the checked ``loss_types`` mixed with ``weights``
    (:func:`humanline_kernels.reference.dpo` documents each type; TRL 1.16 ``DPOTrainer._compute_loss``)."""
    s = rows.s
    score = f_divergence_score(s, f_divergence_type, f_alpha_divergence_coef)
    count = rows.counts.clamp(min=1)
    chosen, rejected = pairs(s)
    score_chosen, score_rejected = pairs(score)
    count_chosen, count_rejected = pairs(count)
    chosen_tokens = pairs(rows.counts)[0].sum()
    chosen_logps_sum = pairs(rows.policy)[0].sum()
    q = {
        "chosen": chosen,
        "rejected": rejected,
        "score_margin": score_chosen - score_rejected,
        "score_chosen_mean": score_chosen / count_chosen,
        "score_rejected_mean": score_rejected / count_rejected,
        "chosen_nll": torch.where(chosen_tokens > 0, -chosen_logps_sum / chosen_tokens.clamp(min=1), 0.0),
    }
    if "aot" in loss_types:  # clip is None here: the policy's and the reference's own (LD-weighted) sums
        policy_chosen, policy_rejected = pairs(rows.aot_policy)
        reference_chosen, reference_rejected = pairs(rows.aot_reference)
        q["policy_margin"] = policy_chosen - policy_rejected
        q["reference_margin"] = reference_chosen - reference_rejected
    pair_weight = None
    if rows.wpo is not None:
        w_chosen, w_rejected = pairs(rows.wpo)
        pair_weight = w_chosen * w_rejected
    loss = s.new_zeros(())
    for name, weight in zip(loss_types, weights):
        per_pair = dpo_pair_losses(name, q, beta=beta, label_smoothing=label_smoothing, discopop_tau=discopop_tau)
        if pair_weight is not None:
            per_pair = per_pair * pair_weight
        loss = loss + weight * per_pair.mean()
    return loss, pair_metrics(beta * chosen, beta * rejected)


def ipo_from_sums(s_mean, *, beta):
    """IPO on normalised sums: ``mean_j (s_j - s_{P+j} - 1 / (2 beta))^2`` (HALOs ``IPOTrainer.loss``); rewards are
    the normalised sums (HALOs' IPO rewards, without ``beta``)."""
    chosen, rejected = pairs(s_mean)
    return ((chosen - rejected - 1.0 / (2.0 * beta)) ** 2).mean(), pair_metrics(chosen, rejected)


def simpo_from_sums(s_mean, *, beta, gamma_beta_ratio):
    """SimPO on normalised sums of a reference of 0: ``mean_j -logsigmoid(beta (s_j - s_{P+j} - gamma_beta_ratio))``
    (HALOs ``SimPOTrainer.loss``); rewards are the normalised sums."""
    chosen, rejected = pairs(s_mean)
    return -F.logsigmoid(beta * (chosen - rejected - gamma_beta_ratio)).mean(), pair_metrics(chosen, rejected)


def slic_from_sums(s, policy, *, beta, lambda_coef):
    """SLiC on sums of a reference of 0: ``mean_j [max(0, beta - s_j + s_{P+j}) - lambda_coef policy_j]``, the
    regulariser the chosen sequence's NLL, never clamped (HALOs ``SLiCTrainer.loss`` as its docstring states it);
    rewards are the sums."""
    chosen, rejected = pairs(s)
    nll_chosen = -pairs(policy)[0]
    return (torch.relu(beta - chosen + rejected) + lambda_coef * nll_chosen).mean(), pair_metrics(chosen, rejected)
