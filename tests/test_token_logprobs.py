"""hk.token_logprobs and the ops.logprobs_{fwd,bwd} kernels against hk.reference (CPU: Triton interpreter)."""
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import humanline_kernels as hk
from humanline_kernels import _eager, ops
from humanline_kernels.ops import logprobs as LPK

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-3, 1e-2), torch.float16: (2e-3, 1e-2)}


def _data(B, T, V, dtype, seed=0, ignore_frac=0.2):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, T + 1, V, generator=g) * 3).to(dtype)
    y = torch.randint(0, V, (B, T), generator=g)
    y[torch.rand(B, T, generator=g) < ignore_frac] = -100
    return x, y


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


def _entropy(x, y, temperature):
    """The entropy of softmax(x / T) per token, differentiable (0 where ignored)."""
    h = torch.special.entr(torch.softmax(x / temperature, -1)).sum(-1)
    return torch.where(y != -100, h, 0.0)


def _check(x, y, temperature=1.0, entropy=True, inplace=False):
    """Forward, entropy and gradient (through the log-probs and the entropy) of hk.token_logprobs vs the fp32
    reference."""
    atol = TOL[x.dtype][0]
    gen = torch.Generator().manual_seed(1)
    g, ge = torch.randn(y.shape, generator=gen), torch.randn(y.shape, generator=gen)
    xr = x.detach().float().requires_grad_()
    lr, er = hk.reference.token_logprobs(xr, y, temperature=temperature, return_entropy=True)
    ((lr * g).sum() + (_entropy(xr, y, temperature) * ge).sum()).backward()
    leaf = x.detach().clone().requires_grad_()
    xk = leaf * 1 if inplace else leaf  # in-place backward needs a non-leaf buffer it may overwrite
    lk, ek = hk.token_logprobs(xk, y, temperature=temperature, return_entropy=True, inplace_backward=inplace)
    assert lk.dtype == torch.float32 and lk.shape == y.shape
    torch.testing.assert_close(lk, lr.detach(), atol=atol, rtol=0)
    torch.testing.assert_close(ek, er, atol=atol * 4, rtol=0)
    assert ek.requires_grad  # an entropy bonus trains through it
    ((lk * g).sum() + (ek * ge).sum()).backward()
    assert _rel(leaf.grad, xr.grad) < 1e-2 if x.dtype != torch.float32 else _rel(leaf.grad, xr.grad) < 1e-5
    assert (leaf.grad[y == -100] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_strided_view_dtypes(dtype):
    x, y = _data(3, 5, 300, dtype)  # V not a multiple of the block, odd row count
    _check(x[:, :-1], y, temperature=0.7)


@pytest.mark.parametrize("interp", ["1", "0"], ids=["triton", "eager"])
def test_all_ignored_rows_and_2d(interp, monkeypatch):
    """Also on the eager twins (CPU without TRITON_INTERPRET): 2-D logits with an entropy gradient crashed there."""
    monkeypatch.setenv("TRITON_INTERPRET", interp)
    x, y = _data(2, 3, 77, torch.float32)
    y[1] = -100
    _check(x[:, 1:], y)
    _check(x[0, :3], y[0])  # 2-D [N, V]
    _check(x[:, 1:], torch.stack([y, y], -1).flatten(1)[:, ::2])  # strided labels view
    y[:] = -100
    _check(x[:, 1:], y)


def test_inplace_backward_bumps_version():
    x, y = _data(2, 3, 130, torch.bfloat16)
    _check(x[:, :-1], y, temperature=1.3, inplace=True)
    leaf = x.detach().float().requires_grad_()
    buf = leaf * 2.0
    v0 = buf._version
    hk.token_logprobs(buf, torch.zeros(2, 4, dtype=torch.long), inplace_backward=True).sum().backward()
    assert buf._version > v0


def test_inplace_backward_4d_view_that_reshape_copies():
    """A 4-D view whose leading dims cannot be flattened without a copy: the in-place gradient lives in that copy
    and must still be the one returned (not the untouched logits)."""
    g0 = torch.Generator().manual_seed(3)
    base = torch.randn(3, 4, 5, 50, generator=g0)
    y = torch.randint(0, 50, (2, 2, 5), generator=g0)
    y[0, 1, 2] = -100
    g = torch.randn(2, 2, 5, generator=g0)
    xr = base.clone().requires_grad_()
    (hk.reference.token_logprobs(xr.transpose(0, 1)[:2, :2], y) * g).sum().backward()
    for inplace in (False, True):
        leaf = base.clone().requires_grad_()
        view = (leaf * 1).transpose(0, 1)[:2, :2]
        with pytest.raises(RuntimeError):
            view.view(-1, 5, 50)  # really needs a copy to become [B, T, V]
        (hk.token_logprobs(view, y, inplace_backward=inplace) * g).sum().backward()
        torch.testing.assert_close(leaf.grad, xr.grad, atol=1e-6, rtol=1e-5)


def test_ops_contract_and_inplace_out():
    """LPK.logprobs_fwd/bwd (used by the fused-linear path) against the eager ops on the same view."""
    x, y = _data(2, 4, 200, torch.float32)
    v = x[:, :-1]
    lp, lse, ent = LPK.logprobs_fwd(v, y, 1.0, -100, False)
    elp, else_, _ = _eager.logprobs_fwd(v, y, 1.0, -100, False)
    assert ent is None
    torch.testing.assert_close(lp, elp, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, else_, atol=1e-5, rtol=0)
    g = torch.randn(2, 4)
    d = LPK.logprobs_bwd(v, y, lse, g, 1.0, -100)
    torch.testing.assert_close(d, _eager.logprobs_bwd(v, y, else_, g, 1.0, -100), atol=1e-6, rtol=0)
    LPK.logprobs_bwd(v, y, lse, g, 1.0, -100, out=v)
    torch.testing.assert_close(v, d, atol=0, rtol=0)


def test_eager_fallback(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not ops.use_kernels(torch.zeros(1))
    x, y = _data(2, 3, 100, torch.float32)
    _check(x[:, :-1], y, temperature=0.9)


def test_nan_and_inf_logits():
    x, y = _data(1, 4, 64, torch.float32, ignore_frac=0)
    x[0, 1, 5] = float("nan")
    x[0, 2, :] = -float("inf")
    x[0, 2, y[0, 2]] = 0.0  # a single finite logit: probability 1
    lp = hk.token_logprobs(x[:, :-1], y)
    assert torch.isnan(lp[0, 1]) and lp[0, 2] == 0 and torch.isfinite(lp[0, [0, 3]]).all()


@pytest.mark.parametrize("bad", ["label", "stride", "dtype", "shape", "temperature"])
def test_bad_inputs(bad):
    x, y = _data(1, 2, 10, torch.float32)
    x = x[:, :-1]
    kw = {}
    if bad == "label":
        y[0, 0] = 10
    elif bad == "stride":
        x = x.transpose(0, 2).contiguous().transpose(0, 2)
    elif bad == "dtype":
        y = y.int()
    elif bad == "shape":
        y = y[:, :1]
    else:
        kw["temperature"] = 0.0
    with pytest.raises(ValueError):
        hk.token_logprobs(x, y, **kw)


@settings(max_examples=8, deadline=None)
@given(B=st.integers(1, 3), T=st.integers(1, 5), V=st.integers(2, 260), temp=st.sampled_from([0.5, 1.0, 2.0]),
       seed=st.integers(0, 99))
def test_property_random_shapes(B, T, V, temp, seed):
    x, y = _data(B, T, V, torch.float32, seed=seed)
    _check(x[:, :-1], y, temperature=temp)


@pytest.mark.gpu
@pytest.mark.parametrize("V", [128256, 262144])
def test_gpu_large_vocab(V, compiled_kernels):
    x = torch.randn(2, 65, V, device="cuda", dtype=torch.bfloat16) * 3
    y = torch.randint(0, V, (2, 64), device="cuda")
    g = torch.randn(2, 64, device="cuda")
    xr = x[:, :-1].float().requires_grad_()
    (hk.reference.token_logprobs(xr, y) * g).sum().backward()
    xk = x.detach().requires_grad_()
    lk = hk.token_logprobs(xk[:, :-1], y)
    torch.testing.assert_close(lk, hk.reference.token_logprobs(xr, y).detach(), atol=2e-3, rtol=0)
    (lk * g).sum().backward()
    assert _rel(xk.grad[:, :-1], xr.grad) < 1e-2


@pytest.mark.gpu
def test_gpu_int64_offsets(compiled_kernels):
    """N * V > 2^31 elements (about 4.3 GiB of bf16 logits)."""
    V, N = 151936, 14200
    x = torch.randn(1, N, V, device="cuda", dtype=torch.bfloat16)
    y = torch.randint(0, V, (1, N), device="cuda")
    lp, lse, _ = LPK.logprobs_fwd(x, y, 1.0, -100, False)
    last = torch.log_softmax(x[0, -4:].float(), -1).gather(-1, y[0, -4:, None])[:, 0]
    torch.testing.assert_close(lp[0, -4:], last, atol=2e-3, rtol=0)
    LPK.logprobs_bwd(x, y, lse, torch.ones_like(lp), 1.0, -100, out=x)
    assert torch.isfinite(x[0, -1]).all()


def test_bench_logits_quick(tmp_path, monkeypatch):
    """``python -m bench logits --quick`` runs; in-place impls leave the shared logits alone for the others."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the CPU smoke times the eager paths
    from bench import bench_logits
    x, y, ref = bench_logits._inputs(16, 50, "cpu", torch.bfloat16)
    x0 = x.detach().clone()
    for fn, _ in bench_logits._impls(x, y, ref, quick=True).values():
        fn()
    assert torch.equal(x.detach(), x0)
    assert bench_logits.main(["--quick", "--n", "16", "--vocab", "50", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "logits_quick.json").read_text())["rows"]
    timed = {r["impl"] for r in rows if "ms" in r}
    assert {"hk.fused.grpo(grad_in_fwd)", "hk.fused.dpo", "hk.fused.kto"} <= timed, timed
