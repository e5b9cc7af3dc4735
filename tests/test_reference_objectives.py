"""hk.reference's objectives with humanline on: against HALOs' formulas, against the substitution rule, and on
their own (edge cases, dtypes, gradients, refusals).

HALOs (github.com/ContextualAI/HALOs, ``train/trainers.py``, identical on ``main`` 4831988 and ``research``
aa02f66) is re-derived here from its trainers' ``loss`` methods: ``BasicTrainer.get_sequence_rewards`` (clamp each
token's log-ratio, sum, optionally divide by the count of non-zero clamped tokens), ``get_ratios`` (GRPO), and
``DPOTrainer``, ``CDPOTrainer``, ``IPOTrainer``, ``SimPOTrainer``, ``SLiCTrainer``, ``KTOTrainer``, ``GRPOTrainer``.
HALOs' per-token log-probs are 0 at padding (``get_batch_logps`` multiplies by the loss mask), so the test data
keep every masked token's log-ratio non-zero: HALOs' counts of non-zero tokens are then the masked-token counts.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import humanline_kernels as hk
from humanline_kernels import _validation as V

R = hk.reference
HALOS_CLIP = hk.HumanlineClip(-1.0, 1.5)  # HALOs' config defaults (log_epsilon_P, log_epsilon_R)
CLIPS = [hk.HumanlineClip(), HALOS_CLIP, None]
CLIP_IDS = ["paper", "halos", "off"]


def _data(B, T, *, seed=0, dtype=torch.float64, scale=1.2, masked_rows=(), odd=False):
    """Log-probs with log-ratios spread past both ends of the band, a ragged mask, no masked log-ratio of 0."""
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.01
    ref = logps + torch.randn(B, T, generator=g, dtype=torch.float64) * scale
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    if odd:  # odd token counts per row
        for i in range(B):
            if mask[i].sum() % 2 == 0:
                mask[i, mask[i].nonzero()[-1]] = False
    for r in masked_rows:
        mask[r] = False
    return logps.to(dtype), ref.to(dtype), mask


def _halos_inputs(logps, ref, mask):
    """HALOs' per-token log-probs: 0 at padding."""
    return logps * mask, ref * mask


# ---------------------------------------------------------------------------------------------------------------
# HALOs, re-derived


def halos_sequence_rewards(policy, reference, clip, length_normalized=False):
    """HALOs ``BasicTrainer.get_sequence_rewards``: (sequence rewards, unclamped fraction)."""
    logratio = policy - reference
    if clip is not None:
        tokens = logratio.clamp(clip.log_eps_p, clip.log_eps_r)
        nonzero = logratio.detach() != 0
        inside = (clip.log_eps_p < logratio.detach()) & (logratio.detach() < clip.log_eps_r) & nonzero
        unclamped = (inside.sum() / nonzero.sum().clamp(min=1)).clamp(0, 1)
    else:
        tokens, unclamped = logratio, torch.ones(())
    norm = (tokens.abs() != 0).sum(-1) if length_normalized else 1
    return tokens.sum(-1) / norm, unclamped


def _halos_pair(logps, ref, mask, clip, *, length_normalized=False, zero_reference=False):
    policy, reference = _halos_inputs(logps, ref, mask)
    if zero_reference:
        reference = torch.zeros_like(policy)
    P = logps.shape[0] // 2
    c, _ = halos_sequence_rewards(policy[:P], reference[:P], clip, length_normalized)
    r, _ = halos_sequence_rewards(policy[P:], reference[P:], clip, length_normalized)
    return c, r


def halos_dpo(logps, ref, mask, clip, beta):
    """HALOs ``DPOTrainer.loss``."""
    c, r = _halos_pair(logps, ref, mask, clip)
    return -F.logsigmoid(beta * c - beta * r).mean()


def halos_cdpo(logps, ref, mask, clip, beta, epsilon):
    """HALOs ``CDPOTrainer.loss`` (``config.loss.epsilon`` is our ``label_smoothing``)."""
    c, r = _halos_pair(logps, ref, mask, clip)
    c, r = beta * c, beta * r
    return ((1 - epsilon) * -F.logsigmoid(c - r) + epsilon * -F.logsigmoid(r - c)).mean()


def halos_ipo(logps, ref, mask, clip, tau):
    """HALOs ``IPOTrainer.loss``."""
    c, r = _halos_pair(logps, ref, mask, clip, length_normalized=True)
    return ((c - r - 1 / (2 * tau)) ** 2).mean()


def halos_simpo(logps, mask, clip, beta, gamma_beta_ratio):
    """HALOs ``SimPOTrainer.loss``: the reference is 0."""
    c, r = _halos_pair(logps, torch.zeros_like(logps), mask, clip, length_normalized=True, zero_reference=True)
    return -F.logsigmoid(beta * (c - r - gamma_beta_ratio)).mean()


def halos_slic_calibration(logps, mask, clip, beta):
    """HALOs ``SLiCTrainer.loss``'s calibration term (reference 0)."""
    c, r = _halos_pair(logps, torch.zeros_like(logps), mask, clip, zero_reference=True)
    return torch.clamp(beta - c + r, min=0)


def halos_kto(logps, ref, mask, desirable, kl_logps, kl_ref, kl_mask, clip, beta, dw, uw):
    """HALOs ``KTOTrainer.loss`` (one process: ``accelerator.reduce`` is the identity)."""
    policy, reference = _halos_inputs(logps, ref, mask)
    kl_policy, kl_reference = _halos_inputs(kl_logps, kl_ref, kl_mask)
    chosen, _ = halos_sequence_rewards(policy[desirable], reference[desirable], clip)
    rejected, _ = halos_sequence_rewards(policy[~desirable], reference[~desirable], clip)
    kl_rewards, _ = halos_sequence_rewards(kl_policy.detach(), kl_reference.detach(), clip)
    KL = (kl_rewards.sum() / (kl_rewards.abs() != 0).sum().clamp(min=1)).clamp(min=0)
    losses = torch.cat((dw * (1 - torch.sigmoid(beta * (chosen - KL))),
                        uw * (1 - torch.sigmoid(beta * (KL - rejected)))))
    return losses.mean(), KL


