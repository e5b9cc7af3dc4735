"""The clamps' gradient at their bounds, on every path: 1 on the closed band, its ends included, and 0 outside,
whatever the installed torch's ``clamp`` does there (torch 2.14 gives 0 at a scalar bound, 0.5 at a tensor one).

Each case puts log-ratios exactly on a bound and compares the gradient with the same loss where the bound is out of
the way: equal at the ends, 0 beyond them. A band ending at 0 with the policy equal to its reference (every token of
a sync step) is the case that trains nothing when an end blocks the gradient."""
import pytest
import torch

import humanline_kernels as hk

LOGP_LEVELS = [hk.reference, hk.losses]
WIDE = hk.HumanlineClip(-10.0, 10.0)


def _logp_loss(level, kind, logps, ref, mask, clip, **kw):
    B = logps.shape[0]
    if kind == "dpo":
        return level.dpo(logps, ref, mask, clip=clip, beta=1.0, **kw)[0]
    if kind == "kto":
        desirable = torch.arange(B) % 2 == 0
        return level.kto(logps, ref, mask, desirable, clip=clip, beta=1.0, **kw)[0]
    if kind == "grpo":
        adv = torch.linspace(-1.0, 1.0, B, dtype=logps.dtype) + 0.3
        return level.grpo(logps, ref, adv, mask, clip=clip, **kw)[0]
    s, _, _ = level.sequence_logratios(logps, ref, mask, clip=clip)
    return (s * torch.arange(1, B + 1, dtype=s.dtype)).sum()


def _logp_grad(level, kind, logratio, clip, **kw):
    """The gradient of ``kind``'s loss w.r.t. the policy log-probs at ``logratio`` (exact: the policy's are 0)."""
    logps = torch.zeros_like(logratio, requires_grad=True)
    _logp_loss(level, kind, logps, -logratio, torch.ones_like(logratio, dtype=torch.bool), clip, **kw).backward()
    return logps.grad


@pytest.mark.parametrize("kind", ["dpo", "kto", "grpo", "sequence"])
@pytest.mark.parametrize("level", LOGP_LEVELS, ids=["reference", "losses"])
def test_logp_level_band_ends_pass_gradient(level, kind):
    clip = hk.HumanlineClip(-1.5, 0.5)
    delta = torch.tensor([[-1.5, 0.5, 0.2], [0.5, -1.5, -0.3], [0.1, 0.5, -1.5], [-1.5, 0.0, 0.5]],
                         dtype=torch.float64)
    kw = dict(epsilon_low=1.0, epsilon_high=10.0) if kind == "grpo" else {}  # GRPO's ratio clip out of the way
    g = _logp_grad(level, kind, delta, clip, **kw)
    assert torch.equal(g, _logp_grad(level, kind, delta, WIDE, **kw))
    assert (g != 0).all()
    beyond = torch.where(delta == 0.5, 0.75, torch.where(delta == -1.5, -2.0, delta))
    assert (_logp_grad(level, kind, beyond, clip, **kw)[delta.abs() > 0.4] == 0).all()


@pytest.mark.parametrize("band", [(0.0, 1.5), (-1.5, 0.0), (0.0, 0.0)])
@pytest.mark.parametrize("kind", ["dpo", "kto", "grpo", "sequence"])
@pytest.mark.parametrize("level", LOGP_LEVELS, ids=["reference", "losses"])
def test_logp_level_policy_equal_to_reference_trains_with_a_band_ending_at_zero(level, kind, band):
    delta = torch.zeros(4, 3, dtype=torch.float64)
    g = _logp_grad(level, kind, delta, hk.HumanlineClip(*band))
    assert torch.equal(g, _logp_grad(level, kind, delta, None))
    assert (g != 0).all()


@pytest.mark.parametrize("side", ["high", "low"])
@pytest.mark.parametrize("level", LOGP_LEVELS, ids=["reference", "losses"])
def test_logp_level_grpo_ratio_clip_bound_passes_gradient(level, side):
    # epsilon 0 puts the ratio exp(0) = 1 exactly on the PPO clip's bound: the gradient is the unclipped -A rho
    delta = torch.zeros(4, 3, dtype=torch.float64)
    eps = {"epsilon_high": 0.0} if side == "high" else {"epsilon_low": 0.0}
    g = _logp_grad(level, "grpo", delta, None, **eps)
    assert torch.equal(g, _logp_grad(level, "grpo", delta, None, epsilon_low=0.5, epsilon_high=0.5))
    assert (g != 0).all()


@pytest.mark.parametrize("level", LOGP_LEVELS, ids=["reference", "losses"])
def test_logp_level_grpo_two_sided_cap_passes_gradient_at_delta(level):
    delta = torch.full((4, 3), 0.25, dtype=torch.float64)
    cap = torch.exp(torch.tensor(0.25, dtype=torch.float64)).item()  # the ratio exp(0.25) exactly on the cap
    g = _logp_grad(level, "grpo", delta, None, delta=cap, epsilon_high=1.0)
    assert torch.equal(g, _logp_grad(level, "grpo", delta, None, delta=2 * cap, epsilon_high=1.0))


