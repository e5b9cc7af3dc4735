"""KTO's KL baseline is all-reduced (sum and count) across ranks: gloo, world size 2, spawned processes."""
import torch
import torch.multiprocessing as mp
from _dist import run

import humanline_kernels as hk


def _kl_rows(rank):
    # rank 0: row sums 0.6 and 0 (the zero row does not count); rank 1: row sum 0.9 -> z0 = (0.6 + 0.9) / 2
    if rank == 0:
        kl = torch.tensor([[0.4, 0.2], [0.0, 0.0]], dtype=torch.float64)
    else:
        kl = torch.tensor([[0.5, 0.4]], dtype=torch.float64)
    return kl, torch.zeros_like(kl), torch.ones_like(kl, dtype=torch.bool)


def _worker(rank, world, out):
    logps = torch.tensor([[-1.0, -0.5]], dtype=torch.float64)
    ref = torch.tensor([[-1.2, -0.4]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    des = torch.tensor([rank == 0])
    res = []
    for level in (hk.reference, hk.losses):
        loss, m = level.kto(logps, ref, mask, des, *_kl_rows(rank), beta=0.5)
        res.append((loss.item(), m["kl"].item()))
    # the kernel paths (the ranks' CPU tensors through the Triton interpreter, as the suite's TRITON_INTERPRET=1
    # does in CPU CI; on a GPU machine the variable is unset and this default decides): logits and fused linear,
    # fp32, against the reference on the same log-probs
    from humanline_kernels import ops
    from humanline_kernels.ops import _jit
    ops.INTERPRET_CPU_DEFAULT = True
    _jit.LAUNCHES.clear()
    g = torch.Generator().manual_seed(rank)
    h = torch.randn(2, 3, 4, generator=g)
    w = torch.randn(11, 4, generator=g)
    y = torch.randint(0, 11, (2, 3), generator=g)
    lp = hk.reference.token_logprobs(h @ w.T, y)
    ref32 = lp + 0.3 * torch.randn(2, 3, generator=g)
    des2 = torch.tensor([rank == 0, True])
    kl = tuple(t.float() if t.is_floating_point() else t for t in _kl_rows(rank))
    want = hk.reference.kto(lp, ref32, y != -100, des2, *kl, beta=0.5)
    for fn, x, kw in ((hk.fused.kto, (h @ w.T,), {}), (hk.fused_linear.kto, (h, w), dict(chunk_bytes=3 * 11 * 4))):
        loss, m = fn(*x, y, ref32, des2, *kl, beta=0.5, **kw)
        res.append((loss.item(), m["kl"].item(), want[0].item(), want[1]["kl"].item()))
    # the KTO tails that took the all-reduced baseline: the logits path's folded kernel and fused linear's finalize
    tails = _jit.LAUNCHES[("interpreted", "_kto_finalize_kernel")] + _jit.LAUNCHES[("interpreted", "_kto_loss_kernel")]
    assert tails >= 2 and _jit.LAUNCHES[("interpreted", "_kto_finalize_kernel")] >= 1, dict(_jit.LAUNCHES)
    out[rank] = res


def test_kto_kl_baseline_all_reduced_world_size_2():
    with mp.Manager() as manager:
        out = manager.dict()
        run(_worker, out)
        out = dict(out)
    for rank in (0, 1):
        for loss, kl, want_loss, want_kl in out[rank][2:]:  # kernel paths (fused, fused_linear in two chunks)
            assert abs(kl - 0.75) < 1e-6 and abs(want_kl - 0.75) < 1e-6
            assert abs(loss - want_loss) < 1e-6
        for loss, kl in out[rank][:2]:
            assert abs(kl - 0.75) < 1e-12
            s = 0.1  # clipped sum of (logps - ref) = 0.2 - 0.1
            sig = torch.sigmoid(torch.tensor(0.5 * ((s - 0.75) if rank == 0 else (0.75 - s)), dtype=torch.float64))
            assert abs(loss - (1 - sig.item())) < 1e-12
    # single process: only the local rows count
    _, m = hk.losses.kto(torch.zeros(1, 2, dtype=torch.float64), torch.zeros(1, 2, dtype=torch.float64),
                         torch.ones(1, 2, dtype=torch.bool), torch.tensor([True]), *_kl_rows(0))
    assert abs(m["kl"].item() - 0.6) < 1e-12
