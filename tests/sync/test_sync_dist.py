"""ReferenceSyncer under DDP, FSDP2 and FSDP1 on CPU (gloo, world size 2, one spawn per backend family).

Every scenario checks, for each step: after a sync step the reference's no-grad forward equals the policy's
training forward of that step exactly (checked before any state_dict() call, which would mask stale unsharded
copies), the full state dict of the reference equals the policy's pre-step one, non-sync steps leave the
reference untouched (every=3), a fresh syncer resumed from state_dict() continues the count, and differently
wrapped models raise ValueError.
"""
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

import humanline_kernels as hk
from tools.distributed import check_paced, run

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")


class Net(nn.Module):
    def __init__(self, seed, out=3):
        super().__init__()
        torch.manual_seed(seed)
        # odd sizes: dim 0 splits unevenly over 2 ranks (7 -> 4/3 rows, 3 -> 2/1)
        self.l1 = nn.Linear(5, 7)
        self.block = nn.Sequential(nn.Linear(7, 9), nn.ReLU())
        self.l3 = nn.Linear(9, out, bias=False)
        self.norm = nn.LayerNorm(out)
        self.register_buffer("shift", torch.zeros(out))
        with torch.no_grad():
            for p in self.parameters():
                p.normal_()  # root-unit params (LayerNorm) must differ between the models too
            self.shift.normal_()

    def forward(self, x):
        return self.norm(self.l3(self.block(torch.relu(self.l1(x))))) + self.shift


def full_sd(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k.replace("module.", ""): v.detach().clone() for k, v in sd.items()}


def sd_equal(a, b):
    """Tensor-wise equality of state dicts, ``b`` cast to ``a``'s dtypes (bf16 reference vs fp32 policy)."""
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    return all(a[k].dtype == b[k].dtype or a[k].is_floating_point() for k in a) and \
        all(torch.equal(a[k], b[k].to(a[k].dtype)) for k in a)


