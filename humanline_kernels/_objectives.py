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

from ._clip import clamp_band


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
    """The chosen half and the rejected half of ``[2P, ...]`` rows (views: one op in the backward, a stack)."""
    return s.view(2, -1, *s.shape[1:]).unbind(0)


@torch.no_grad()
def pair_metrics(chosen, rejected, scale=1.0):
    """Means of the per-pair rewards ``scale * chosen`` and ``scale * rejected`` (detached), their margin, and how
    often the chosen reward is the larger (compared as rewards: a scale that underflows them ties them)."""
    r = torch.stack([chosen, rejected])
    if scale != 1:
        r = r * scale  # (a Python scalar: no host-to-device copy)
    rc, rr = r.mean(1).unbind(0)
    acc = (r[0] > r[1]).to(r.dtype).mean()
    return {"rewards_chosen": rc, "rewards_rejected": rr, "reward_margin": rc - rr, "reward_accuracy": acc}


def f_divergence_score(logratio, f_divergence_type, alpha):
    """f'(exp(logratio)) of the f-DPO paper, as TRL 1.16 ``DPOTrainer._compute_loss`` forms its scores."""
    if f_divergence_type == "reverse_kl" or (f_divergence_type == "alpha_divergence" and abs(alpha - 1.0) < 1e-6):
        return logratio  # f'(u) = log u (the alpha-divergence's limit at alpha = 1)
    if f_divergence_type == "forward_kl":
        return 1.0 - torch.exp(-logratio)  # f'(u) = 1 - 1/u
    if f_divergence_type == "js_divergence":
        return math.log(2.0) + F.logsigmoid(logratio)  # f'(u) = log(2u / (1 + u))
    # alpha_divergence: f'(u) = (u^(alpha-1) - 1) / (alpha - 1); TRL caps the exponent at 80 so exp stays finite
    t = clamp_band((alpha - 1.0) * logratio, hi=80.0)
    return (torch.exp(t) - 1.0) / (alpha - 1.0)


def smoothed_sigmoid(h, label_smoothing):
    """``-(1 - ls) logsigmoid(h) - ls logsigmoid(-h)``: cDPO / HALOs ``CDPOTrainer``; also TRL's AOT forms."""
    return -(1.0 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)


def _once(fn):
    """A property computed on first use and kept: ``functools.cached_property`` without its lock (Python 3.11's
    takes an ``RLock``, which ``torch.compile`` cannot enter)."""
    name = fn.__name__

    def get(self):
        if name not in self.memo:
            self.memo[name] = fn(self)
        return self.memo[name]
    return property(get, doc=fn.__doc__)


class PairQuantities:
    """The per-pair quantities DPO's loss types read, each formed on first use, so that a loss type costs the ops
    it needs and no more: the clamped sums of the chosen and the rejected rows (LD-weighted), ``h = beta (score_c -
    score_r)`` with the f-divergence scores, the scores' per-token means, the chosen tokens' mean NLL, and "aot"'s
    policy and reference margins."""

    def __init__(self, rows, *, beta, f_divergence_type, f_alpha_divergence_coef):
        self.rows, self.beta = rows, beta
        self.f, self.alpha = f_divergence_type, f_alpha_divergence_coef
        self.memo = {}

    @_once
    def sums(self):
        return pairs(self.rows.s)

    @_once
    def scores(self):
        if self.f == "reverse_kl":
            return self.sums
        return pairs(f_divergence_score(self.rows.s, self.f, self.alpha))

    @_once
    def h(self):
        c, r = self.scores
        return self.beta * (c - r)

    @_once
    def score_means(self):
        c, r = pairs(self.rows.counts.clamp(min=1))
        sc, sr = self.scores
        return sc / c, sr / r

    @_once
    def chosen_nll(self):
        tokens = pairs(self.rows.counts)[0].sum()
        return torch.where(tokens > 0, -pairs(self.rows.policy)[0].sum() / tokens.clamp(min=1), 0.0)

    @_once
    def aot_margins(self):
        pc, pr = pairs(self.rows.aot_policy)
        rc, rr = pairs(self.rows.aot_reference)
        return pc - pr, rc - rr


