"""ReferenceSyncer into a CPU-offloaded FSDP reference (verl's layout: FSDP1 ``CPUOffload(offload_params=True)``,
FSDP2 ``CPUOffloadPolicy``), shard to shard, no state-dict gather.

CPU (gloo, world size 2): the scenario of test_sync_dist.py (after a sync step the reference's forward equals the
policy's forward of that step exactly, its full state dict equals the pre-step policy's, non-sync steps leave it
untouched, resume keeps the count) with the reference offloaded, in mixed precision, fp32 or bf16-stored (copy +
cast). FSDP1 pins its offloaded shards, which needs an accelerator: on CPU ``Tensor.pin_memory`` is the identity in
the spawned ranks, so FSDP1's offload code paths run while the memory stays pageable.

GPU (world size 1, NCCL): the policy on CUDA, the reference's shards in pinned host memory; the device-to-host copy
runs on the side stream, and the reference equals the pre-step policy after each sync.
"""
import functools

import pytest
import torch
import torch.distributed as dist
from test_sync_dist import Net, free_fsdp1_retained, fsdp1_wrap, fsdp2_wrap, params_to_bf16, scenario
from torch import nn

import humanline_kernels as hk
from tools.distributed import free_port, run

pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available"),
              pytest.mark.slow]  # slow: offloaded FSDP references on two spawned ranks


def fsdp1_offloaded(model, mixed=True):
    from torch.distributed.fsdp import CPUOffload, MixedPrecision
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    kw = dict(auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), cpu_offload=CPUOffload(offload_params=True),
              device_id=torch.device("cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"))
    if mixed:
        kw["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return FSDP(model, **kw)


def offload_worker(rank, world):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    torch.Tensor.pin_memory = lambda self, *a, **k: self  # no accelerator: FSDP1's offload pins its shards
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    off = CPUOffloadPolicy(pin_memory=False)
    scenario(functools.partial(fsdp1_wrap, mixed=True), fsdp1_offloaded, free=free_fsdp1_retained,
             tag="fsdp1 policy, CPUOffload reference, bf16 mixed precision")
    scenario(functools.partial(fsdp1_wrap, mixed=False), functools.partial(fsdp1_offloaded, mixed=False), every=3,
             steps=7, free=free_fsdp1_retained, tag="fsdp1 policy, CPUOffload reference, fp32")
    scenario(functools.partial(fsdp2_wrap, mp_policy=bf16), functools.partial(fsdp2_wrap, mp_policy=bf16,
                                                                              offload_policy=off),
             tag="fsdp2 policy, CPUOffloadPolicy reference, bf16 mixed precision")
    scenario(functools.partial(fsdp2_wrap, mp_policy=bf16),
             lambda m: fsdp2_wrap(params_to_bf16(m), mp_policy=bf16, offload_policy=off), ref_dtype=torch.bfloat16,
             every=2, steps=5, tag="fsdp2 policy, bf16-stored CPUOffloadPolicy reference (copy + cast)")


def test_cpu_offloaded_reference():
    run(offload_worker)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1"])
def test_cuda_policy_into_pinned_host_reference(kind):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        if kind == "fsdp2":
            mesh = init_device_mesh("cuda", (1,))
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

            def wrap(m, **kw):
                for sub in m.modules():
                    if isinstance(sub, nn.Linear):
                        fully_shard(sub, mesh=mesh, mp_policy=mp, **kw)
                return fully_shard(m, mesh=mesh, mp_policy=mp, **kw)
            pol = wrap(Net(0).cuda())
            ref = wrap(Net(1).cuda(), offload_policy=CPUOffloadPolicy(pin_memory=True))
            from humanline_kernels.sync._backends import _fsdp2_cls, _fsdp2_params

            def shards(m):  # FSDP's own shards: after a no-grad forward the root registers its unsharded params
                mods = [s for s in m.modules() if isinstance(s, _fsdp2_cls())]
                return [fp.sharded_param._local_tensor for fp in _fsdp2_params(m, mods).values()]
        else:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp import MixedPrecision
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy
            pol = FSDP(Net(0), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=torch.device("cuda", 0),
                       mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
            ref = fsdp1_offloaded(Net(1))  # on the CPU, computing on cuda:0
            shards = lambda m: [h.flat_param._local_shard for h in m._all_handles]  # noqa: E731
        opt = torch.optim.AdamW(pol.parameters(), lr=0.05)
        syncer = hk.ReferenceSyncer(pol, ref, every=2)
        x = torch.randn(6, 5, device="cuda")
        for t in range(5):
            with torch.no_grad():
                ref(x)
            assert all(s.device.type == "cpu" and s.is_pinned() for s in shards(ref))
            synced = syncer.start()
            assert synced == (t % 2 == 0)
            if synced:
                assert list(syncer._done) == [torch.device("cuda", 0)]  # the copy went to the side stream
            out = pol(x)
            out.square().mean().backward()
            pre = [s.detach().clone() for s in shards(pol)]
            before = [s.clone() for s in shards(ref)]
            syncer.wait()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()  # the shards are host memory written asynchronously: read them after a sync
            for r, p, b in zip(shards(ref), pre, before):
                assert torch.equal(r, p.cpu().to(r.dtype) if synced else b)
            if synced:
                with torch.no_grad():
                    assert torch.equal(ref(x), out.detach())
    finally:
        dist.destroy_process_group()
