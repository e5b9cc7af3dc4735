"""ReferenceSyncer on CUDA: side-stream overlap under a GEMM workload, and FSDP2 at world size 1 with NCCL."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import humanline_kernels as hk

pytestmark = pytest.mark.gpu


def make(seed, dtype=torch.float32):
    torch.manual_seed(seed)
    m = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.LayerNorm(256)) for _ in range(6)], nn.Linear(256, 17))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.05)
    return m.cuda().to(dtype)


@pytest.mark.parametrize("slices", [1, 5])
@pytest.mark.parametrize("use_kernel", [None, False])
def test_side_stream_overlap(use_kernel, slices):
    pol, ref = make(0), make(1, torch.bfloat16)
    syncer = hk.ReferenceSyncer(pol, ref, every=2, use_kernel=use_kernel, slices=slices)
    opt = torch.optim.AdamW(pol.parameters(), lr=1e-2)
    x = torch.randn(64, 256, device="cuda")
    big = torch.randn(2048, 2048, device="cuda")
    for t in range(5):
        with torch.no_grad():
            ref(x.bfloat16())
        ref_before = [p.detach().clone() for p in ref.parameters()]
        synced = syncer.start()
        assert synced == (t % 2 == 0)
        if synced:
            assert syncer._done and all(ev is not None for ev in syncer._done.values())  # on the side stream
        for _ in range(8):  # compute on the default stream while the copy runs beside it
            big = big @ big
            big = big / big.norm()
        pol(x).square().mean().backward()
        pre = [p.detach().clone() for p in pol.parameters()]
        syncer.wait()
        opt.step()
        opt.zero_grad()
        for r, p, b in zip(ref.parameters(), pre, ref_before):
            assert torch.equal(r, p.to(r.dtype) if synced else b)
    torch.cuda.synchronize()


@pytest.mark.parametrize("engine", ["default", False])
@pytest.mark.parametrize("use_kernel", [None, False])
def test_copy_engine_copies_the_same_bits(monkeypatch, use_kernel, engine):
    """A same-dtype group on the side stream under GEMMs, by the default path (the copy engines: the extension's one
    cudaMemcpyBatchAsync, or ``copy_`` per tensor without it) or, with ``copy_engine=False``, by the kernel: the
    reference holds the policy's bits after every sync, and the path asked for is the one that ran."""
    from humanline_kernels.sync import _copy
    batched = engine == "default"
    ext, calls = _copy.load_extension(), {"batch": [], "kernel": []}
    if use_kernel is None and ext is None:
        pytest.skip("extension neither built nor JIT-buildable here")
    if ext is not None:
        for key, fn in (("batch", "multi_tensor_copy_engine"), ("kernel", "multi_tensor_copy")):
            real = getattr(ext, fn)
            monkeypatch.setattr(ext, fn, lambda *a, k=key, f=real: (calls[k].append(a[2]), f(*a))[1])
    pol, ref = make(0, torch.bfloat16), make(1, torch.bfloat16)
    syncer = hk.ReferenceSyncer(pol, ref, every=1, use_kernel=use_kernel, copy_engine=batched)
    opt = torch.optim.AdamW(pol.parameters(), lr=1e-2)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    big = torch.randn(2048, 2048, device="cuda")
    for _ in range(3):
        assert syncer.start()
        for _ in range(8):
            big = big @ big
            big = big / big.norm()
        pol(x).float().square().mean().backward()
        pre = [p.detach().clone() for p in pol.parameters()]
        syncer.wait()
        opt.step()
        opt.zero_grad()
        for r, p in zip(ref.parameters(), pre):
            assert torch.equal(r, p)
    torch.cuda.synchronize()
    # one launch a sync (one bf16 group), issued on a side stream (a batch refuses the legacy default stream)
    ours = use_kernel is None
    assert len(calls["batch"]) == (3 if ours and batched else 0)
    assert len(calls["kernel"]) == (3 if ours and not batched else 0)
    assert all(h != torch.cuda.default_stream().cuda_stream for h in calls["batch"] + calls["kernel"])


def test_paced_parts_wait_for_the_compute_at_their_point():
    """slices=4 on CUDA, the step on a non-default stream: every part is issued from that stream (the backward
    hooks too, where autograd's thread sets the forward's stream), and a part issued after a slow kernel does not
    finish before it, while the parts issued before it do; the reference is the pre-step policy after wait()."""
    pol, ref = make(0), make(1, torch.bfloat16)
    syncer = hk.ReferenceSyncer(pol, ref, every=1, slices=4)
    x = torch.randn(64, 256, device="cuda")
    compute, streams, done = torch.cuda.Stream(), [], []
    inner = syncer._issue

    def issue(plan, side):
        streams.append(torch.cuda.current_stream())
        inner(plan, side)
        done.append(syncer._done[torch.device("cuda", torch.cuda.current_device())])
    syncer._issue = issue
    with torch.cuda.stream(compute):
        # Two warm-up steps with the slow step's kernels, a short sleep and the gradients' accumulation included:
        # under CUDA's lazy loading (the default) a kernel's first launch may synchronize the context (CUDA
        # Programming Guide, "Lazy Loading"), which held the host until the long sleep ended and every part with
        # it (run 9, H200: the first accumulation in the backward stalled the host ~0.5 s; bench/probes/pace_order.py).
        # Step 0 also learns the points: 13 leaves, 26 points; parts at 0, 6, 13 and 19.
        h = pol[3].register_forward_pre_hook(lambda m, a: torch.cuda._sleep(1000))
        for _ in range(2):
            syncer.start()
            pol(x).square().mean().backward()
            syncer.wait()
        h.remove()
        streams.clear()
        done.clear()
        # block 3's first leaf is point 7: part 1 (point 6) is before the slow kernel, parts 2 and 3 after it
        h = pol[3].register_forward_pre_hook(lambda m, a: torch.cuda._sleep(1_000_000_000))  # ~0.5 s of GPU time
        syncer.start()
        pol(x).square().mean().backward()
        h.remove()
        assert len(done) == 4 and all(s == compute for s in streams), (len(done), streams)
        done[1].synchronize()  # finishes while the GPU still sleeps
        assert not done[2].query() and not done[3].query()
        pre = [p.detach().clone() for p in pol.parameters()]
        syncer.wait()
    torch.cuda.synchronize()
    assert syncer._pace.issued == {"start": 1, "points": 3, "wait": 0}
    for r, p in zip(ref.parameters(), pre):
        assert torch.equal(r, p.to(r.dtype))


def test_fsdp2_world_size_1_nccl():
    from _dist import free_port
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

        def wrap(m):
            for blk in m[:-1]:
                fully_shard(blk, mesh=mesh, mp_policy=mp)
            return fully_shard(m, mesh=mesh, mp_policy=mp)

        pol, ref = wrap(make(0)), wrap(make(1))
        syncer = hk.ReferenceSyncer(pol, ref)
        opt = torch.optim.AdamW(pol.parameters(), lr=1e-2)
        x = torch.randn(32, 256, device="cuda")
        for t in range(3):
            with torch.no_grad():
                ref(x)
            assert syncer.start()
            out = pol(x)
            out.float().square().mean().backward()
            syncer.wait()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                assert torch.equal(ref(x), out.detach()), f"step {t}"
    finally:
        dist.destroy_process_group()