def halos_grpo(logps, ref, advantages, mask, clip, beta, epsilon):
    """HALOs ``GRPOTrainer.loss`` (``get_ratios``, the PPO clip at ``1 +- epsilon``, k3 on the unclamped ratio,
    ``masked_mean`` over all tokens)."""
    policy, reference = _halos_inputs(logps, ref, mask)
    logratio = policy - reference
    if clip is not None:
        logratio = logratio.clamp(clip.log_eps_p, clip.log_eps_r)
    ratio = logratio.exp()
    A = advantages.unsqueeze(-1)
    per_token_kl = torch.exp(reference - policy) - (reference - policy) - 1
    per_token = -torch.min(A * ratio, A * ratio.clamp(1 - epsilon, 1 + epsilon)) + beta * per_token_kl
    m = mask.to(logps.dtype)
    return (per_token * m).sum() / m.sum()


def _same_loss_and_grad(ours_fn, halos_fn, logps):
    x1, x2 = logps.clone().requires_grad_(), logps.clone().requires_grad_()
    ours = ours_fn(x1)
    ours = ours[0] if isinstance(ours, tuple) else ours
    theirs = halos_fn(x2)
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-10, atol=1e-12)
    return x1.grad


@pytest.mark.parametrize("clip", CLIPS, ids=CLIP_IDS)
def test_dpo_and_cdpo_match_halos(clip):
    logps, ref, mask = _data(6, 7, seed=1)
    grad = _same_loss_and_grad(lambda x: R.dpo(x, ref, mask, clip=clip, beta=0.3),
                               lambda x: halos_dpo(x, ref, mask, clip, 0.3), logps)
    if clip is not None:  # tokens outside the band get no gradient
        delta = logps - ref
        outside = mask & ((delta < clip.log_eps_p) | (delta > clip.log_eps_r))
        assert outside.any() and (grad[outside] == 0).all()
    _same_loss_and_grad(lambda x: R.dpo(x, ref, mask, clip=clip, beta=0.3, label_smoothing=0.2),
                        lambda x: halos_cdpo(x, ref, mask, clip, 0.3, 0.2), logps)


@pytest.mark.parametrize("clip", CLIPS, ids=CLIP_IDS)
def test_ipo_matches_halos_and_trl_form(clip):
    logps, ref, mask = _data(6, 7, seed=2)
    _same_loss_and_grad(lambda x: R.ipo(x, ref, mask, clip=clip, beta=0.4),
                        lambda x: halos_ipo(x, ref, mask, clip, 0.4), logps)
    # dpo(loss_type="ipo") (TRL's form) is the same loss
    torch.testing.assert_close(R.dpo(logps, ref, mask, clip=clip, beta=0.4, loss_type="ipo")[0],
                               R.ipo(logps, ref, mask, clip=clip, beta=0.4)[0])


@pytest.mark.parametrize("clip", CLIPS, ids=CLIP_IDS)
def test_simpo_matches_halos(clip):
    logps, _, mask = _data(6, 7, seed=3)
    _same_loss_and_grad(lambda x: R.simpo(x, mask, clip=clip, beta=2.0, gamma_beta_ratio=0.3),
                        lambda x: halos_simpo(x, mask, clip, 2.0, 0.3), logps)


@pytest.mark.parametrize("clip", CLIPS, ids=CLIP_IDS)
def test_slic_matches_halos_calibration_and_its_documented_regulariser(clip):
    logps, _, mask = _data(6, 7, seed=4)
    lam = 0.1

    def halos_as_documented(x):  # "the NLL of the chosen sequence", never clamped
        nll = -(x[:3] * mask[:3]).sum(-1)
        return (halos_slic_calibration(x, mask, clip, 1.0) + lam * nll).mean()

    _same_loss_and_grad(lambda x: R.slic(x, mask, clip=clip, beta=1.0, lambda_coef=lam), halos_as_documented, logps)


def test_slic_halos_code_broadcasts_the_token_nll_where_its_docstring_says_sequence_nll():
    # HALOs' code: losses = cal_loss [P] + lambda * (-policy_chosen_logps [P, T]); with T == P it broadcasts
    # (cal_loss along the last axis) and the mean becomes mean(cal) + lambda * token-level NLL over all P*T slots.
    logps, _, mask = _data(6, 3, seed=5)
    cal = halos_slic_calibration(logps, mask, None, 1.0)
    literal = (cal + 0.1 * -(logps[:3] * mask[:3])).mean()
    torch.testing.assert_close(literal, cal.mean() + 0.1 * -(logps[:3] * mask[:3]).mean())
    ours, _ = R.slic(logps, mask, clip=None, beta=1.0, lambda_coef=0.1)
    assert abs(ours.item() - literal.item()) > 1e-3
    with pytest.raises(RuntimeError):  # T != P: HALOs' expression does not broadcast at all
        l4, _, m4 = _data(6, 4, seed=5)
        halos_slic_calibration(l4, m4, None, 1.0) + 0.1 * -(l4[:3] * m4[:3])