def free_fsdp1_retained(model):
    """FSDP1 keeps unsharded params after a no-grad forward; free them before comparing state dicts."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    for m in FSDP.fsdp_modules(model):
        h = m._handle
        if h is not None and h.uses_sharded_strategy and h.flat_param._full_param_padded.untyped_storage().size():
            h.reshard(True)
            h.post_reshard()


def scenario(wrap_pol, wrap_ref, every=1, steps=5, ref_dtype=torch.float32, free=None, tag="", slices=1):
    pol = wrap_pol(Net(0))
    ref = wrap_ref(Net(1))
    opt = torch.optim.AdamW(pol.parameters(), lr=0.05)
    syncer = hk.ReferenceSyncer(pol, ref, every=every, slices=slices)
    g = torch.Generator().manual_seed(10 + dist.get_rank())
    last_ref = None
    assert all(p.dtype == ref_dtype for p in ref.parameters())
    for t in range(steps):
        if t == 3:  # resume: a fresh syncer continues the count
            state = syncer.state_dict()
            syncer = hk.ReferenceSyncer(pol, ref, every=every, slices=slices)
            syncer.load_state_dict(state)
            assert syncer.step == 3
        x = torch.randn(6, 5, generator=g)
        with torch.no_grad():
            ref(x)  # leaves the root (FSDP2/FSDP1) or every unit (SHARD_GRAD_OP) unsharded: the pitfall
        is_sync = syncer.start()
        assert is_sync == (t % every == 0), tag
        out = pol(x)
        out.square().mean().backward()
        if free:
            free(pol)
        pol_pre = full_sd(pol)
        assert syncer.wait() == is_sync
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            ref_out = ref(x)
        if is_sync:
            assert torch.equal(ref_out, out.detach()), f"{tag} step {t}: reference forward != policy forward"
        if free:
            free(ref)
            free(pol)
        ref_sd = full_sd(ref)
        if is_sync:
            assert sd_equal(ref_sd, pol_pre), f"{tag} step {t}: reference != pre-step policy"
            assert not sd_equal(ref_sd, full_sd(pol)), f"{tag} step {t}: policy did not move"
        else:
            assert sd_equal(ref_sd, last_ref), f"{tag} step {t}: reference changed on a non-sync step"
        last_ref = ref_sd
    assert syncer.step == steps
    check_paced(syncer, slices, tag)


def expect_mismatch(pol, ref, match="not wrapped identically"):
    with pytest.raises(ValueError, match=match):
        hk.ReferenceSyncer(pol, ref).sync()


# ---- DDP and plain -------------------------------------------------------------------------------------------
def ddp_worker(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP
    scenario(DDP, DDP, every=1, tag="ddp/ddp")
    scenario(DDP, lambda m: m.requires_grad_(False), every=3, steps=7, tag="ddp/plain ref")
    scenario(DDP, DDP, every=1, slices=4, tag="ddp/ddp paced")
    expect_mismatch(DDP(Net(0)), DDP(Net(1, out=4)))


def test_ddp():
    run(ddp_worker)


# ---- FSDP2 ---------------------------------------------------------------------------------------------------
def fsdp2_wrap(model, per_layer=True, **kw):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if per_layer:
        for m in model.modules():
            if isinstance(m, nn.Linear):
                fully_shard(m, mesh=mesh, **kw)
    return fully_shard(model, mesh=mesh, **kw)


def params_to_bf16(model):
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    return model


def fsdp2_worker(rank, world):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    scenario(fsdp2_wrap, fsdp2_wrap, every=1, tag="fsdp2 per-layer")
    scenario(fsdp2_wrap, functools.partial(fsdp2_wrap, per_layer=False), every=3, steps=7,
             tag="fsdp2 policy per-layer, reference root-only")
    scenario(functools.partial(fsdp2_wrap, mp_policy=bf16), functools.partial(fsdp2_wrap, mp_policy=bf16),
             tag="fsdp2 bf16 mixed precision")
    scenario(functools.partial(fsdp2_wrap, reshard_after_forward=False),
             functools.partial(fsdp2_wrap, reshard_after_forward=False), tag="fsdp2 reshard_after_forward=False")
    # fp32 policy, bf16-stored root-only reference (TRL/accelerate's layout): the copy casts
    scenario(functools.partial(fsdp2_wrap, mp_policy=bf16),
             lambda m: fsdp2_wrap(params_to_bf16(m), per_layer=False, mp_policy=bf16), ref_dtype=torch.bfloat16,
             tag="fsdp2 bf16 reference")
    scenario(fsdp2_wrap, fsdp2_wrap, every=1, slices=3, tag="fsdp2 per-layer paced")
    expect_mismatch(fsdp2_wrap(Net(0)), fsdp2_wrap(Net(1, out=4)))
    expect_mismatch(fsdp2_wrap(Net(0)), Net(1))


@pytest.mark.slow
def test_fsdp2():
    run(fsdp2_worker)


# ---- FSDP1 ---------------------------------------------------------------------------------------------------
def fsdp1_wrap(model, use_orig_params=False, strategy="FULL_SHARD", mixed=False, wrap_cls=nn.Linear):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    kw = dict(auto_wrap_policy=ModuleWrapPolicy({wrap_cls}), use_orig_params=use_orig_params,
              sharding_strategy=getattr(ShardingStrategy, strategy), device_id=torch.device("cpu"))
    if mixed:
        kw["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return FSDP(model, **kw)


def fsdp1_worker(rank, world):
    for i, (orig, strategy, mixed) in enumerate([(False, "FULL_SHARD", False), (True, "FULL_SHARD", False),
                                                  (False, "SHARD_GRAD_OP", False), (True, "SHARD_GRAD_OP", True)]):
        w = functools.partial(fsdp1_wrap, use_orig_params=orig, strategy=strategy, mixed=mixed)
        scenario(w, w, every=3 if i == 1 else 1, steps=7 if i == 1 else 4, free=free_fsdp1_retained,
                 tag=f"fsdp1 use_orig_params={orig} {strategy} mixed={mixed}")
    scenario(fsdp1_wrap, fsdp1_wrap, every=1, steps=4, free=free_fsdp1_retained, slices=3, tag="fsdp1 paced")
    expect_mismatch(fsdp1_wrap(Net(0)), fsdp1_wrap(Net(1), wrap_cls=nn.Sequential))
    expect_mismatch(fsdp1_wrap(Net(0)), fsdp1_wrap(Net(1, out=4)))


@pytest.mark.slow
def test_fsdp1():
    run(fsdp1_worker)
