"""Every objective built on the sequence-level primitive -- the primitive itself, IPO, SimPO, SLiC, TRL 1.16's DPO loss
types and options, KTO's apo_zero_unpaired and TRL's KL estimate -- at the three input levels (per-token log-probs,
logits, hidden states + lm_head weight; Triton interpreter and eager paths) against hk.reference: loss, every
metric, gradients; clip on and off, an all-masked row, odd token counts, fp32 and bf16; and what is refused."""
import pytest
import torch

import humanline_kernels as hk

R = hk.reference
CLIP = hk.HumanlineClip(-1.5, 1.5)
B, T, V, D = 6, 7, 41, 8
TRL_TYPES = ["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot_unpaired",
             "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"]
# name -> (the function's name, keywords, whether it takes reference log-probs, whether it takes KTO's labels)
CASES = {f"dpo {t}": ("dpo", dict(loss_type=t, label_smoothing=0.1), True, False) for t in TRL_TYPES}
CASES.update({
    "dpo mixture rpo ld js": ("dpo", dict(loss_type=["sigmoid", "ipo", "hinge"], loss_weights=[1.0, 0.5, 0.25],
                                          rpo_alpha=0.3, ld_alpha=0.4, f_divergence_type="js_divergence"), True, False),
    "dpo alpha divergence": ("dpo", dict(loss_type="sigmoid_norm", f_divergence_type="alpha_divergence",
                                         f_alpha_divergence_coef=0.3), True, False),
    "ipo": ("ipo", dict(beta=0.2), True, False),
    "simpo": ("simpo", dict(beta=2.5, gamma_beta_ratio=0.3), False, False),
    "slic": ("slic", dict(beta=1.5, lambda_coef=0.2), False, False),
    "kto apo_zero_unpaired": ("kto", dict(loss_type="apo_zero_unpaired", beta=0.3), True, True),
    "kto trl kl estimate": ("kto", dict(kl_estimate="trl", beta=0.3), True, True),
})


def _data(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, D, generator=g)
    w = torch.randn(V, D, generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    y[torch.rand(B, T, generator=g) < 0.25] = -100
    y[2] = -100  # an all-ignored row (a chosen one: its pair still counts)
    logits = (h @ w.T).to(dtype)
    ref = R.token_logprobs(logits.float(), y) + 1.2 * torch.randn(B, T, generator=g)
    ref = torch.where(y != -100, ref, 0.0)
    des = torch.tensor([True, False, True, True, False, False])
    kl = (ref[:4] + 0.3 * torch.randn(4, T, generator=g), ref[:4], (y != -100)[:4])
    return h.to(dtype), w.to(dtype), logits, y, ref, des, kl


def _args(case, level, data, clip):
    """``(call, reference call, leaves)`` of one case at one level."""
    fn, kw, takes_ref, kto = CASES[case]
    h, w, logits, y, ref, des, kl = data
    kw = dict(kw, clip=clip)
    extra = (des, *([] if kw.get("loss_type") == "apo_zero_unpaired" else kl)) if kto else ()
    refs = (ref,) if takes_ref else ()
    mask = y != -100
    if level == "losses":
        lp = R.token_logprobs(logits.float(), y).requires_grad_()
        leaves = (lp,)
        call = lambda: getattr(hk.losses, fn)(lp, *refs, mask, *extra, **kw)  # noqa: E731
        logps = lambda: lp  # noqa: E731
    elif level == "fused":
        x = logits.detach().clone().requires_grad_()
        leaves = (x,)
        call = lambda: getattr(hk.fused, fn)(x, y, *refs, *extra, **kw)  # noqa: E731
        logps = lambda: R.token_logprobs(x.float(), y)  # noqa: E731
    else:
        hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        leaves = (hh, ww)
        chunk = dict(chunk_bytes=9 * V * ww.element_size())  # a few chunks of 9 tokens
        call = lambda: getattr(hk.fused_linear, fn)(hh, ww, y, *refs, *extra, **kw, **chunk)  # noqa: E731
        logps = lambda: R.token_logprobs((hh @ ww.T).float(), y)  # noqa: E731
    ref_call = lambda: getattr(R, fn)(logps(), *refs, mask, *extra, **kw)  # noqa: E731
    return call, ref_call, leaves


def _compare(call, ref_call, leaves, bf16):
    loss, met = call()
    rloss, rmet = ref_call()
    assert loss.shape == () and loss.dtype == torch.float32
    tol = 3e-3 if bf16 else 2e-5
    torch.testing.assert_close(loss, rloss.detach().float(), atol=tol, rtol=tol)
    assert set(rmet) <= set(met)
    for k in rmet:
        assert not met[k].requires_grad, k
        torch.testing.assert_close(met[k].float(), rmet[k].float(), atol=tol, rtol=tol, msg=k)
    got = torch.autograd.grad(loss, leaves, allow_unused=True)
    want = torch.autograd.grad(rloss, leaves, allow_unused=True)
    for a, b in zip(got, want):
        a = torch.zeros_like(b) if a is None else a
        err = ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-6)).item()
        assert err < (1e-2 if bf16 else 1e-4), err


@pytest.mark.parametrize("clip", [CLIP, None], ids=["clip", "noclip"])
@pytest.mark.parametrize("level", ["losses", "fused", "fused_linear"])
@pytest.mark.parametrize("case", list(CASES))
def test_objective_matches_reference(case, level, clip):
    _compare(*_args(case, level, _data(), clip), bf16=False)


