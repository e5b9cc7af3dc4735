"""``process_group=``: the vocabulary split over the ranks of a group (Megatron's column-parallel lm_head).

Real gloo groups on CPU (spawned processes, tools/distributed.py), world size 2 with uneven slices (V = 37 as 20 + 17)
and 4 (9 + 11 + 8 + 9). Every rank builds the same full inputs, keeps its slice of the logits (or of the lm_head
weight), and compares the sharded call's outputs, loss, metrics and gradient slice with the unsharded call on the
full vocabulary (and with ``hk.reference``), the Triton kernels (interpreted) and the eager path alike. One spawn per
test function; the cases loop inside the workers.
"""
import contextlib
import itertools
import os

import pytest
import torch
import torch.distributed as dist

import humanline_kernels as hk
from tools.distributed import run

V = 37
SPLITS = {2: (20, 17), 4: (9, 11, 8, 9)}


def _bounds(world, rank):
    ends = list(itertools.accumulate(SPLITS[world]))
    return ends[rank] - SPLITS[world][rank], ends[rank]


@contextlib.contextmanager
def _path(kernels):
    """The Triton kernels (interpreted on CPU) or the eager path for CPU tensors."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if kernels else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


def close(a, b, tol, what):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol, equal_nan=True, msg=lambda m: f"{what}: {m}")


def _labels(g, shape, ignore_index, vocab=V):
    y = torch.randint(0, vocab, shape, generator=g)
    y[torch.rand(shape, generator=g) < 0.25] = ignore_index
    if len(shape) >= 2:
        y[0] = ignore_index  # an all-ignored row
    return y


# ---------------------------------------------------------------------------------------------- token log-probs
def _logprobs_worker(rank, world, quick=False):
    group = dist.new_group(list(range(world)))  # (a group of its own, not the default one)
    s, e = _bounds(world, rank)
    n = 0
    for kernels, dtype, entropy, (shape, how) in itertools.product(
            (True, False), (torch.float32, torch.bfloat16), (False, True),
            (((2, 5), "copy"), ((7,), "copy"), ((2, 5), "view"), ((2, 5), "inplace"))):
        # every case on the eager path; on the (interpreted, slow) kernels the 3-D ones, bf16 only copied
        skip = how == "inplace" and dtype == torch.bfloat16
        skip |= kernels and (len(shape) == 1 or dtype == torch.bfloat16 and how != "copy")
        skip |= quick and (dtype != torch.float32 or kernels and (how != "copy" or entropy))
        if skip:
            continue
        temperature, ignore_index = (1.0, 0.7)[n % 2], (-100, -1)[n // 2 % 2]
        g = torch.Generator().manual_seed(n)
        n += 1
        full = (3 * torch.randn(*shape, V + 1, generator=g)).to(dtype)
        y = _labels(g, shape, ignore_index)
        gl, gh = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        full = full[..., :V] if how != "view" else full[..., :-1, :V]  # a strided view: rows of V + 1
        y, gl, gh = (t[..., :-1] if how == "view" else t for t in (y, gl, gh))
        kw = dict(temperature=temperature, ignore_index=ignore_index, return_entropy=entropy)
        what = f"{kernels=} {dtype} {temperature=} {entropy=} {ignore_index=} {shape} {how}"
        with _path(kernels):
            want_x = full.detach().clone().requires_grad_()
            want = hk.token_logprobs(want_x, y, **kw)
            local = full[..., s:e]
            local = (local.contiguous() if how != "view" else local).detach().requires_grad_()
            x = local.clone() if how == "inplace" else local
            got = hk.token_logprobs(x, y, process_group=group, inplace_backward=how == "inplace", **kw)
        want, got = (want, got) if entropy else ((want,), (got,))
        oracle = hk.reference.token_logprobs(full.float(), y, **kw)
        for a, b, c in zip(got, want, oracle if entropy else (oracle,)):
            close(a, b, 1e-5, what)
            close(a, c, 1e-4, what + " vs hk.reference")
        # the upstream gradient, the same on every rank
        ((got[0] * gl).sum() + ((got[1] * gh).sum() if entropy else 0)).backward()
        ((want[0] * gl).sum() + ((want[1] * gh).sum() if entropy else 0)).backward()
        close(local.grad.float(), want_x.grad[..., s:e].float(), 1e-5 if dtype == torch.float32 else 2e-2, what)
    assert n == (9 if quick else 22)
    if not quick:
        _layout_checks(rank, world)


def test_token_logprobs_sharded_equal_unsharded():
    run(_logprobs_worker)


def _layout_checks(rank, world):
    from test_no_host_sync import no_host_reads
    group = dist.group.WORLD
    s, e = _bounds(world, rank)
    g = torch.Generator().manual_seed(0)
    full = torch.randn(2, 4, V, generator=g)
    y = torch.randint(0, V, (2, 4), generator=g)
    local = full[..., s:e].contiguous()
    # no host read in a default (validate=True) sharded call: the checks are device-side, the layout stays there
    with pytest.MonkeyPatch.context() as mp, no_host_reads(mp):
        hk.token_logprobs(local, y, process_group=group)
    # labels that differ between ranks, token counts that differ, a label outside the whole vocabulary: ValueError
    # on every rank (the layout's all-gather carries what each rank has, so no rank is left waiting)
    bad = y.clone()
    bad[0, 0] = (bad[0, 0] + rank) % V
    with pytest.raises(ValueError, match="labels must be equal on every rank of process_group"):
        hk.token_logprobs(local, bad, process_group=group)
    with pytest.raises(ValueError, match="same number of tokens on every rank"):
        hk.token_logprobs(local[: 1 + rank], y[: 1 + rank], process_group=group)
    out = y.clone()
    out[1, 2] = V  # in no slice (a local id of rank 1 would be 37 - 20 = 17 = its V_r)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, V\) with V the whole vocabulary"):
        hk.token_logprobs(local, out, process_group=group)
    # unchecked (validate=False): NaN there, as the unsharded kernels give for a label outside [0, V)
    lp = hk.token_logprobs(local, out, process_group=group, validate=False)
    assert torch.isnan(lp[1, 2]) and torch.isfinite(lp[0]).all()
    # a bad group: TypeError naming process_group
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
        hk.token_logprobs(local, y, process_group=1)
    # a group of one rank is the unsharded call (no collective: the other rank does not take part)
    solo = [dist.new_group([r]) for r in range(world)][rank]
    torch.testing.assert_close(hk.token_logprobs(full, y, process_group=solo), hk.token_logprobs(full, y))

    # Megatron's padded vocabulary: the padded rows are real logit columns. Left as the model makes them they take
    # their share of the softmax (the unsharded call over the padded vocabulary); as -inf they take none (the
    # unsharded call over the true vocabulary, gradient 0 there).
    true_v, padded = 35, 40
    pad_s, pad_e = rank * padded // world, (rank + 1) * padded // world
    full = torch.randn(2, 4, padded, generator=g)
    y = torch.randint(0, true_v, (2, 4), generator=g)
    masked = full.clone()
    masked[..., true_v:] = -float("inf")
    for logits, want_logits in ((full, full), (masked, full[..., :true_v])):
        x = logits[..., pad_s:pad_e].contiguous().requires_grad_()
        lp, h = hk.token_logprobs(x, y, process_group=group, return_entropy=True)
        want_x = want_logits.clone().requires_grad_()
        want_lp, want_h = hk.token_logprobs(want_x, y, return_entropy=True)
        close(lp, want_lp, 1e-5, "padded vocabulary")
        close(h, want_h, 1e-5, "padded vocabulary, entropy")
        (lp.sum() + h.sum()).backward()
        (want_lp.sum() + want_h.sum()).backward()
        want_g = torch.zeros(2, 4, padded)
        want_g[..., :want_x.shape[-1]] = want_x.grad
        close(x.grad, want_g[..., pad_s:pad_e], 1e-5, "padded vocabulary, gradient")


def test_process_group_needs_torch_distributed():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        hk.token_logprobs(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), process_group=object())


# ---------------------------------------------------------------------------------------------------------- losses
B, T = 4, 6
CLIP = hk.HumanlineClip(-0.4, 0.5)  # narrow enough that some tokens leave the band


def _loss_cases(g, labels):
    """``(name, args after labels, keywords, the reference on log-probs, inputs whose gradient is compared)``."""
    mask = labels != -100
    ref = (-3.5 + 0.8 * torch.randn(B, T, generator=g)).requires_grad_()
    adv = torch.randn(B, generator=g).requires_grad_()
    adv_t = torch.randn(B, T, generator=g)
    kl_ref = -3.5 + 0.8 * torch.randn(B, T, generator=g)
    des = torch.tensor([True, False, True, False])
    kl = (-3.5 + 0.5 * torch.randn(3, T, generator=g), -3.5 + 0.5 * torch.randn(3, T, generator=g),
          torch.rand(3, T, generator=g) < 0.8)
    R = hk.reference
    return [
        ("grpo", (ref, adv), dict(clip=CLIP), lambda lp, kw: R.grpo(lp, ref, adv, mask, **kw), (ref, adv)),
        ("grpo", (ref, adv_t), dict(loss_type="grpo", beta=0.04, kl_ref_logps=kl_ref, clip=None),
         lambda lp, kw: R.grpo(lp, ref, adv_t, mask, **kw), ()),
        ("grpo", (ref, adv), dict(loss_type="dr_grpo", max_completion_length=T, temperature=0.7, clip=CLIP),
         lambda lp, kw: R.grpo(lp, ref, adv, mask, **kw), ()),
        ("grpo", (ref, adv), dict(loss_type="bnpo", epsilon_high=0.3), lambda lp, kw: R.grpo(lp, ref, adv, mask, **kw),
         (ref,)),
        ("dpo", (ref,), dict(clip=CLIP), lambda lp, kw: R.dpo(lp, ref, mask, **kw), (ref,)),
        ("dpo", (ref,), dict(label_smoothing=0.1, clip=None, temperature=0.7),
         lambda lp, kw: R.dpo(lp, ref, mask, **kw), ()),
        ("dpo", (ref,), dict(loss_type="ipo", clip=CLIP), lambda lp, kw: R.dpo(lp, ref, mask, **kw), ()),
        ("kto", (ref, des, *kl), dict(clip=CLIP), lambda lp, kw: R.kto(lp, ref, mask, des, *kl, **kw), (ref,)),
        ("kto", (ref, des), dict(loss_type="apo_zero_unpaired"), lambda lp, kw: R.kto(lp, ref, mask, des, **kw), ()),
        ("sequence_logratios", (ref,), dict(normalize=True, clip=CLIP),
         lambda lp, kw: R.sequence_logratios(lp, ref, mask, **kw), ()),
        ("ipo", (ref,), dict(clip=CLIP), lambda lp, kw: R.ipo(lp, ref, mask, **kw), ()),
        ("simpo", (), dict(clip=CLIP), lambda lp, kw: R.simpo(lp, mask, **kw), ()),
        ("slic", (), dict(temperature=0.7), lambda lp, kw: R.slic(lp, mask, **kw), ()),
    ]


def _flat(res):
    """A loss's ``(loss, metrics)`` (the sequence primitive's ``(s, policy_sums, metrics)``) as ``(tensors,
    metrics)``."""
    *outs, metrics = res
    return outs, metrics


def _backward(outs, g):
    torch.manual_seed(0)
    sum(((o * torch.randn(o.shape, generator=g)).sum() for o in outs)).backward()


def _compare(got, want, tol, what):
    (outs, met), (w_outs, w_met) = _flat(got), _flat(want)
    assert sorted(met) == sorted(w_met), what
    for a, b in zip(outs, w_outs):
        close(a.detach().to(b.dtype), b.detach(), tol, what)
    for k in met:
        close(met[k].to(w_met[k].dtype), w_met[k], tol, f"{what}: {k}")


def _packed(x, labels, args, kw, extra):
    """A case's inputs as a packed batch: the padded rows as one stream, each row's first (ignored) token dropped.
    ``(x, labels, args(), kw, extra)``; ``args()`` makes the per-token inputs anew for each call (a graph each)."""
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[:, 0] = False

    def per_token():
        return tuple(t[keep].unsqueeze(0) if isinstance(t, torch.Tensor) and t.shape == (B, T) else t for t in args)
    kw = {k: v[keep].unsqueeze(0) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    return (x[keep].unsqueeze(0), labels[keep].unsqueeze(0), per_token, kw,
            dict(extra, packed=hk.Packed(list(range(0, B * T - B + 1, T - 1)))))


def _grads(inputs):
    out = []
    for t in inputs:
        out.append(None if t.grad is None else t.grad.clone())
        t.grad = None
    return out


def _fused_worker(rank, world, quick=False):
    group = dist.group.WORLD
    s, e = _bounds(world, rank)
    n = 0
    # (path, variant, every how many-th case runs it): every case on the eager path, some on the (interpreted,
    # slow) kernels
    variants = ((False, "fp32", 1), (True, "fp32", 6)) if quick else (
        (False, "fp32", 1), (False, "bf16", 2), (False, "inplace", 2), (False, "packed", 1), (True, "fp32", 3),
        (True, "bf16", 6), (True, "inplace", 6), (True, "packed", 6))
    for kernels, variant, every in variants:
        g = torch.Generator().manual_seed(100 + n)
        dtype = torch.bfloat16 if variant == "bf16" else torch.float32
        labels = _labels(g, (B, T), -100)
        full = (3 * torch.randn(B, T, V, generator=g)).to(dtype)
        cases = _loss_cases(g, labels)
        for name, args, kw, oracle, owed in cases:
            if n % every:
                n += 1
                continue
            n += 1
            what = f"{kernels=} {variant} {name} {kw}"
            fn = getattr(hk.fused, name)
            extra = dict(inplace_backward=True) if variant == "inplace" else {}
            x, y, a = full, labels, lambda: args
            if variant == "packed":
                x, y, a, kw, extra = _packed(full, labels, args, kw, {})
                if name == "kto" and len(args) > 2:
                    continue
            gg = torch.Generator().manual_seed(n)
            _grads([t for t in args if isinstance(t, torch.Tensor) and t.requires_grad])  # (another case's)
            with _path(kernels):
                want_x = x.detach().clone().requires_grad_()
                want = fn(want_x, y, *a(), **kw, **extra)
                _backward(_flat(want)[0], gg)
                want_grads = _grads(owed)
                local = x[..., s:e].detach().clone().requires_grad_()
                xx = local.clone() if variant == "inplace" else local
                got = fn(xx, y, *a(), **kw, **extra, process_group=group)
                _backward(_flat(got)[0], torch.Generator().manual_seed(n))
                got_grads = _grads(owed)
            _compare(got, want, 2e-5 if dtype == torch.float32 else 1e-4, what)
            close(local.grad.float(), want_x.grad[..., s:e].float(), 2e-5 if dtype == torch.float32 else 2e-2, what)
            for a_, b_ in zip(got_grads, want_grads):
                close(a_, b_, 2e-5, what + " (input gradient)")
            if variant == "fp32":  # and the ground truth, on the log-probs of the whole vocabulary
                lp = hk.reference.token_logprobs(full, labels, temperature=kw.get("temperature", 1.0))
                rkw = {k: v for k, v in kw.items() if k != "temperature"}
                _compare(got, oracle(lp, rkw), 1e-4, what + " vs hk.reference")
    assert n == len(variants) * 13


def test_fused_losses_sharded_equal_unsharded():
    run(_fused_worker)


# ------------------------------------------------------------------------------------------------ the hidden level
D = 8


def _hidden_inputs(g, dtype, bias):
    h = torch.randn(B, T, D, generator=g).to(dtype)
    w = (torch.randn(V, D, generator=g) / 2).to(dtype)
    return h, w, (torch.randn(V, generator=g) / 2).to(dtype) if bias else None


def _leaves(h, w, b, s=None, e=None):
    """Leaf copies of ``hidden``, the weight (and bias) or their slice ``[s, e)`` of the vocabulary."""
    sl = slice(s, e)
    return (h.detach().clone().requires_grad_(), w[sl].detach().clone().requires_grad_(),
            None if b is None else b[sl].detach().clone().requires_grad_())


def _check_linear_grads(got, want, s, e, tol, what):
    """The weight's (bias') gradient is the slice of the unsharded one; the hidden states' is this rank's part: the
    parts all-reduced (what Megatron's column-parallel region does in its backward) are the unsharded gradient."""
    (h, w, b), (wh, ww, wb) = got, want
    close(w.grad.float(), ww.grad[s:e].float(), tol, what + " dW")
    if b is not None:
        close(b.grad.float(), wb.grad[s:e].float(), tol, what + " db")
    dh = h.grad.float()
    dist.all_reduce(dh)
    close(dh, wh.grad.float(), tol, what + " dh (all-reduced)")


def _linear_logprobs_worker(rank, world, quick=False):
    group = dist.group.WORLD
    s, e = _bounds(world, rank)
    n = 0
    for kernels, dtype, entropy, layout in itertools.product(
            (True, False), (torch.float32, torch.bfloat16), (False, True), ("dense", "supervised", "packed")):
        if kernels and (dtype == torch.bfloat16 and layout != "dense") or quick and (
                dtype != torch.float32 or layout == "supervised" or kernels and entropy):
            continue
        g = torch.Generator().manual_seed(200 + n)
        n += 1
        h, w, b = _hidden_inputs(g, dtype, bias=n % 2 == 0)
        y = _labels(g, (B, T), -100)
        temperature = (1.0, 0.7)[n % 2]
        kw = dict(temperature=temperature, return_entropy=entropy, chunk_bytes=5 * V * h.element_size())  # chunks
        if layout == "supervised":
            rng = [[1, 4], [0, 0], [2, 6], [0, 5]]
            for r, (a, z) in enumerate(rng):
                y[r, :a], y[r, z:] = -100, -100
            kw["supervised"] = rng
        if layout == "packed":
            h, y = h.reshape(1, B * T, D), y.reshape(1, B * T)
            kw["packed"] = hk.Packed([0, 5, 5, 13, B * T])
        gl, gh = torch.randn(y.shape, generator=g), torch.randn(y.shape, generator=g)
        what = f"{kernels=} {dtype} {entropy=} {layout} bias={b is not None}"
        with _path(kernels):
            want_in = _leaves(h, w, b)
            want = hk.fused_linear.token_logprobs(want_in[0], want_in[1], y, bias=want_in[2], **kw)
            got_in = _leaves(h, w, b, s, e)
            got = hk.fused_linear.token_logprobs(got_in[0], got_in[1], y, bias=got_in[2], process_group=group, **kw)
        want, got = (want, got) if entropy else ((want,), (got,))
        for a, c in zip(got, want):
            close(a, c, 1e-5, what)
        ((got[0] * gl).sum() + ((got[1] * gh).sum() if entropy else 0)).backward()
        ((want[0] * gl).sum() + ((want[1] * gh).sum() if entropy else 0)).backward()
        _check_linear_grads(got_in, want_in, s, e, 1e-5 if dtype == torch.float32 else 3e-2, what)
    assert n == (6 if quick else 20)


def _linear_losses_worker(rank, world, quick=False):
    _linear_logprobs_worker(rank, world, quick)
    group = dist.group.WORLD
    s, e = _bounds(world, rank)
    n = 0
    variants = ((False, "fp32", 1), (True, "fp32", 6)) if quick else (
        (False, "fp32", 1), (False, "bf16", 3), (False, "supervised", 2), (False, "packed", 2), (True, "fp32", 3),
        (True, "bf16", 6), (True, "supervised", 6), (True, "packed", 6))
    for kernels, variant, every in variants:
        g = torch.Generator().manual_seed(300 + n)
        dtype = torch.bfloat16 if variant == "bf16" else torch.float32
        labels = _labels(g, (B, T), -100)
        h, w, b = _hidden_inputs(g, dtype, bias=variant != "packed")
        for name, args, kw, oracle, owed in _loss_cases(g, labels):
            n += 1
            if (n - 1) % every or (variant == "packed" and name == "kto" and len(args) > 2):
                continue
            fn = getattr(hk.fused_linear, name)
            x, y, a = h, labels, lambda: args
            extra = dict(chunk_bytes=2 * T * V * h.element_size())  # two rows a chunk: DPO's pairs in two chunks
            if variant == "supervised":
                rng = [[1, 6], [2, 5], [1, 4], [3, 6]]
                y = labels.clone()
                for r, (a0, z) in enumerate(rng):
                    y[r, :a0], y[r, z:] = -100, -100
                extra["supervised"] = rng
            if variant == "packed":
                x, y, a, kw, extra = _packed(h, labels, args, kw, extra)
            what = f"{kernels=} {variant} {name} {kw}"
            _grads([t for t in args if isinstance(t, torch.Tensor) and t.requires_grad])
            with _path(kernels):
                want_in = _leaves(x, w, b)
                want = fn(want_in[0], want_in[1], y, *a(), bias=want_in[2], **kw, **extra)
                _backward(_flat(want)[0], torch.Generator().manual_seed(n))
                want_grads = _grads(owed)
                got_in = _leaves(x, w, b, s, e)
                got = fn(got_in[0], got_in[1], y, *a(), bias=got_in[2], **kw, **extra, process_group=group)
                _backward(_flat(got)[0], torch.Generator().manual_seed(n))
                got_grads = _grads(owed)
            tol = 2e-5 if dtype == torch.float32 else 1e-4
            _compare(got, want, tol, what)
            _check_linear_grads(got_in, want_in, s, e, tol if dtype == torch.float32 else 3e-2, what)
            for a_, b_ in zip(got_grads, want_grads):
                close(a_, b_, tol, what + " (input gradient)")
            if variant == "fp32":  # and the ground truth
                logits = h @ w.T + b
                lp = hk.reference.token_logprobs(logits, y, temperature=kw.get("temperature", 1.0))
                rkw = {k: v for k, v in kw.items() if k != "temperature"}
                _compare(got, oracle(lp, rkw), 1e-4, what + " vs hk.reference")
    assert n == len(variants) * 13


def test_fused_linear_sharded_equal_unsharded():
    run(_linear_losses_worker)


def _four_ranks_worker(rank, world):
    _logprobs_worker(rank, world, quick=True)
    _fused_worker(rank, world, quick=True)
    _linear_losses_worker(rank, world, quick=True)


def test_every_level_at_four_ranks():
    """Every entry point's cases in brief, the vocabulary in four uneven slices (9 + 11 + 8 + 9)."""
    run(_four_ranks_worker, world_size=4)
