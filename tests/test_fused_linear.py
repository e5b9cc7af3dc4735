"""hk.fused_linear against hk.reference applied to eagerly computed logits ``hidden @ weight.T + bias``.

Every case runs on the eager ops path (TRITON_INTERPRET=0) and the Triton interpreter path (TRITON_INTERPRET=1),
with tiny chunk budgets so chunk boundaries fall at odd places, rows of different lengths, bias on/off,
fp32/bf16 and clipping on/off.
"""
import pytest
import torch

import humanline_kernels as hk
from humanline_kernels import ops
from humanline_kernels import reference as R
from humanline_kernels.ops import _jit
from humanline_kernels.ops import linear as LC

# Import triton and decorate the kernels now, under conftest's TRITON_INTERPRET=1: a first import while a test has
# flipped it to 0 (the eager path) would build compiled-mode helpers the interpreter then cannot call.
if ops.triton_available():
    import humanline_kernels.ops.logprobs  # noqa: F401

CLIP = hk.HumanlineClip(-0.3, 0.25)  # narrow band: some tokens inside, some clipped on either side


@pytest.fixture(params=["eager", "triton"])
def path(request, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0" if request.param == "eager" else "1")
    return request.param


def _case(B=4, T=7, D=12, V=53, dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, D, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.5).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=g) * 0.3).to(dtype).requires_grad_() if bias else None
    y = torch.randint(0, V, (B, T), generator=g)
    for i in range(B):  # rows of different lengths, one of them fully masked when B > 3
        y[i, T - (i * 3) % (T + 1):] = -100
    with torch.no_grad():
        lp = R.token_logprobs(_logits(h, w, b), y)
        ref = torch.where(y != -100, lp + 0.4 * torch.randn(B, T, generator=g), 0.0)
    return h, w, b, y, ref, g


def _logits(h, w, b):
    """Eager lm_head: fp32 accumulation, rounded once to the input dtype (what a bf16 cuBLAS GEMM does)."""
    z = h.float() @ w.float().T + (b.float() if b is not None else 0)
    return z.to(h.dtype)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def _tols(dtype):
    return (1e-5, 1e-5) if dtype == torch.float32 else (2e-3, 1e-2)  # (values, gradient relative norm)


def _compare(ours, refs, params, dtype):
    (loss, metrics), (rloss, rmetrics) = ours, refs
    vtol, gtol = _tols(dtype)
    torch.testing.assert_close(loss, rloss, atol=vtol, rtol=vtol)
    assert set(rmetrics) <= set(metrics)
    for k in rmetrics:
        torch.testing.assert_close(metrics[k], rmetrics[k], atol=vtol, rtol=vtol, msg=k)
    live = [p for p in params if p is not None]
    got = torch.autograd.grad(loss, live)
    want = torch.autograd.grad(rloss, live)
    for gg, ww, name in zip(got, want, "hWb"):
        assert gg.dtype == ww.dtype and gg.shape == ww.shape
        assert _rel(gg, ww) <= gtol, (name, _rel(gg, ww))


LOSSES = [
    ("grpo", dict(loss_type="dapo")),
    ("grpo", dict(loss_type="grpo", beta=0.05, epsilon_high=0.28)),
    ("grpo", dict(loss_type="dr_grpo", max_completion_length=9)),
    ("grpo", dict(loss_type="bnpo", normalizer=11.0, beta=0.1, kl_ref_logps="kl")),
    ("dpo", dict(beta=0.2, label_smoothing=0.1)),
    ("kto", dict(beta=0.3, desirable_weight=1.3, undesirable_weight=0.7)),
]


def _run(name, kw, h, w, b, y, ref, g, *, chunk_bytes, clip):
    B, T = y.shape
    kw = dict(kw, clip=clip)
    mask = y != -100
    dev = y.device
    if kw.get("kl_ref_logps") == "kl":
        kw["kl_ref_logps"] = ref + 0.1 * torch.randn(B, T, generator=g).to(dev)
    if name == "grpo":
        adv = torch.randn(B, generator=g).to(dev)
        args, rargs = (ref, adv), (ref, adv, mask)
    elif name == "dpo":
        args, rargs = (ref,), (ref, mask)
    else:
        des = (torch.arange(B) % 3 != 1).to(dev)
        kl_lp = torch.randn(3, T, generator=g) - 2
        kl = tuple(t.to(dev) for t in (kl_lp, kl_lp + 0.5 * torch.randn(3, T, generator=g),
                                       torch.rand(3, T, generator=g) > 0.3))
        args, rargs = (ref, des, *kl), (ref, mask, des, *kl)
    ours = getattr(hk.fused_linear, name)(h, w, y, *args, bias=b, chunk_bytes=chunk_bytes, **kw)
    lp = R.token_logprobs(_logits(h, w, b), y)
    return ours, getattr(R, name)(lp, *rargs, **kw)