@pytest.mark.parametrize("clip", CLIPS, ids=CLIP_IDS)
def test_kto_matches_halos(clip):
    logps, ref, mask = _data(5, 6, seed=6)
    kl_logps, kl_ref, kl_mask = _data(4, 6, seed=7, scale=0.8)
    kl_ref[1] = kl_logps[1]  # a KL row summing to 0 does not count in HALOs' mean
    desirable = torch.tensor([True, False, True, True, False])
    _same_loss_and_grad(
        lambda x: R.kto(x, ref, mask, desirable, kl_logps, kl_ref, kl_mask, clip=clip, beta=0.5,
                        desirable_weight=1.3, undesirable_weight=0.7),
        lambda x: halos_kto(x, ref, mask, desirable, kl_logps, kl_ref, kl_mask, clip, 0.5, 1.3, 0.7), logps)
    _, m = R.kto(logps, ref, mask, desirable, kl_logps, kl_ref, kl_mask, clip=clip, beta=0.5)
    _, KL = halos_kto(logps, ref, mask, desirable, kl_logps, kl_ref, kl_mask, clip, 0.5, 1.0, 1.0)
    torch.testing.assert_close(m["kl"], KL)


@pytest.mark.parametrize("clip", CLIPS, ids=CLIP_IDS)
def test_grpo_matches_halos(clip):
    logps, ref, mask = _data(6, 7, seed=8, scale=0.9)
    A = torch.randn(6, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    _same_loss_and_grad(
        lambda x: R.grpo(x, ref, A, mask, clip=clip, beta=0.01, epsilon_low=0.01, epsilon_high=0.01),
        lambda x: halos_grpo(x, ref, A, mask, clip, 0.01, 0.01), logps)


@pytest.mark.parametrize("clip", [hk.HumanlineClip(), HALOS_CLIP], ids=CLIP_IDS[:2])
def test_unclipped_frac_matches_halos_unclamped(clip):
    logps, ref, mask = _data(6, 7, seed=9)
    policy, reference = _halos_inputs(logps, ref, mask)
    _, unclamped = halos_sequence_rewards(policy, reference, clip)
    for value in (R.dpo(logps, ref, mask, clip=clip)[1]["unclipped_frac"],
                  R.sequence_logratios(logps, ref, mask, clip=clip)[2]["unclipped_frac"],
                  R.grpo(logps, ref, torch.ones(6, dtype=torch.float64), mask, clip=clip)[1]["unclipped_frac"]):
        torch.testing.assert_close(value, unclamped.to(value.dtype))


# ---------------------------------------------------------------------------------------------------------------
# hand-computed cases with humanline on


def test_ipo_simpo_slic_by_hand():
    clip = hk.HumanlineClip(-1.0, 0.5)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    # ipo: chosen deltas [0.2, 0.9 -> 0.5] mean 0.35; rejected deltas [-1.5 -> -1.0, 0.1, -0.4] mean -0.433..
    ref = torch.zeros(2, 3, dtype=torch.float64)
    logps = torch.tensor([[0.2, 0.9, 7.0], [-1.5, 0.1, -0.4]], dtype=torch.float64)
    loss, m = R.ipo(logps, ref, mask, clip=clip, beta=0.5)
    d = 0.35 - (-1.3 / 3)
    assert loss.item() == pytest.approx((d - 1.0) ** 2)
    assert m["rewards_chosen"].item() == pytest.approx(0.35)
    # simpo: reference 0, so the clamp floors each log-prob at -1.0
    lp = torch.tensor([[-0.5, -2.0, 0.0], [-0.2, -0.3, -3.0]], dtype=torch.float64)
    loss, _ = R.simpo(lp, mask, clip=clip, beta=2.0, gamma_beta_ratio=0.25)
    c, r = (-0.5 - 1.0) / 2, (-0.2 - 0.3 - 1.0) / 3
    assert loss.item() == pytest.approx(math.log1p(math.exp(-2.0 * (c - r - 0.25))))
    # slic: calibration on the clamped sums, regulariser on the raw chosen sum
    loss, _ = R.slic(lp, mask, clip=clip, beta=1.0, lambda_coef=0.1)
    cs, rs = -0.5 - 1.0, -0.2 - 0.3 - 1.0
    assert loss.item() == pytest.approx(max(0.0, 1.0 - cs + rs) + 0.1 * 2.5)


def test_sequence_logratios_by_hand():
    clip = hk.HumanlineClip(-1.0, 0.5)
    ref = torch.zeros(3, 3, dtype=torch.float64)
    logps = torch.tensor([[0.2, 0.9, 7.0], [-1.5, 0.1, -0.4], [5.0, 5.0, 5.0]], dtype=torch.float64,
                         requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, True, True], [False, False, False]])
    s, p, m = R.sequence_logratios(logps, ref, mask, clip=clip)
    torch.testing.assert_close(s, torch.tensor([0.7, -1.3, 0.0], dtype=torch.float64))
    torch.testing.assert_close(p, torch.tensor([1.1, -1.8, 0.0], dtype=torch.float64))
    assert m["n_tokens"].item() == 5 and m["n_unclipped"].item() == 3
    assert m["unclipped_frac"].item() == pytest.approx(0.6)
    sn, _, _ = R.sequence_logratios(logps, ref, mask, clip=clip, normalize=True)
    torch.testing.assert_close(sn, torch.tensor([0.35, -1.3 / 3, 0.0], dtype=torch.float64))
    (s.sum() + p.sum()).backward()
    expected = torch.tensor([[2.0, 1.0, 0.0], [1.0, 2.0, 2.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logps.grad, expected)  # clamped tokens: policy_sums' gradient only
    s0, _, m0 = R.sequence_logratios(logps, None, mask)  # reference 0, no clip
    torch.testing.assert_close(s0, p)
    assert m0["unclipped_frac"].item() == 1.0


# ---------------------------------------------------------------------------------------------------------------
# the substitution rule: with humanline, each log-ratio objective is the plain one on the clamped log-ratios


def _pre_clamped(logps, ref, clip):
    """Log-probs whose log-ratio against ``ref`` is already ``Delta_hat``, and the band indicator."""
    delta = logps - ref
    inside = (delta >= clip.log_eps_p) & (delta <= clip.log_eps_r)
    return ref + delta.clamp(clip.log_eps_p, clip.log_eps_r), inside


RATIO_DPO_TYPES = [t for t in V.DPO_LOSS_TYPES if t not in ("aot", "sft")]


@pytest.mark.parametrize("loss_type", RATIO_DPO_TYPES)
@pytest.mark.parametrize("extra", [{}, {"ld_alpha": 0.3}, {"f_divergence_type": "js_divergence"}],
                         ids=["plain", "ld", "js"])
def test_dpo_humanline_is_the_plain_loss_on_clamped_log_ratios(loss_type, extra):
    if "f_divergence_type" in extra and loss_type not in V.F_DIVERGENCE_LOSS_TYPES:
        pytest.skip("no f-divergence form")
    clip = hk.HumanlineClip()
    logps, ref, mask = _data(6, 8, seed=10, scale=1.5)
    kw = dict(beta=0.4, loss_type=loss_type, label_smoothing=0.1 if loss_type != "sigmoid" else 0.0, **extra)
    x = logps.clone().requires_grad_()
    loss, m = R.dpo(x, ref, mask, clip=clip, **kw)
    loss.backward()
    y0, inside = _pre_clamped(logps, ref, clip)
    assert (mask & ~inside).any()
    y = y0.clone().requires_grad_()
    plain, pm = R.dpo(y, ref, mask, clip=None, **kw)
    plain.backward()
    torch.testing.assert_close(loss, plain)
    torch.testing.assert_close(x.grad, torch.where(inside, y.grad, 0.0))
    assert m["rewards_chosen"].item() == pytest.approx(pm["rewards_chosen"].item())


def test_dpo_policy_only_terms_stay_unclamped():
    logps, ref, mask = _data(6, 8, seed=11, scale=1.5)
    lss = -torch.rand(6, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for kw in ({"loss_type": "sft"}, {"loss_type": "sft", "use_weighting": True, "log_sum_sq_probs": lss}):
        x1, x2 = logps.clone().requires_grad_(), logps.clone().requires_grad_()
        a, _ = R.dpo(x1, ref, mask, clip=hk.HumanlineClip(), **kw)
        b, _ = R.dpo(x2, ref, mask, clip=None, **kw)
        torch.testing.assert_close(a, b)
        a.backward()
        b.backward()
        torch.testing.assert_close(x1.grad, x2.grad)
    # WPO's weights do not see the clamp either: they are the same with and without it
    wpo = dict(use_weighting=True, log_sum_sq_probs=lss)
    a, _ = R.dpo(logps, ref, mask, clip=hk.HumanlineClip(), **wpo)
    b, _ = R.dpo(_pre_clamped(logps, ref, hk.HumanlineClip())[0], ref, mask, clip=None, **wpo)
    assert abs(a.item() - b.item()) > 1e-6  # pre-clamping the policy would change the weights: the rule's limit


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "sapo", "luspo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_grpo_humanline_is_trls_formula_with_the_clamped_log_ratio(loss_type, level):
    clip = hk.HumanlineClip(-0.5, 0.4)
    logps, ref, mask = _data(6, 7, seed=12, scale=0.8)
    A = torch.randn(6, 7, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    kw = dict(loss_type=loss_type, importance_sampling_level=level, epsilon_high=0.28,
              delta=1.3 if loss_type != "sapo" else None, entropies=torch.rand(6, 7, dtype=torch.float64),
              top_entropy_quantile=0.5)
    x = logps.clone().requires_grad_()
    loss, _ = R.grpo(x, ref, A, mask, clip=clip, **kw)
    loss.backward()
    y0, inside = _pre_clamped(logps, ref, clip)
    assert (mask & ~inside).any()
    y = y0.clone().requires_grad_()
    plain, _ = R.grpo(y, ref, A, mask, clip=None, **kw)
    plain.backward()
    torch.testing.assert_close(loss, plain)
    torch.testing.assert_close(x.grad, torch.where(inside, y.grad, 0.0))


@pytest.mark.parametrize("loss_type", ["cispo", "vespo"])
def test_grpo_cispo_vespo_clamp_only_their_weight(loss_type):
    clip = hk.HumanlineClip(-0.5, 0.4)
    logps, ref, mask = _data(6, 7, seed=13, scale=0.8)
    A = torch.randn(6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    x = logps.clone().requires_grad_()
    loss, m = R.grpo(x, ref, A, mask, clip=clip, loss_type=loss_type, epsilon_high=1.3)
    loss.backward()
    d_hat = torch.where(mask, (logps - ref).clamp(-0.5, 0.4), 0.0)
    if loss_type == "cispo":
        weight = torch.clamp(torch.exp(d_hat), max=1.3)
    else:
        log_w = d_hat.sum(1, keepdim=True).clamp(math.log(1e-8), 20.0)
        k = torch.where(A[:, None] >= 0, 2.0, 3.0).double()
        lam = torch.where(A[:, None] >= 0, 3.0, 2.0).double()
        weight = torch.exp(lam + k * log_w - lam * log_w.exp())
        assert m["vespo_phi_mean"].item() == pytest.approx(weight.mean().item())
    expected = -(weight * A[:, None] * torch.where(mask, logps, 0.0)).sum() / mask.sum()
    torch.testing.assert_close(loss, expected)
    # every masked token keeps a gradient (the weight), also outside the band
    torch.testing.assert_close(x.grad, torch.where(mask, -weight * A[:, None] / mask.sum(), 0.0))


def test_kto_apo_zero_unpaired_with_humanline_uses_clamped_sums():
    clip = hk.HumanlineClip()
    logps, ref, mask = _data(5, 6, seed=14, scale=1.5)
    desirable = torch.tensor([True, False, True, False, False])
    loss, m = R.kto(logps, ref, mask, desirable, clip=clip, beta=0.5, loss_type="apo_zero_unpaired",
                    desirable_weight=2.0)
    s = torch.where(mask, (logps - ref).clamp(-1.5, 1.5), 0.0).sum(1)
    expected = torch.where(desirable, 2.0 * (1 - torch.sigmoid(0.5 * s)), torch.sigmoid(0.5 * s)).mean()
    torch.testing.assert_close(loss, expected)
    assert m["kl"].item() == 0.0


# ---------------------------------------------------------------------------------------------------------------
# self-consistency: empty rows, normalize, odd counts, dtypes, gradients


def _every_objective(logps, ref, mask, clip):
    """(name, loss-and-metrics thunk) for every objective and option this module adds, on ``2P`` rows."""
    B, T = logps.shape
    g = torch.Generator().manual_seed(5)
    A = torch.randn(B, generator=g, dtype=torch.float64).to(logps.dtype)
    ent = torch.rand(B, T, generator=g, dtype=torch.float64).to(logps.dtype)
    lss = (-torch.rand(B, T, generator=g, dtype=torch.float64)).to(logps.dtype)
    isr = torch.rand(B, T, generator=g, dtype=torch.float64).to(logps.dtype) + 0.5
    des = torch.arange(B) % 3 == 0
    cases = {
        "seq": lambda x: (R.sequence_logratios(x, ref, mask, clip=clip)[0].sum(), {}),
        "seq_norm": lambda x: (R.sequence_logratios(x, ref, mask, clip=clip, normalize=True)[0].sum(), {}),
        "ipo": lambda x: R.ipo(x, ref, mask, clip=clip),
        "simpo": lambda x: R.simpo(x, mask, clip=clip),
        "slic": lambda x: R.slic(x, mask, clip=clip),
        "kto": lambda x: R.kto(x, ref, mask, des, x.detach(), ref, mask, clip=clip),
        "kto_trl": lambda x: R.kto(x, ref, mask, des, x.detach(), ref, mask, clip=clip, kl_estimate="trl"),
        "apo_zero_unpaired": lambda x: R.kto(x, ref, mask, des, clip=clip, loss_type="apo_zero_unpaired"),
        "dpo_rpo_wpo_ld": lambda x: R.dpo(x, ref, mask, clip=clip, rpo_alpha=0.5, use_weighting=True,
                                          log_sum_sq_probs=lss, ld_alpha=0.5),
        "dpo_rpo_ld": lambda x: R.dpo(x, ref, mask, clip=clip, loss_type=["sigmoid", "apo_down"], rpo_alpha=0.5,
                                      ld_alpha=0.5),
    }
    for t in V.DPO_LOSS_TYPES:
        if t == "aot" and clip is not None:
            continue
        cases[f"dpo_{t}"] = lambda x, t=t: R.dpo(x, ref, mask, clip=clip, loss_type=t, label_smoothing=0.1)
    for f in V.F_DIVERGENCE_TYPES:
        cases[f"dpo_{f}"] = lambda x, f=f: R.dpo(x, ref, mask, clip=clip, f_divergence_type=f)
    for t in V.GRPO_LOSS_TYPES:
        for level in V.IMPORTANCE_SAMPLING_LEVELS:
            cases[f"grpo_{t}_{level}"] = lambda x, t=t, level=level: R.grpo(
                x, ref, A, mask, clip=clip, loss_type=t, importance_sampling_level=level, beta=0.1,
                use_bias_correction_kl=True, importance_sampling_ratio=isr, top_entropy_quantile=0.5, entropies=ent,
                entropy_coef=0.01, off_policy_mask_threshold=0.1, sampling_per_token_logps=x.detach() + isr - 1.0,
                tool_mask=torch.ones_like(mask), delta=2.0 if t in V.GRPO_PPO_CLIP_TYPES else None)
    return cases


@pytest.mark.parametrize("clip", CLIPS, ids=CLIP_IDS)
def test_fully_masked_rows_give_no_nan_anywhere(clip):
    logps, ref, mask = _data(6, 5, seed=15, masked_rows=(1, 4))
    logps[1] = float("nan")  # whatever sits in a fully masked row must not leak
    ref[4] = float("nan")
    for name, fn in _every_objective(logps, ref, mask, clip).items():
        x = logps.clone().requires_grad_()
        loss, metrics = fn(x)
        loss.backward()
        assert torch.isfinite(loss), name
        assert all(torch.isfinite(v) for v in metrics.values()), name
        assert torch.isfinite(x.grad).all() and (x.grad[[1, 4]] == 0).all(), name


@pytest.mark.parametrize("clip", CLIPS, ids=CLIP_IDS)
def test_values_at_masked_positions_change_nothing(clip):
    # every per-token input (log-probs, reference, vLLM weight, entropies, sampler log-probs) is read on masked
    # tokens only, so garbage elsewhere changes neither the loss nor the gradient
    logps, ref, mask = _data(6, 7, seed=23)
    g = torch.Generator().manual_seed(3)
    noise = lambda: torch.where(mask, 0.0, torch.randn(6, 7, generator=g, dtype=torch.float64) * 5)  # noqa: E731
    A = torch.randn(6, 7, generator=g, dtype=torch.float64)
    ent = torch.rand(6, 7, generator=g, dtype=torch.float64)
    isr = torch.rand(6, 7, generator=g, dtype=torch.float64) + 0.5
    samp = logps + torch.randn(6, 7, generator=g, dtype=torch.float64) * 0.3
    lss = -torch.rand(6, 7, generator=g, dtype=torch.float64)

    def run(lp, rf, w, e, sp, ls):
        out = {}
        for t in V.GRPO_LOSS_TYPES:
            for level in V.IMPORTANCE_SAMPLING_LEVELS:
                x = lp.clone().requires_grad_()
                loss, _ = R.grpo(x, rf, A, mask, clip=clip, loss_type=t, importance_sampling_level=level, beta=0.1,
                                 use_bias_correction_kl=True, importance_sampling_ratio=w, entropies=e,
                                 top_entropy_quantile=0.5, entropy_coef=0.02, off_policy_mask_threshold=0.1,
                                 sampling_per_token_logps=sp)
                loss.backward()
                out[t, level] = (loss, x.grad)
        for t in V.DPO_LOSS_TYPES:
            if t == "aot" and clip is not None:
                continue
            x = lp.clone().requires_grad_()
            wpo = {} if t.startswith("aot") else {"use_weighting": True, "log_sum_sq_probs": ls}
            loss, _ = R.dpo(x, rf, mask, clip=clip, loss_type=t, label_smoothing=0.1, ld_alpha=0.5, **wpo)
            loss.backward()
            out[t] = (loss, x.grad)
        return out

    a = run(logps, ref, isr, ent, samp, lss)
    b = run(logps + noise(), ref + noise(), isr + noise().abs(), ent + noise().abs(), samp + noise(), lss + noise())
    for k in a:
        torch.testing.assert_close(a[k][0], b[k][0], msg=str(k))
        torch.testing.assert_close(a[k][1], b[k][1], msg=str(k))


@pytest.mark.parametrize("clip", CLIPS, ids=CLIP_IDS)
def test_all_tokens_masked_gives_no_nan(clip):
    logps, ref, _ = _data(4, 3, seed=16)
    mask = torch.zeros(4, 3, dtype=torch.bool)
    for name, fn in _every_objective(logps, ref, mask, clip).items():
        x = logps.clone().requires_grad_()
        loss, metrics = fn(x)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(x.grad).all(), name
        assert all(torch.isfinite(v) for v in metrics.values()), name
        if "unclipped_frac" in metrics:
            assert metrics["unclipped_frac"].item() == 1.0, name


@pytest.mark.parametrize("clip", CLIPS, ids=CLIP_IDS)
def test_float32_agrees_with_float64_and_gradients_are_finite(clip):
    logps, ref, mask = _data(6, 9, seed=17, odd=True)
    assert (mask.sum(1) % 2 == 1).all()
    f64 = _every_objective(logps, ref, mask, clip)
    f32 = _every_objective(logps.float(), ref.float(), mask, clip)
    for name in f64:
        x64, x32 = logps.clone().requires_grad_(), logps.float().clone().requires_grad_()
        l64, m64 = f64[name](x64)
        l32, m32 = f32[name](x32)
        assert l32.dtype == torch.float32 and l64.dtype == torch.float64, name
        torch.testing.assert_close(l32.double(), l64, rtol=1e-5, atol=1e-5, msg=name)
        l64.backward()
        l32.backward()
        assert torch.isfinite(x32.grad).all(), name
        torch.testing.assert_close(x32.grad.double(), x64.grad, rtol=1e-4, atol=1e-5, msg=name)
        for k in m64:
            assert not m64[k].requires_grad and m64[k].dim() == 0, (name, k)
            torch.testing.assert_close(m32[k].double(), m64[k], rtol=1e-5, atol=1e-5, msg=f"{name}:{k}")


@pytest.mark.parametrize("clip", [hk.HumanlineClip(-1.0, 0.5), None], ids=["clip", "off"])
def test_gradcheck_float64(clip):
    logps, ref, mask = _data(4, 5, seed=18, scale=1.0)
    # (not WPO: its weights are detached on purpose, as in TRL)
    names = ["ipo", "simpo", "slic", "seq_norm", "apo_zero_unpaired", "dpo_rpo_ld", "dpo_exo_pair",
             "dpo_alpha_divergence", "dpo_aot_unpaired", "grpo_sapo_sequence", "grpo_luspo_token",
             "grpo_dapo_sequence"]
    cases = _every_objective(logps, ref, mask, clip)
    for name in names:
        fn = cases[name]
        assert torch.autograd.gradcheck(lambda x: fn(x)[0], (logps.clone().requires_grad_(),), eps=1e-6,
                                        atol=1e-7), name


def test_normalize_divides_by_masked_tokens_and_ld_alpha_one_is_plain():
    logps, ref, mask = _data(6, 9, seed=19, odd=True)
    s, _, _ = R.sequence_logratios(logps, ref, mask, clip=hk.HumanlineClip())
    sn, _, _ = R.sequence_logratios(logps, ref, mask, clip=hk.HumanlineClip(), normalize=True)
    torch.testing.assert_close(sn, s / mask.sum(1))
    for t in ("sigmoid", "aot_unpaired", "apo_zero"):
        torch.testing.assert_close(R.dpo(logps, ref, mask, loss_type=t, ld_alpha=1.0)[0],
                                   R.dpo(logps, ref, mask, loss_type=t)[0])


def test_rpo_alpha_and_mixtures_compose():
    logps, ref, mask = _data(6, 8, seed=20)
    one = {t: R.dpo(logps, ref, mask, loss_type=t)[0] for t in ("sigmoid", "hinge", "sft")}
    mixed, _ = R.dpo(logps, ref, mask, loss_type=["sigmoid", "hinge"], loss_weights=[0.3, 2.0], rpo_alpha=0.7)
    torch.testing.assert_close(mixed, 0.3 * one["sigmoid"] + 2.0 * one["hinge"] + 0.7 * one["sft"])
    torch.testing.assert_close(R.dpo(logps, ref, mask, loss_type=["sigmoid"])[0], one["sigmoid"])


def test_existing_defaults_unchanged():
    logps, ref, mask = _data(4, 5, seed=21)
    A = torch.randn(4, dtype=torch.float64)
    loss, m = R.grpo(logps, ref, A, mask)
    assert set(m) == {"unclipped_frac", "kl", "clip_frac_low", "clip_frac_high"}
    assert set(R.dpo(logps, ref, mask)[1]) == {"unclipped_frac", "rewards_chosen", "rewards_rejected",
                                                "reward_margin", "reward_accuracy"}
    assert set(R.kto(logps, ref, mask, torch.tensor([True, False, True, False]))[1]) == {
        "unclipped_frac", "kl", "rewards_desirable", "rewards_undesirable"}
    # the explicit TRL-named defaults reproduce the defaults
    loss2, _ = R.grpo(logps, ref, A, mask, importance_sampling_level="token", use_bias_correction_kl=False)
    torch.testing.assert_close(loss, loss2)


# ---------------------------------------------------------------------------------------------------------------
# helpers: adaptive entropy coefficient, vLLM importance-sampling weight


def test_adaptive_entropy_coef_steps_and_bounds():
    f = R.adaptive_entropy_coef
    assert f(0.1, 0.1, entropy_target=0.2) == pytest.approx(0.105)
    assert f(0.1, 0.2, entropy_target=0.2) == pytest.approx(0.105)  # at the target: up
    assert f(0.1, 0.3, entropy_target=0.2) == pytest.approx(0.095)
    assert f(0.999, 0.0, entropy_coef_max=1.0) == 1.0
    assert f(0.001, 9.0, entropy_coef_min=0.0) == 0.0


def test_vllm_importance_sampling_ratio_modes_by_hand():
    old = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    sampling = torch.tensor([[-0.5, 0.3, float("nan")], [0.1, -2.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    f = R.vllm_importance_sampling_ratio
    e = math.exp
    tok = f(old, sampling, mask, vllm_importance_sampling_mode="token_truncate",
            vllm_importance_sampling_clip_max=3.0)
    torch.testing.assert_close(tok, torch.tensor([[e(0.5), e(-0.3), 1.0], [e(-0.1), 3.0, 1.0]],
                                                 dtype=torch.float64))
    tok = f(old, sampling, mask, vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=0.8,
            vllm_importance_sampling_clip_max=3.0)
    torch.testing.assert_close(tok, torch.tensor([[e(0.5), 0.0, 1.0], [e(-0.1), 0.0, 1.0]], dtype=torch.float64))
    seq = f(old, sampling, mask, vllm_importance_sampling_mode="sequence_truncate",
            vllm_importance_sampling_clip_max=3.0)
    torch.testing.assert_close(seq, torch.tensor([[e(0.2)], [3.0]], dtype=torch.float64))
    seq = f(old, sampling, mask, vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_max=3.0)
    torch.testing.assert_close(seq, torch.tensor([[e(0.2)], [0.0]], dtype=torch.float64))


# ---------------------------------------------------------------------------------------------------------------
# refusals: a ValueError that names the argument (and says why)


def _bad_cases():
    logps, ref, mask = _data(4, 5, seed=22)
    A = torch.ones(4, dtype=torch.float64)
    ent = torch.rand(4, 5, dtype=torch.float64)
    des = torch.tensor([True, False, True, False])
    clip = hk.HumanlineClip()
    return [
        ("aot", lambda: R.dpo(logps, ref, mask, loss_type="aot", clip=clip)),
        ("loss_type", lambda: R.dpo(logps, ref, mask, loss_type="kto")),
        ("loss_type", lambda: R.dpo(logps, ref, mask, loss_type=[])),
        ("loss_weights", lambda: R.dpo(logps, ref, mask, loss_type=["sigmoid", "hinge"], loss_weights=[1.0])),
        ("loss_weights", lambda: R.dpo(logps, ref, mask, loss_weights=[float("nan")])),
        ("rpo_alpha", lambda: R.dpo(logps, ref, mask, rpo_alpha=-1.0)),
        ("f_divergence_type", lambda: R.dpo(logps, ref, mask, f_divergence_type="kl")),
        ("f_divergence_type", lambda: R.dpo(logps, ref, mask, loss_type="bco_pair", f_divergence_type="forward_kl")),
        ("f_alpha_divergence_coef", lambda: R.dpo(logps, ref, mask, f_alpha_divergence_coef="x")),
        ("ld_alpha", lambda: R.dpo(logps, ref, mask, ld_alpha=1.5)),
        ("discopop_tau", lambda: R.dpo(logps, ref, mask, discopop_tau=0.0)),
        ("label_smoothing", lambda: R.dpo(logps, ref, mask, loss_type="exo_pair")),
        ("label_smoothing", lambda: R.dpo(logps, ref, mask, loss_type="robust", label_smoothing=0.5)),
        ("beta", lambda: R.dpo(logps, ref, mask, loss_type="ipo", beta=0.0)),
        ("beta", lambda: R.ipo(logps, ref, mask, beta=0.0)),
        ("log_sum_sq_probs", lambda: R.dpo(logps, ref, mask, use_weighting=True)),
        ("log_sum_sq_probs", lambda: R.dpo(logps, ref, mask, log_sum_sq_probs=ent)),
        ("log_sum_sq_probs", lambda: R.dpo(logps, ref, mask, use_weighting=True, log_sum_sq_probs=ent[:, :2])),
        ("use_weighting", lambda: R.dpo(logps, ref, mask, use_weighting=1)),
        ("use_weighting", lambda: R.dpo(logps, ref, mask, loss_type="aot_unpaired", use_weighting=True,
                                        log_sum_sq_probs=ent)),
        ("normalize", lambda: R.sequence_logratios(logps, ref, mask, normalize=1)),
        ("ref_logps", lambda: R.sequence_logratios(logps, ref[:, :2], mask)),
        ("mask", lambda: R.simpo(logps, mask.long())),
        ("gamma_beta_ratio", lambda: R.simpo(logps, mask, gamma_beta_ratio=None)),
        ("lambda_coef", lambda: R.slic(logps, mask, lambda_coef=float("inf"))),
        ("rows", lambda: R.slic(logps[:3], mask[:3])),
        ("loss_type", lambda: R.kto(logps, ref, mask, des, loss_type="bco")),
        ("kl_estimate", lambda: R.kto(logps, ref, mask, des, kl_estimate="mean")),
        ("apo_zero_unpaired", lambda: R.kto(logps, ref, mask, des, logps, ref, mask, loss_type="apo_zero_unpaired")),
        ("advantages", lambda: R.grpo(logps, ref, torch.ones(4, 4, dtype=torch.float64), mask)),
        ("loss_type", lambda: R.grpo(logps, ref, A, mask, loss_type="ppo")),
        ("normalizer", lambda: R.grpo(logps, ref, A, mask, loss_type="grpo", normalizer=3.0)),
        ("importance_sampling_level", lambda: R.grpo(logps, ref, A, mask, importance_sampling_level="seq")),
        ("delta", lambda: R.grpo(logps, ref, A, mask, loss_type="cispo", delta=2.0)),
        ("delta", lambda: R.grpo(logps, ref, A, mask, delta=0.0)),
        ("sapo_temperature_neg", lambda: R.grpo(logps, ref, A, mask, sapo_temperature_neg=0.0)),
        ("vespo_lambda_pos", lambda: R.grpo(logps, ref, A, mask, vespo_lambda_pos=-1.0)),
        ("importance_sampling_ratio", lambda: R.grpo(logps, ref, A, mask, importance_sampling_ratio=ent[:, :2])),
        ("importance_sampling_ratio", lambda: R.grpo(logps, ref, A, mask, loss_type="vespo",
                                                     importance_sampling_ratio=A)),
        ("tool_mask", lambda: R.grpo(logps, ref, A, mask, tool_mask=ent)),
        ("sampling_per_token_logps", lambda: R.grpo(logps, ref, A, mask, sampling_per_token_logps=ref)),
        ("sampling_per_token_logps", lambda: R.grpo(logps, ref, A, mask, off_policy_mask_threshold=0.1)),
        ("off_policy_mask_threshold", lambda: R.grpo(logps, ref, A, mask, clip=None,
                                                     off_policy_mask_threshold="x")),
        ("top_entropy_quantile", lambda: R.grpo(logps, ref, A, mask, top_entropy_quantile=1.5, entropies=ent)),
        ("entropies", lambda: R.grpo(logps, ref, A, mask, top_entropy_quantile=0.5)),
        ("entropies", lambda: R.grpo(logps, ref, A, mask, entropy_coef=0.1)),
        ("entropies", lambda: R.grpo(logps, ref, A, mask, entropy_coef=0.1, entropies=ent.float())),
        ("use_adaptive_entropy", lambda: R.grpo(logps, ref, A, mask, use_adaptive_entropy="yes", entropies=ent)),
        ("last_world_entropy", lambda: R.grpo(logps, ref, A, mask, last_world_entropy=float("nan"))),
        ("use_bias_correction_kl", lambda: R.grpo(logps, ref, A, mask, use_bias_correction_kl=None)),
        ("world_entropy", lambda: R.adaptive_entropy_coef(0.1, None)),
        ("vllm_importance_sampling_mode", lambda: R.vllm_importance_sampling_ratio(
            logps, ref, mask, vllm_importance_sampling_mode="token")),
        ("vllm_importance_sampling_clip_min", lambda: R.vllm_importance_sampling_ratio(
            logps, ref, mask, vllm_importance_sampling_clip_min=4.0)),
        ("vllm_importance_sampling_clip_min", lambda: R.vllm_importance_sampling_ratio(
            logps, ref, mask, vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=None)),
        ("sampling_logps", lambda: R.vllm_importance_sampling_ratio(logps, ref.float(), mask)),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_inputs_raise_value_error_naming_the_argument(case):
    name, fn = _bad_cases()[case]
    with pytest.raises(ValueError, match=name):
        fn()


# ---------------------------------------------------------------------------------------------------------------
# KTO's two KL estimates across ranks (gloo, world size 2, spawned processes)


def _kl_estimate_worker(rank, world, out):
    # rank 0: KL row sums 0.6 and 0 (an empty row); rank 1: 0.9
    kl = torch.tensor([[0.4, 0.2], [0.0, 0.0]] if rank == 0 else [[0.5, 0.4]], dtype=torch.float64)
    args = (torch.zeros(1, 2, dtype=torch.float64), torch.zeros(1, 2, dtype=torch.float64),
            torch.ones(1, 2, dtype=torch.bool), torch.tensor([True]), kl, torch.zeros_like(kl),
            torch.ones_like(kl, dtype=torch.bool))
    out[rank] = [R.kto(*args, clip=None, kl_estimate=e)[1]["kl"].item() for e in ("halos", "trl")]


def test_kto_kl_estimates_across_ranks():
    import torch.multiprocessing as mp

    from tools.distributed import run

    with mp.Manager() as manager:
        out = manager.dict()
        run(_kl_estimate_worker, out)
        out = dict(out)
    for rank in (0, 1):
        halos, trl = out[rank]
        assert halos == pytest.approx((0.6 + 0.9) / 2)  # all-reduced sum over the non-empty rows' count
        assert trl == pytest.approx((0.3 + 0.9) / 2)  # TRL: the mean of the ranks' means, empty rows included