def dpo_pair_losses(loss_type, q, *, beta, label_smoothing, discopop_tau):
    """Per-pair loss ``[P]`` of one TRL 1.16 DPO loss type from the :class:`PairQuantities` ``q`` (see
    :func:`humanline_kernels.reference.dpo`)."""
    ls = label_smoothing
    if loss_type == "sigmoid":
        return smoothed_sigmoid(q.h, ls)  # cDPO; TRL 1.16 ignores label_smoothing here
    if loss_type == "hinge":
        return torch.relu(1.0 - q.h)
    if loss_type == "ipo":
        c, r = q.score_means
        return (c - r - 1.0 / (2.0 * beta)) ** 2
    if loss_type == "exo_pair":  # KL(softmax over {chosen, rejected} of the rewards || [1 - ls, ls])
        h = q.h
        return (torch.sigmoid(h) * (F.logsigmoid(h) - math.log1p(-ls))
                + torch.sigmoid(-h) * (F.logsigmoid(-h) - math.log(ls)))
    if loss_type == "robust":
        return (-(1.0 - ls) * F.logsigmoid(q.h) + ls * F.logsigmoid(-q.h)) / (1.0 - 2.0 * ls)
    if loss_type == "discopop":  # logistic and exponential losses mixed by sigmoid(h / tau)
        mix = torch.sigmoid(q.h / discopop_tau)
        return -F.logsigmoid(q.h) * (1.0 - mix) + torch.exp(-q.h) * mix
    if loss_type == "sigmoid_norm":
        c, r = q.score_means
        return -F.logsigmoid(beta * (c - r))
    if loss_type == "sft":  # the chosen tokens' mean NLL over the batch, one value for every pair
        return q.chosen_nll.expand(q.sums[0].shape[0])
    if loss_type == "aot":  # sorts the policy's and the reference's margins apart (refused with clipping)
        policy, reference = q.aot_margins
        return smoothed_sigmoid(beta * (torch.sort(policy).values - torch.sort(reference).values), ls)
    sc, sr = q.sums  # the types below read the log-ratio sums themselves (no f-divergence form)
    if loss_type == "nca_pair":
        return -F.logsigmoid(beta * sc) - 0.5 * F.logsigmoid(-beta * sc) - 0.5 * F.logsigmoid(-beta * sr)
    if loss_type == "bco_pair":
        return -F.logsigmoid(beta * sc) - F.logsigmoid(-beta * sr)
    if loss_type == "sppo_hard":
        return (sc - 0.5 / beta) ** 2 + (sr + 0.5 / beta) ** 2
    if loss_type == "aot_unpaired":  # sorts the chosen and the rejected log-ratios apart
        return smoothed_sigmoid(beta * (torch.sort(sc).values - torch.sort(sr).values), ls)
    if loss_type == "apo_zero":
        return 1.0 - torch.sigmoid(beta * sc) + torch.sigmoid(beta * sr)
    # apo_down
    return torch.sigmoid(beta * sc) + 1.0 - torch.sigmoid(beta * (sc - sr))


def mixture(loss_type, loss_weights, rpo_alpha):
    """DPO's ``(loss_types, weights)``: TRL 1.16's weighted mixture of loss types (one name is a mixture of one),
    with RPO's NLL appended as TRL writes it (``"sft"`` weighted ``rpo_alpha``)."""
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    weights = [1.0] * len(types) if loss_weights is None else list(loss_weights)
    if rpo_alpha is not None:
        types, weights = types + ["sft"], weights + [rpo_alpha]
    return types, weights


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
    q = PairQuantities(rows, beta=beta, f_divergence_type=f_divergence_type,
                       f_alpha_divergence_coef=f_alpha_divergence_coef)
    loss = None
    for name, weight in zip(loss_types, weights):
        per_pair = dpo_pair_losses(name, q, beta=beta, label_smoothing=label_smoothing, discopop_tau=discopop_tau)
        if rows.wpo is not None:
            c, r = pairs(rows.wpo)
            per_pair = per_pair * (c * r)
        term = per_pair.mean() if weight == 1 else weight * per_pair.mean()
        loss = term if loss is None else loss + term
    return loss, pair_metrics(*q.sums, beta)


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
