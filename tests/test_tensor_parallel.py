"""``process_group=``: the vocabulary split over the ranks of a group (Megatron's column-parallel lm_head).

Real gloo groups on CPU (spawned processes, tests/_dist.py), world size 2 with uneven slices (V = 37 as 20 + 17)
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
from _dist import run

import humanline_kernels as hk

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
def _logprobs_worker(rank, world, group_kind):
    group = dist.new_group(list(range(world))) if group_kind == "new" else dist.group.WORLD
    s, e = _bounds(world, rank)
    n = 0
    paths = (True, False) if world == 2 else (True,)
    for kernels, dtype, entropy, (shape, how) in itertools.product(
            paths, (torch.float32, torch.bfloat16), (False, True),
            (((2, 5), "copy"), ((7,), "copy"), ((2, 5), "view"), ((2, 5), "inplace"))):
        if how == "inplace" and dtype == torch.bfloat16:
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
    assert n >= 12 * len(paths)


@pytest.mark.parametrize("world", [2, 4])
def test_token_logprobs_sharded_equal_unsharded(world):
    run(_logprobs_worker, "new" if world == 2 else "world", world_size=world)


def _layout_worker(rank, world):
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


def test_token_logprobs_sharded_layout_and_bad_inputs():
    run(_layout_worker)


def test_process_group_needs_torch_distributed():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        hk.token_logprobs(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), process_group=object())
