"""Hand-computed cases, float64 gradchecks and edge cases for hk.reference and hk.losses (the log-prob level)."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import humanline_kernels as hk

LEVELS = [hk.reference, hk.losses]
LEVEL_IDS = ["reference", "losses"]
CLIPS = [hk.HumanlineClip(), None, hk.HumanlineClip(-1.0, 0.5)]
CLIP_IDS = ["clip", "noclip", "clip_asym"]


def _rand(B, T, *, seed=0, dtype=torch.float64, scale=1.0, masked_rows=()):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    ref = logps + torch.randn(B, T, generator=g, dtype=dtype) * scale
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[:, 0] = True
    for r in masked_rows:
        mask[r] = False
    return logps, ref, mask


# ---------------------------------------------------------------------------------------------------------------
# hand-computed cases


@pytest.mark.parametrize("level", LEVELS, ids=LEVEL_IDS)
def test_dpo_two_token_pair_clamped_token_has_zero_grad(level):
    # chosen deltas [0.5, 2.0] -> clamped [0.5, 1.5]; rejected deltas [-0.2, 0.1]
    ref = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]], dtype=torch.float64)
    logps = (ref + torch.tensor([[0.5, 2.0], [-0.2, 0.1]], dtype=torch.float64)).requires_grad_()
    mask = torch.ones(2, 2, dtype=torch.bool)
    beta = 0.1
    loss, m = level.dpo(logps, ref, mask, beta=beta)
    h = beta * ((0.5 + 1.5) - (-0.2 + 0.1))
    assert loss.item() == pytest.approx(math.log1p(math.exp(-h)), abs=1e-12)
    loss.backward()
    sig = 1 / (1 + math.exp(h))  # sigma(-h)
    expected = torch.tensor([[-beta * sig, 0.0], [beta * sig, beta * sig]], dtype=torch.float64)
    torch.testing.assert_close(logps.grad, expected, rtol=0, atol=1e-12)
    assert logps.grad[0, 1].item() == 0.0  # exactly zero outside the band
    assert m["unclipped_frac"].item() == pytest.approx(0.75)
    assert m["rewards_chosen"].item() == pytest.approx(beta * 2.0)
    assert m["rewards_rejected"].item() == pytest.approx(beta * -0.1)
    assert m["reward_margin"].item() == pytest.approx(beta * 2.1)
    assert m["reward_accuracy"].item() == 1.0


@pytest.mark.parametrize("level", LEVELS, ids=LEVEL_IDS)
def test_clamp_boundary_passes_gradient_but_is_not_unclipped(level):
    # delta exactly at log_eps_r: torch.clamp passes the gradient; unclipped_frac is strict, so it is not counted
    clip = hk.HumanlineClip(-1.0, 0.5)
    ref = torch.zeros(2, 1, dtype=torch.float64)
    logps = torch.tensor([[0.5], [0.0]], dtype=torch.float64, requires_grad=True)
    loss, m = level.dpo(logps, ref, torch.ones(2, 1, dtype=torch.bool), clip=clip, beta=1.0)
    loss.backward()
    assert logps.grad[0, 0].item() != 0.0
    assert m["unclipped_frac"].item() == pytest.approx(0.5)


@pytest.mark.parametrize("level", LEVELS, ids=LEVEL_IDS)
def test_kto_all_zero_kl_rows_give_zero_baseline(level):
    beta = 0.5
    ref = torch.tensor([[-1.0, -1.0], [-2.0, -0.5]], dtype=torch.float64)
    logps = (ref + torch.tensor([[0.3, 0.2], [-0.4, 0.0]], dtype=torch.float64)).requires_grad_()
    mask = torch.tensor([[True, True], [True, False]])
    desirable = torch.tensor([True, False])
    kl = torch.full((3, 2), -1.2, dtype=torch.float64)
    loss, m = level.kto(logps, ref, mask, desirable, kl, kl.clone(), torch.ones(3, 2, dtype=torch.bool), beta=beta,
                        desirable_weight=2.0, undesirable_weight=0.5)
    assert m["kl"].item() == 0.0
    s0, s1 = 0.5, -0.4
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected = (2.0 * (1 - sig(beta * s0)) + 0.5 * (1 - sig(-beta * s1))) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert m["rewards_desirable"].item() == pytest.approx(beta * s0)
    assert m["rewards_undesirable"].item() == pytest.approx(beta * s1)
    loss.backward()
    assert logps.grad[1, 1].item() == 0.0  # masked token


@pytest.mark.parametrize("level", LEVELS, ids=LEVEL_IDS)
def test_kto_baseline_is_mean_over_nonzero_kl_rows_clamped_at_zero(level):
    logps, ref, mask = _rand(2, 3)
    desirable = torch.tensor([True, False])
    kl_ref = torch.zeros(3, 2, dtype=torch.float64)
    kl = torch.tensor([[0.4, 0.2], [0.0, 0.0], [0.3, 0.0]], dtype=torch.float64)  # row sums 0.6, 0, 0.3
    _, m = level.kto(logps, ref, mask, desirable, kl, kl_ref, torch.ones(3, 2, dtype=torch.bool))
    assert m["kl"].item() == pytest.approx(0.45)
    _, m = level.kto(logps, ref, mask, desirable, -kl, kl_ref, torch.ones(3, 2, dtype=torch.bool))
    assert m["kl"].item() == 0.0  # negative estimate clamps to 0
    # the KL rows are clipped too: a row sum of 5 counts as 1.5 under the default clip
    kl5 = torch.tensor([[5.0, 0.0]], dtype=torch.float64)
    _, m = level.kto(logps, ref, mask, desirable, kl5, torch.zeros_like(kl5), torch.ones(1, 2, dtype=torch.bool))
    assert m["kl"].item() == pytest.approx(1.5)


@pytest.mark.parametrize("level", LEVELS, ids=LEVEL_IDS)
def test_grpo_epsilon_clip_active_on_both_sides(level):
    eps = 0.2
    ref = torch.zeros(2, 3, dtype=torch.float64)
    # row 0, A=+1: ratios e^0.5 (> 1.2, high clip active), e^0.1 (inside), e^-0.5 (< 0.8, unclipped branch)
    # row 1, A=-1: ratios e^-0.5 (< 0.8, low clip active), e^0.1 (inside), e^0.5 (> 1.2, unclipped branch)
    d = torch.tensor([[0.5, 0.1, -0.5], [-0.5, 0.1, 0.5]], dtype=torch.float64)
    logps = (ref + d).requires_grad_()
    A = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    loss, m = level.grpo(logps, ref, A, mask, epsilon_low=eps, epsilon_high=eps, loss_type="dapo")
    e = math.exp
    terms = [-(1.2), -e(0.1), -e(-0.5), 0.8, e(0.1), e(0.5)]
    assert loss.item() == pytest.approx(sum(terms) / 6, abs=1e-12)
    loss.backward()
    expected = torch.tensor([[0.0, -e(0.1), -e(-0.5)], [0.0, e(0.1), e(0.5)]], dtype=torch.float64) / 6
    torch.testing.assert_close(logps.grad, expected, rtol=0, atol=1e-12)
    assert m["clip_frac_high"].item() == pytest.approx(1 / 6)
    assert m["clip_frac_low"].item() == pytest.approx(1 / 6)
    assert m["unclipped_frac"].item() == 1.0  # all |delta| < 1.5


@pytest.mark.parametrize("level", LEVELS, ids=LEVEL_IDS)
def test_grpo_kl_term_uses_unclipped_log_ratio(level):
    ref = torch.zeros(1, 1, dtype=torch.float64)
    logps = torch.tensor([[2.0]], dtype=torch.float64, requires_grad=True)  # delta 2.0 is clipped to 1.5
    A = torch.zeros(1, dtype=torch.float64)
    beta = 0.3
    loss, m = level.grpo(logps, ref, A, torch.ones(1, 1, dtype=torch.bool), beta=beta)
    x = -2.0
    k3 = math.exp(x) - x - 1
    assert loss.item() == pytest.approx(beta * k3, abs=1e-12)
    assert m["kl"].item() == pytest.approx(k3)
    loss.backward()
    assert logps.grad.item() == pytest.approx(beta * (1 - math.exp(x)), abs=1e-12)
    # a separate kl reference is used as given
    kl_ref = torch.full((1, 1), -1.0, dtype=torch.float64)
    loss2, _ = level.grpo(logps, ref, A, torch.ones(1, 1, dtype=torch.bool), beta=beta, kl_ref_logps=kl_ref)
    x = -3.0
    assert loss2.item() == pytest.approx(beta * (math.exp(x) - x - 1), abs=1e-12)


@pytest.mark.parametrize("level", LEVELS, ids=LEVEL_IDS)
def test_grpo_four_aggregations_by_hand(level):
    ref = torch.zeros(2, 3, dtype=torch.float64)
    logps = torch.zeros(2, 3, dtype=torch.float64)  # ratio 1: per-token term = -A
    A = torch.tensor([2.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    # tokens: row0 two tokens of -2, row1 one token of +1
    got = {lt: level.grpo(logps, ref, A, mask, loss_type=lt)[0].item() for lt in ("dapo", "bnpo", "grpo", "dr_grpo")}
    assert got["dapo"] == pytest.approx(-3 / 3)
    assert got["bnpo"] == pytest.approx(-3 / 3)
    assert got["grpo"] == pytest.approx((-2 + 1) / 2)
    assert got["dr_grpo"] == pytest.approx(-3 / (2 * 3))
    assert level.grpo(logps, ref, A, mask, loss_type="dr_grpo", max_completion_length=10)[0].item() == \
        pytest.approx(-3 / 20)
    assert level.grpo(logps, ref, A, mask, loss_type="dapo", normalizer=6.0)[0].item() == pytest.approx(-0.5)
    assert level.grpo(logps, ref, A, mask, normalizer=torch.tensor(6.0, dtype=torch.float64))[0].item() == \
        pytest.approx(-0.5)
    loss = level.grpo(logps, ref, A, mask, normalizer=torch.tensor([6.0], dtype=torch.float64))[0]
    assert loss.dim() == 0 and loss.item() == pytest.approx(-0.5)  # a 1-element normalizer still gives a 0-d loss


# ---------------------------------------------------------------------------------------------------------------
# fully masked rows, float64 gradcheck, reference == losses


@pytest.mark.parametrize("level", LEVELS, ids=LEVEL_IDS)
@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "grpo", "dr_grpo"])
def test_grpo_fully_masked_row_no_nan_and_excluded_from_grpo_mean(level, loss_type):
    logps, ref, mask = _rand(3, 4, masked_rows=(1,))
    logps[1] = float("nan")  # whatever sits in a fully masked row must not leak
    logps.requires_grad_()
    A = torch.tensor([1.0, 5.0, -0.5], dtype=torch.float64)
    loss, m = level.grpo(logps, ref, A, mask, beta=0.1, loss_type=loss_type)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in m.values())
    assert torch.isfinite(logps.grad).all() and (logps.grad[1] == 0).all()
    if loss_type == "grpo":
        keep = [0, 2]
        l2, _ = level.grpo(logps.detach()[keep], ref[keep], A[keep], mask[keep], beta=0.1, loss_type="grpo")
        assert loss.item() == pytest.approx(l2.item(), abs=1e-12)


@pytest.mark.parametrize("level", LEVELS, ids=LEVEL_IDS)
def test_all_tokens_masked_no_nan(level):
    logps, ref, _ = _rand(2, 3)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    A = torch.ones(2, dtype=torch.float64)
    outs = [level.grpo(logps, ref, A, mask, loss_type=lt) for lt in ("dapo", "grpo", "dr_grpo")]
    outs.append(level.dpo(logps, ref, mask))
    outs.append(level.kto(logps, ref, mask, torch.tensor([True, False])))
    for loss, m in outs:
        assert torch.isfinite(loss) and all(torch.isfinite(v) for v in m.values())
        assert m["unclipped_frac"].item() == 1.0


def _grad_fns(level, clip):
    logps, ref, mask = _rand(4, 5, seed=3, scale=2.0)
    A = torch.tensor([0.7, -1.3, 0.2, -0.1], dtype=torch.float64)
    des = torch.tensor([True, False, False, True])
    kl, kl_ref, kl_mask = _rand(3, 5, seed=4)
    return logps, {
        "dpo": lambda x: level.dpo(x, ref, mask, clip=clip, beta=0.5, label_smoothing=0.1)[0],
        "kto": lambda x: level.kto(x, ref, mask, des, kl, kl_ref, kl_mask, clip=clip, beta=0.5,
                                   desirable_weight=1.5)[0],
        **{f"grpo_{lt}": (lambda x, lt=lt: level.grpo(x, ref, A, mask, clip=clip, beta=0.2, loss_type=lt,
                                                       epsilon_low=0.1, epsilon_high=0.3)[0])
           for lt in ("dapo", "grpo", "dr_grpo")},
    }


@pytest.mark.parametrize("level", LEVELS, ids=LEVEL_IDS)
@pytest.mark.parametrize("clip", CLIPS, ids=CLIP_IDS)
def test_gradcheck_float64(level, clip):
    logps, fns = _grad_fns(level, clip)
    for name, fn in fns.items():
        assert torch.autograd.gradcheck(fn, (logps.clone().requires_grad_(),), eps=1e-6, atol=1e-7), name


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 4), T=st.integers(1, 7), seed=st.integers(0, 10_000), scale=st.floats(0.0, 4.0),
       beta=st.floats(0.0, 2.0), clip_on=st.booleans(), lt=st.sampled_from(["dapo", "bnpo", "grpo", "dr_grpo"]))
def test_losses_match_reference_property(B, T, seed, scale, beta, clip_on, lt):
    logps, ref, mask = _rand(2 * B, T, seed=seed, scale=scale, dtype=torch.float32)
    clip = hk.HumanlineClip() if clip_on else None
    g = torch.Generator().manual_seed(seed + 1)
    A = torch.randn(2 * B, generator=g)
    des = torch.rand(2 * B, generator=g) > 0.5
    kl, kl_ref, kl_mask = _rand(B, T, seed=seed + 2, scale=scale, dtype=torch.float32)
    cases = [
        ("dpo", lambda lv, x: lv.dpo(x, ref, mask, clip=clip, beta=beta)),
        ("kto", lambda lv, x: lv.kto(x, ref, mask, des, kl, kl_ref, kl_mask, clip=clip, beta=beta)),
        ("grpo", lambda lv, x: lv.grpo(x, ref, A, mask, clip=clip, beta=beta, loss_type=lt)),
    ]
    for name, fn in cases:
        x1, x2 = logps.clone().requires_grad_(), logps.clone().requires_grad_()
        l1, m1 = fn(hk.reference, x1)
        l2, m2 = fn(hk.losses, x2)
        assert l1.dtype == torch.float32 and l1.dim() == 0
        torch.testing.assert_close(l2, l1, rtol=1e-6, atol=1e-6, msg=name)
        assert set(m1) == set(m2)
        for k in m1:
            assert not m2[k].requires_grad and m2[k].dim() == 0
            torch.testing.assert_close(m2[k], m1[k], rtol=1e-6, atol=1e-6, msg=f"{name}:{k}")
        l1.backward()
        l2.backward()
        torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_dpo_label_smoothing_matches_formula():
    logps, ref, mask = _rand(4, 3, seed=7)
    loss, _ = hk.losses.dpo(logps, ref, mask, clip=None, beta=0.3, label_smoothing=0.2)
    s = torch.where(mask, logps - ref, 0.0).sum(1)
    h = 0.3 * (s[:2] - s[2:])
    expected = (-(0.8) * F.logsigmoid(h) - 0.2 * F.logsigmoid(-h)).mean()
    torch.testing.assert_close(loss, expected)


# ---------------------------------------------------------------------------------------------------------------
# token_logprobs: eager chunked path == reference, no full fp32 copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_eager_matches_reference(monkeypatch, dtype, temperature):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the eager CPU fallback
    torch.manual_seed(0)
    full = torch.randn(3, 6, 37, dtype=dtype) * 3
    logits = full[:, :-1]  # a strided view, used as is
    labels = torch.randint(0, 37, (3, 5))
    labels[0, 2] = -100
    labels[2] = -100
    x1 = logits.detach().clone().requires_grad_()
    x2 = logits.detach().clone().requires_grad_()
    ref, ref_ent = hk.reference.token_logprobs(x1, labels, temperature=temperature, return_entropy=True)
    got, ent = hk.token_logprobs(x2, labels, temperature=temperature, return_entropy=True)
    assert got.dtype == torch.float32 and got.shape == labels.shape
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)
    assert ent.requires_grad  # differentiable, as the reference's (an entropy bonus trains through it)
    assert (got[labels == -100] == 0).all()
    g, gh = torch.randn(3, 5), torch.randn(3, 5)
    (ref * g + ref_ent * gh).sum().backward()
    (got * g + ent * gh).sum().backward()
    torch.testing.assert_close(x2.grad.float(), x1.grad.float(), rtol=1e-2,
                               atol=1e-2 if dtype != torch.float32 else 1e-6)


def test_eager_chunks_never_hold_whole_fp32_logits():
    from humanline_kernels import _eager as eager

    B, T, V = 2, 50, 64
    logits = torch.randn(B, T, V)
    labels = torch.randint(0, V, (B, T))
    budget = 10 * 4 * V  # 10 rows of fp32
    blocks = list(eager._chunks(B, T, V, budget))
    assert max((b1 - b0) * (t1 - t0) for b0, b1, t0, t1 in blocks) <= 10
    assert sum((b1 - b0) * (t1 - t0) for b0, b1, t0, t1 in blocks) == B * T
    lp, lse, _ = eager.logprobs_fwd(logits, labels, 1.0, -100, False, chunk_bytes=budget)
    torch.testing.assert_close(lp, hk.reference.token_logprobs(logits, labels))
    d = eager.logprobs_bwd(logits, labels, lse, torch.ones(B, T), 1.0, -100, chunk_bytes=budget)
    x = logits.clone().requires_grad_()
    hk.reference.token_logprobs(x, labels).sum().backward()
    torch.testing.assert_close(d, x.grad)