def test_clamp_band_values_and_gradient():
    from humanline_kernels._clip import clamp_band

    x = torch.tensor([-2.0, -1.5, 0.0, 1.5, 2.0, float("nan")], requires_grad=True)
    y = clamp_band(x, -1.5, 1.5)
    torch.testing.assert_close(y, torch.clamp(x.detach(), -1.5, 1.5), equal_nan=True)
    y[:5].sum().backward()
    assert x.grad.tolist()[:5] == [0.0, 1.0, 1.0, 1.0, 0.0]
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    clamp_band(x, hi=1.0).sum().backward()
    assert x.grad.tolist() == [1.0, 0.0]


# ---------------------------------------------------------------------------------------- logits and hidden levels
def _fused_loss(level, kind, inputs, labels, ref, clip, **kw):
    B = labels.shape[0]
    if kind == "dpo":
        return level.dpo(*inputs, labels, ref, clip=clip, beta=1.0, **kw)[0]
    if kind == "kto":
        return level.kto(*inputs, labels, ref, torch.arange(B) % 2 == 0, clip=clip, beta=1.0, **kw)[0]
    if kind == "grpo":
        return level.grpo(*inputs, labels, ref, torch.linspace(-1.0, 1.0, B) + 0.3, clip=clip, **kw)[0]
    s, _, _ = level.sequence_logratios(*inputs, labels, ref, clip=clip)
    return (s * torch.arange(1, B + 1, dtype=s.dtype)).sum()


def _fused_case(level_name, dtype):
    g = torch.Generator().manual_seed(3)
    B, T, V, D = 4, 3, 37, 8
    labels = torch.randint(0, V, (B, T), generator=g)
    if level_name == "fused":
        return hk.fused, (torch.randn(B, T, V, generator=g, dtype=dtype),), labels
    hidden = torch.randn(B, T, D, generator=g, dtype=dtype)
    return hk.fused_linear, (hidden, torch.randn(V, D, generator=g, dtype=dtype)), labels


def _fused_grads(level, kind, inputs, labels, ref, clip, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    _fused_loss(level, kind, leaves, labels, ref, clip, **kw).backward()
    return [t.grad for t in leaves]


def _own_logps(level, inputs, labels, clip_kw):
    """The policy's log-probs as the loss itself forms them: the per-row policy sums of one-token rows."""
    B, T = labels.shape
    flat = [inputs[0].reshape(B * T, 1, -1), *inputs[1:]]
    _, sums, _ = level.sequence_logratios(*flat, labels.reshape(B * T, 1), None, **clip_kw)
    return sums.reshape(B, T).detach()


@pytest.mark.parametrize("path", ["kernel", "eager"])
@pytest.mark.parametrize("kind", ["dpo", "kto", "grpo", "sequence"])
@pytest.mark.parametrize("level_name", ["fused", "fused_linear"])
def test_fused_policy_equal_to_reference_trains_with_a_band_ending_at_zero(level_name, kind, path, monkeypatch):
    """Delta = 0 exactly (the reference is the policy's own log-probs, from the same path) on a band that ends at 0:
    the gradient is the unclipped one, at the logits / hidden level, through the Triton kernels (interpreter) and
    through the eager twins."""
    if path == "eager":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    level, inputs, labels = _fused_case(level_name, torch.float32)
    ref = _own_logps(level, inputs, labels, {})
    unclipped = _fused_grads(level, kind, inputs, labels, ref, None)
    assert all((g != 0).any() for g in unclipped)
    for band in [(0.0, 1.5), (-1.5, 0.0)]:
        grads = _fused_grads(level, kind, inputs, labels, ref, hk.HumanlineClip(*band))
        for g, u in zip(grads, unclipped):
            torch.testing.assert_close(g, u, rtol=0, atol=0)


@pytest.mark.parametrize("path", ["kernel", "eager"])
@pytest.mark.parametrize("level_name", ["fused", "fused_linear"])
def test_fused_grpo_ratio_clip_bound_passes_gradient(level_name, path, monkeypatch):
    if path == "eager":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    level, inputs, labels = _fused_case(level_name, torch.float32)
    ref = _own_logps(level, inputs, labels, {})
    interior = _fused_grads(level, "grpo", inputs, labels, ref, None, epsilon_low=0.5, epsilon_high=0.5)
    for eps in ({"epsilon_high": 0.0}, {"epsilon_low": 0.0}):
        grads = _fused_grads(level, "grpo", inputs, labels, ref, None, **eps)
        for g, u in zip(grads, interior):
            torch.testing.assert_close(g, u, rtol=0, atol=0)