@pytest.mark.parametrize("level", ["fused", "fused_linear"])
@pytest.mark.parametrize("case", ["ipo", "dpo mixture rpo ld js", "slic", "kto apo_zero_unpaired"])
def test_objective_eager_path_and_bf16(case, level, monkeypatch):
    _compare(*_args(case, level, _data(torch.bfloat16, seed=1), CLIP), bf16=True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the eager path (CPU without the interpreter)
    _compare(*_args(case, level, _data(seed=2), CLIP), bf16=False)


def test_aot_without_clip_at_every_level():
    """``aot`` sorts the policy's and the reference's sums apart: no humanline form, only the plain one."""
    data = _data(seed=3)
    CASES["dpo aot"] = ("dpo", dict(loss_type="aot"), True, False)
    try:
        for level in ("losses", "fused", "fused_linear"):
            _compare(*_args("dpo aot", level, data, None), bf16=False)
    finally:
        del CASES["dpo aot"]


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("level", ["losses", "fused", "fused_linear"])
def test_sequence_logratios_sums_and_gradients(level, normalize):
    """The primitive's outputs themselves, with any upstream gradient on both (a reference of 0 too)."""
    h, w, logits, y, ref, _, _ = _data(seed=4)
    g = torch.Generator().manual_seed(5)
    gs, gp = torch.randn(B, generator=g), torch.randn(B, generator=g)
    for r in (ref, None):
        kw = dict(clip=CLIP, normalize=normalize)
        if level == "losses":
            leaf = R.token_logprobs(logits, y).requires_grad_()
            s, pol, met = hk.losses.sequence_logratios(leaf, r, y != -100, **kw)
            lp = leaf
        elif level == "fused":
            leaf = logits.clone().requires_grad_()
            s, pol, met = hk.fused.sequence_logratios(leaf, y, r, **kw)
            lp = R.token_logprobs(leaf, y)
        else:
            leaf = h.clone().requires_grad_()
            s, pol, met = hk.fused_linear.sequence_logratios(leaf, w, y, r, chunk_bytes=5 * V * 4, **kw)
            lp = R.token_logprobs(leaf @ w.T, y)
        rs, rpol, rmet = R.sequence_logratios(lp, r, y != -100, **kw)
        torch.testing.assert_close(s, rs.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pol, rpol.detach(), atol=1e-5, rtol=1e-5)
        assert s[2] == 0 and pol[2] == 0  # the all-ignored row
        for k in rmet:
            torch.testing.assert_close(met[k], rmet[k])
        (got,) = torch.autograd.grad((s * gs).sum() + (pol * gp).sum(), leaf)
        (want,) = torch.autograd.grad((rs * gs).sum() + (rpol * gp).sum(), leaf)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_sequence_logratios_inplace_backward_and_one_sided_gradients():
    _, _, logits, y, ref, _, _ = _data(seed=6)
    for use in ("s", "policy", "both"):
        x = logits.clone().requires_grad_()
        s, pol, _ = hk.fused.sequence_logratios(x * 1, y, ref, clip=CLIP, inplace_backward=True)
        out = {"s": s.sum(), "policy": pol.sum(), "both": s.sum() - 2 * pol.sum()}[use]
        (got,) = torch.autograd.grad(out, x)
        xr = logits.clone().requires_grad_()
        rs, rpol, _ = R.sequence_logratios(R.token_logprobs(xr, y), ref, y != -100, clip=CLIP)
        (want,) = torch.autograd.grad({"s": rs.sum(), "policy": rpol.sum(), "both": rs.sum() - 2 * rpol.sum()}[use],
                                      xr)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("level", ["fused", "fused_linear"])
def test_refused_at_the_fused_levels(level):
    h, w, logits, y, ref, des, kl = _data()
    call = (lambda **kw: hk.fused.dpo(logits, y, ref, **kw)) if level == "fused" else \
        (lambda **kw: hk.fused_linear.dpo(h, w, y, ref, **kw))
    with pytest.raises(ValueError, match="log sum_v p_v"):
        call(use_weighting=True)
    with pytest.raises(ValueError, match="LD-weighted"):
        call(loss_type="aot", clip=None, ld_alpha=0.5)
    with pytest.raises(ValueError, match="no humanline form"):
        call(loss_type="aot")


def test_refused_everywhere():
    h, w, logits, y, ref, des, kl = _data()
    lp, m = R.token_logprobs(logits, y), y != -100
    with pytest.raises(ValueError, match="apo_zero_unpaired' has no KL baseline"):
        hk.fused.kto(logits, y, ref, des, *kl, loss_type="apo_zero_unpaired")
    with pytest.raises(ValueError, match="beta must be > 0"):
        hk.fused.ipo(logits, y, ref, beta=0.0)
    with pytest.raises(ValueError, match="normalize must be a bool"):
        hk.losses.sequence_logratios(lp, ref, m, normalize=1)
    with pytest.raises(ValueError, match="even, non-zero number of rows"):
        hk.fused_linear.simpo(h[:3], w, y[:3])
    with pytest.raises(ValueError, match="loss_type must be in"):
        hk.losses.dpo(lp, ref, m, loss_type="nope")
    with pytest.raises(ValueError, match="loss_weights must be a list"):
        hk.fused.dpo(logits, y, ref, loss_type=["sigmoid", "ipo"], loss_weights=[1.0])