@pytest.mark.parametrize("name,kw", LOSSES, ids=[f"{n}-{k.get('loss_type', '')}" for n, k in LOSSES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_losses_match_reference(path, name, kw, dtype):
    B = 4 if name != "kto" else 5
    h, w, b, y, ref, g = _case(B=B, dtype=dtype, bias=dtype == torch.float32 or name == "dpo")
    V = w.shape[0]
    # 5 tokens' worth of logits per chunk: GRPO chunks cut rows at odd places; KTO/DPO fall back to one row/pair
    budget = 5 * V * w.element_size()
    ours, refs = _run(name, kw, h, w, b, y, ref, g, chunk_bytes=budget, clip=CLIP)
    assert 0.2 < float(refs[1]["unclipped_frac"]) < 0.9  # the band is active: tokens clipped and unclipped
    _compare(ours, refs, (h, w, b), dtype)


@pytest.mark.parametrize("name,kw", [LOSSES[0], LOSSES[1], LOSSES[4], LOSSES[5]], ids=["dapo", "grpo", "dpo", "kto"])
@pytest.mark.parametrize("chunk_tokens", [1, 17, 10_000])
def test_clip_off_and_chunk_sizes(name, kw, chunk_tokens):
    h, w, b, y, ref, g = _case(B=6, T=5, bias=chunk_tokens != 17, seed=chunk_tokens)
    ours, refs = _run(name, kw, h, w, b, y, ref, g, chunk_bytes=chunk_tokens * w.shape[0] * 4, clip=None)
    _compare(ours, refs, (h, w, b), torch.float32)


@pytest.mark.parametrize("name", ["dpo", "kto"])
def test_chunks_of_several_pairs_strided_inputs_and_grad_output(path, name):
    """Chunks of 3 pairs (rows) of 7, the last one shorter (the finalize's span starts past its first tile),
    ``labels[:, 1:]`` / ``ref[:, 1:]`` views as a causal shift gives them, and ``grad_output = 2.5``."""
    B, T, D, V = 14, 5, 6, 37
    g = torch.Generator().manual_seed(3)
    h = torch.randn(B, T, D, generator=g, requires_grad=True)
    w = (torch.randn(V, D, generator=g) * 0.5).requires_grad_()
    y_full = torch.randint(0, V, (B, T + 1), generator=g)
    y_full[2, 3:] = -100
    y_full[5] = -100
    y = y_full[:, 1:]
    with torch.no_grad():
        ref_full = torch.zeros(B, T + 1)
        ref_full[:, 1:] = R.token_logprobs(_logits(h, w, None), y) + 0.4 * torch.randn(B, T, generator=g)
    ref = ref_full[:, 1:]
    assert not y.is_contiguous() and not ref.is_contiguous()
    if name == "dpo":
        rows, args, rargs, kw = 3 * 2 * T, (ref,), (ref, y != -100), dict(beta=0.3, label_smoothing=0.05)
        assert len(LC.pair_chunks(B, T, rows)) == 3
    else:
        des = torch.arange(B) % 3 != 1
        kl = (torch.randn(4, T, generator=g) - 2, torch.randn(4, T, generator=g) - 2, torch.rand(4, T) > 0.2)
        rows, args, rargs, kw = 3 * T, (ref, des, *kl), (ref, y != -100, des, *kl), dict(beta=0.4)
        assert len(LC.row_chunks(B, T, rows)) == 5
    loss, metrics = getattr(hk.fused_linear, name)(h, w, y, *args, chunk_bytes=rows * V * 4, clip=CLIP, **kw)
    rloss, rmetrics = getattr(R, name)(R.token_logprobs(_logits(h, w, None), y), *rargs, clip=CLIP, **kw)
    torch.testing.assert_close(loss, rloss, atol=1e-5, rtol=1e-5)
    for k in rmetrics:
        torch.testing.assert_close(metrics[k], rmetrics[k], atol=1e-5, rtol=1e-5, msg=k)
    got = torch.autograd.grad(loss * 2.5, (h, w))
    want = torch.autograd.grad(rloss * 2.5, (h, w))
    for a, b in zip(got, want):
        assert _rel(a, b) <= 1e-5


@pytest.mark.parametrize("shape", [(37, 13), (301,), (0, 5)], ids=["dW", "db", "empty"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("s", [1.0, -2.5])
def test_scaled_is_the_product_in_the_weights_dtype(shape, dtype, s):
    """The fused-linear ``db`` (and, before issue 54, ``dW``) times ``grad_output``: one kernel pass from the fp32
    accumulator into a new tensor of the parameter's dtype, equal to torch's product rounded once; written at
    ``s == 1`` too (the in-place twin, which scales ``dW`` now, skips that case), the accumulator left alone (a second
    backward of a retained graph reads it again)."""
    from humanline_kernels.ops import logprobs as LPK
    acc = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    before = acc.clone()
    _jit.LAUNCHES.clear()
    out = LPK.scaled(acc, torch.tensor(s), dtype)
    assert out.dtype == dtype and out.shape == acc.shape and (out.data_ptr() != acc.data_ptr() or not acc.numel())
    # Triton's interpreter rounds fp32 -> bf16 toward zero (the GPU to nearest, as torch): one bf16 ulp here
    tol = dict(atol=0, rtol=2 ** -7) if dtype == torch.bfloat16 else dict(atol=0, rtol=0)
    torch.testing.assert_close(out, (acc * s).to(dtype), **tol)
    assert torch.equal(acc, before)
    assert sum(n for (path, k), n in _jit.LAUNCHES.items() if k == "_scale_rows_kernel") == (1 if acc.numel() else 0)


@pytest.mark.parametrize("s", [1.0, -2.5])
def test_bf16_dw_scaled_in_place_by_grad_output(path, s):
    """bf16 ``dW`` (accumulated in bf16) and ``dh`` times ``grad_output`` in place: the product of the ``s = 1``
    gradients with ``s``, rounded once (the interpreter's bf16 stores round toward zero: one ulp), on both paths."""
    h, w, b, y, ref, g = _case(dtype=torch.bfloat16, bias=False)
    adv = torch.randn(4, generator=g)

    def grads(scale):
        loss, _ = hk.fused_linear.grpo(h, w, y, ref, adv, chunk_bytes=3 * 53 * 2)  # 10 chunks
        return torch.autograd.grad(loss * scale, (h, w))
    ones, scaled = grads(1.0), grads(s)
    for a, c in zip(scaled, ones):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a, (c.float() * s).bfloat16(), atol=0, rtol=2 ** -7)


def test_retained_graph_backward_twice_gives_the_same_gradients():
    h, w, b, y, ref, g = _case()
    loss, _ = hk.fused_linear.dpo(h, w, y, ref, bias=b, chunk_bytes=2 * 7 * 53 * 4)
    first = torch.autograd.grad(loss * 2.5, (h, w, b), retain_graph=True)
    second = torch.autograd.grad(loss * 2.5, (h, w, b))
    for a, c in zip(first, second):
        assert torch.equal(a, c)


def test_grad_output_scaling_and_partial_requires_grad():
    h, w, b, y, ref, g = _case()
    adv = torch.randn(4, generator=g)
    loss, _ = hk.fused_linear.grpo(h, w, y, ref, adv, bias=b, chunk_bytes=3 * 53 * 4)
    (loss * 2.5).backward()
    rl, _ = R.grpo(R.token_logprobs(_logits(h, w, b), y), ref, adv, y != -100)
    want = torch.autograd.grad(rl * 2.5, (h, w, b))
    for p, ww in zip((h, w, b), want):
        torch.testing.assert_close(p.grad, ww, atol=1e-5, rtol=1e-5)
    # only the weight trainable (frozen trunk): no dh formed, dW still right
    w2 = w.detach().requires_grad_()
    loss, _ = hk.fused_linear.dpo(h.detach(), w2, y, ref)
    loss.backward()
    rl, _ = R.dpo(R.token_logprobs(h.detach() @ w2.T, y), ref, y != -100)
    torch.testing.assert_close(w2.grad, torch.autograd.grad(rl, w2)[0], atol=1e-5, rtol=1e-5)


def test_no_grad_loss_forms_no_gradient(path, monkeypatch):
    h, w, b, y, ref, g = _case()
    calls = []
    for name in ("alloc_grads", "grads"):  # the gradient buffers and the dh / dW GEMMs
        real = getattr(LC, name)
        monkeypatch.setattr(LC, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    with torch.no_grad():
        loss, m = hk.fused_linear.kto(h, w, y, ref, torch.arange(4) % 2 == 0, bias=b)
    assert loss.grad_fn is None and calls == []
    hk.fused_linear.kto(h, w, y, ref, torch.arange(4) % 2 == 0, bias=b)
    assert "alloc_grads" in calls and "grads" in calls  # (the check itself can fail)
    rl, _ = R.kto(R.token_logprobs(_logits(h, w, b), y), ref, y != -100, torch.arange(4) % 2 == 0)
    torch.testing.assert_close(loss, rl, atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------------------------------------ token log-probs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_token_logprobs(path, dtype):
    h, w, b, y, _, g = _case(B=3, T=6, dtype=dtype)
    hh, yy = h.view(3, 2, 3, -1), y.view(3, 2, 3)  # [..., D] with two leading dims
    lp, ent = hk.fused_linear.token_logprobs(hh, w, yy, bias=b, temperature=0.7, return_entropy=True,
                                             chunk_bytes=4 * 53 * w.element_size())
    rlp, rent = R.token_logprobs(_logits(hh, w, b), yy, temperature=0.7, return_entropy=True)
    vtol, gtol = _tols(dtype)
    assert lp.dtype == torch.float32 and lp.shape == yy.shape and ent.requires_grad
    torch.testing.assert_close(lp, rlp, atol=vtol, rtol=vtol)
    torch.testing.assert_close(ent, rent, atol=vtol, rtol=vtol)
    assert bool((lp[yy == -100] == 0).all())
    go, ge = torch.randn(yy.shape, generator=g), torch.randn(yy.shape, generator=g)
    got = torch.autograd.grad((lp * go).sum() + (ent * ge).sum(), (h, w, b))
    z = _logits(hh, w, b).float() / 0.7  # the entropy through autograd, as an entropy bonus would train
    rent_grad = torch.where(yy != -100, torch.special.entr(torch.softmax(z, -1)).sum(-1), 0.0)
    want = torch.autograd.grad((rlp * go).sum() + (rent_grad * ge).sum(), (h, w, b))
    for a, c in zip(got, want):
        assert _rel(a, c) <= gtol


def test_token_logprobs_nograd_saves_nothing():
    h, w, b, y, _, _ = _case()
    lp = hk.fused_linear.token_logprobs_nograd(h, w, y, bias=b)
    assert lp.grad_fn is None and not lp.requires_grad
    with torch.no_grad():
        lp2 = hk.fused_linear.token_logprobs(h, w, y, bias=b)
    assert lp2.grad_fn is None
    torch.testing.assert_close(lp, R.token_logprobs(_logits(h, w, b), y).detach(), atol=1e-5, rtol=1e-5)


def test_autocast_runs_the_gemm_in_the_autocast_dtype():
    h, w, b, y, ref, g = _case()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = hk.fused_linear.dpo(h, w, y, ref, bias=b)
        lp = hk.fused_linear.token_logprobs(h, w, y, bias=b)
    gh, gw = torch.autograd.grad(loss, (h, w))
    assert gh.dtype == gw.dtype == torch.float32  # autograd casts back to the parameters' dtype
    hb, wb, bb = (t.detach().bfloat16().requires_grad_() for t in (h, w, b))
    rl, _ = R.dpo(R.token_logprobs(_logits(hb, wb, bb), y), ref, y != -100)
    torch.testing.assert_close(loss, rl, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lp, R.token_logprobs(_logits(hb, wb, bb), y).detach(), atol=2e-3, rtol=2e-3)
    assert _rel(gw, torch.autograd.grad(rl, wb)[0].float()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("name,kw", [LOSSES[0], LOSSES[1], LOSSES[4], LOSSES[5]], ids=["dapo", "grpo", "dpo", "kto"])
def test_cuda_bf16_matches_reference(name, kw, compiled_kernels):
    h, w, b, y, ref, g = _case(B=6, T=33, D=64, V=1000, dtype=torch.bfloat16, seed=3)
    h, w, b = (t.detach().cuda().requires_grad_() for t in (h, w, b))
    ours, refs = _run(name, kw, h, w, b, y.cuda(), ref.cuda(), g, chunk_bytes=50 * 1000 * 2, clip=CLIP)
    _compare(ours, refs, (h, w, b), torch.bfloat16)


def test_fully_masked_batch_and_nan_inputs():
    h, w, b, y, ref, g = _case()
    y = torch.full_like(y, -100)  # TRL#7077: a fully masked micro-batch must not crash or give NaN
    for name, args in (("grpo", (ref, torch.randn(4, generator=g))), ("dpo", (ref,)),
                       ("kto", (ref, torch.arange(4) % 2 == 0))):
        loss, m = getattr(hk.fused_linear, name)(h, w, y, *args, bias=b, chunk_bytes=64)
        grads = torch.autograd.grad(loss, (h, w, b))
        assert torch.isfinite(loss) and all(bool((t == 0).all()) for t in grads), name
        assert all(bool(torch.isfinite(v)) for v in m.values()), name
    h2, w2, b2, y2, ref2, _ = _case()
    with torch.no_grad():
        h2[0, 0, 0] = float("nan")
    assert torch.isnan(hk.fused_linear.dpo(h2, w2, y2, ref2)[0])


@pytest.mark.parametrize("chunk_bytes", [4, 1 << 20], ids=["tiny-budget", "one-chunk"])
def test_rows_without_tokens(path, chunk_bytes):
    """T = 0: the losses of no tokens (DPO log 2, KTO 0.5, GRPO 0) and zero gradients, whatever the budget."""
    h = torch.randn(4, 0, 3, requires_grad=True)
    w = torch.randn(7, 3, requires_grad=True)
    y, ref = torch.zeros(4, 0, dtype=torch.long), torch.zeros(4, 0)
    des = torch.tensor([True, False, True, False])
    for name, args, rargs in (("dpo", (ref,), (ref, y != -100)), ("kto", (ref, des), (ref, y != -100, des)),
                              ("grpo", (ref, torch.ones(4)), (ref, torch.ones(4), y != -100))):
        loss, _ = getattr(hk.fused_linear, name)(h, w, y, *args, chunk_bytes=chunk_bytes)
        want, _ = getattr(R, name)(torch.zeros(4, 0), *rargs)
        torch.testing.assert_close(loss, want, msg=name)
        dh, dw = torch.autograd.grad(loss, (h, w))
        assert dh.shape == h.shape and not dw.any(), name
    # the log-prob levels (no chunk at all: their backward once read the last chunk's logits, unset then)
    lp = hk.fused_linear.token_logprobs(h, w, y, chunk_bytes=chunk_bytes)
    s, pol, *_ = hk.fused_linear.sequence_logratios(h, w, y, ref, chunk_bytes=chunk_bytes)
    assert lp.shape == y.shape and not s.any() and not pol.any()
    for out in (lp.sum(), s.sum() + pol.sum()):
        dh, dw = torch.autograd.grad(out, (h, w))
        assert dh.shape == h.shape and not dw.any()


@pytest.mark.skipif(not hasattr(torch.nn.functional, "linear_cross_entropy"),
                    reason="torch.nn.functional.linear_cross_entropy needs torch >= 2.13")
@pytest.mark.parametrize("chunked", [False, True], ids=["reference", "chunked"])
def test_token_logprobs_match_torch_linear_cross_entropy(chunked):
    """The native peer: ``-F.linear_cross_entropy(reduction="none")`` is the per-token log-prob (0 where
    ignored); values and gradients of ``hk.fused_linear.token_logprobs`` agree with it."""
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(5)
    h = torch.randn(3, 11, 24, generator=g, dtype=torch.float64, requires_grad=True)
    w = (torch.randn(301, 24, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    y = torch.randint(0, 301, (3, 11), generator=g)
    y[1, :4] = -100
    up = torch.randn(3, 11, generator=g, dtype=torch.float64)
    opts = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=7) if chunked else None
    theirs = -F.linear_cross_entropy(h.view(-1, 24), w, y.view(-1), reduction="none", ignore_index=-100,
                                     options=opts).view(3, 11)
    ours = hk.fused_linear.token_logprobs(h, w, y, chunk_bytes=5 * 301 * 8)
    torch.testing.assert_close(ours, theirs)
    gt = torch.autograd.grad((theirs * up).sum(), (h, w))
    go = torch.autograd.grad((ours * up).sum(), (h, w))
    for a, b in zip(go, gt):
        torch.testing.assert_close(a, b)
