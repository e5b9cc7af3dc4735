"""ReferenceSyncer under DeepSpeed ZeRO-1/2 (full replicas) and ZeRO-3 (partitions + persistent small params).

CPU, gloo, world size 2, one spawn per stage family. DeepSpeed picks its CPU accelerator (no CUDA here) whose
communication backend is gloo; its shared-memory allreduce op is a C++ JIT build (~45 s on 2 cores) that these
tests do not need, so it is switched off. Checks, per step: after a sync step the reference's no-grad forward
equals the policy's training forward of that step exactly, the reference's full weights (ZeRO-3: all-gathered
partitions, and the gathered copy of persistent params) equal the policy's pre-step weights, non-sync steps
leave the reference untouched (every=3), and differently wrapped models raise ValueError.
"""
import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import humanline_kernels as hk
from tools.distributed import check_paced, run

deepspeed = pytest.importorskip("deepspeed")

pytestmark = pytest.mark.slow  # DeepSpeed's stages on two spawned ranks


class Net(nn.Module):
    def __init__(self, seed, out=3):
        super().__init__()
        torch.manual_seed(seed)
        # odd sizes: partitions are padded (35 -> 18/18 elements); biases/LayerNorm fall under the persistence
        # threshold below, so ZeRO-3 keeps them gathered
        self.l1 = nn.Linear(5, 7)
        self.l2 = nn.Linear(7, out, bias=False)
        self.norm = nn.LayerNorm(out)
        self.register_buffer("shift", torch.zeros(out))
        with torch.no_grad():
            for p in self.parameters():
                p.normal_()
            self.shift.normal_()

    def forward(self, x):
        return self.norm(self.l2(torch.relu(self.l1(x)))) + self.shift


def _init_ds():
    # the CPU accelerator JIT-builds a shared-memory allreduce op at backend creation; gloo does the same job
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")


def config(stage, persist=8, bf16=False):
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = persist
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
            "zero_optimization": zero, "bf16": {"enabled": bf16}}


def policy_engine(model, stage, **kw):
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    return deepspeed.initialize(model=model, optimizer=opt, config=config(stage, **kw))[0]


def reference_engine(model, stage, **kw):
    """A reference engine in eval mode. ZeRO-3 and stage 0 without optimizer (TRL's layout: stage 0 under ZeRO-1/2);
    ZeRO-1/2 engines require an optimizer, so those get one that is never stepped."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.0) if stage in (1, 2) else None
    eng = deepspeed.initialize(model=model, optimizer=opt, config=config(stage, **kw))[0]
    eng.eval()
    return eng


def full_weights(model):
    """name -> full tensor: ZeRO-3 params from all-gathered local partitions (no DeepSpeed gather machinery,
    which would disturb what is being tested), plus the gathered copy of persistent params; others as they are."""
    m = model.module if hasattr(model, "module") else model
    out = {}
    for n, p in m.named_parameters():
        if hasattr(p, "ds_tensor"):
            parts = [torch.empty_like(p.ds_tensor) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, p.ds_tensor.detach().contiguous())
            out[n] = torch.cat(parts)[:p.ds_numel].view(p.ds_shape).clone()
            if p.ds_persist and p.data.numel():
                out[n + "(gathered)"] = p.data.detach().clone()
        else:
            out[n] = p.detach().clone()
    for n, b in m.named_buffers():
        out[n] = b.detach().clone()
    return out


def same(a, b):
    """Equal weights; a persistent param's gathered copy is compared only when both models hold one."""
    keys = [k for k in a if not k.endswith("(gathered)")]
    assert sorted(keys) == sorted(k for k in b if not k.endswith("(gathered)"))
    ok = all(torch.equal(a[k], b[k]) for k in keys)
    return ok and all(torch.equal(a[k], b[k]) for k in a if k.endswith("(gathered)") and k in b)


def scenario(pol, ref, every=1, steps=4, warm=False, dtype=torch.float32, tag="", slices=1):
    if warm:  # ZeRO-3: keeps persistent params gathered only from the second (traced) forward on, so the
        for _ in range(2):  # reference holds them at the first sync while the policy does not yet
            with torch.no_grad():
                ref(torch.zeros(4, 5, dtype=dtype))
    syncer = hk.ReferenceSyncer(pol, ref, every=every, slices=slices)
    g = torch.Generator().manual_seed(10 + dist.get_rank())
    last_ref = None
    for t in range(steps):
        x = torch.randn(4, 5, generator=g).to(dtype)  # a bf16 engine casts the module, not the inputs
        with torch.no_grad():
            ref(x)  # ZeRO-3: gathers the reference; persistent params stay gathered
        is_sync = syncer.start()
        assert is_sync == (t % every == 0), tag
        out = pol(x)
        pol.backward(out.square().mean())
        pol_pre = full_weights(pol)
        assert syncer.wait() == is_sync
        pol.step()
        with torch.no_grad():
            ref_out = ref(x)
        if is_sync:
            assert torch.equal(ref_out, out.detach()), f"{tag} step {t}: reference forward != policy forward"
        ref_w = full_weights(ref)
        if is_sync:
            assert same(ref_w, pol_pre), f"{tag} step {t}: reference != pre-step policy"
            assert not same(ref_w, full_weights(pol)), f"{tag} step {t}: policy did not move"
        else:
            assert same(ref_w, last_ref), f"{tag} step {t}: reference changed on a non-sync step"
        last_ref = ref_w
    assert syncer.step == steps
    check_paced(syncer, slices, tag)


def expect_mismatch(pol, ref, match="not wrapped identically"):
    with pytest.raises(ValueError, match=match):
        hk.ReferenceSyncer(pol, ref).sync()


def zero12_worker(rank, world):
    _init_ds()
    for stage in (1, 2):
        scenario(policy_engine(Net(0), stage), reference_engine(Net(1), stage), tag=f"zero{stage}")
    scenario(policy_engine(Net(0), 2), reference_engine(Net(1), 2), slices=3, tag="zero2 paced")
    # every=3, TRL's layout for ZeRO-1/2: a stage-0 reference engine
    scenario(policy_engine(Net(0), 2), reference_engine(Net(1), 0), every=3, steps=7, tag="zero2/stage-0 ref")
    # bf16: the module holds bf16 weights (copied), the optimizer fp32 master partitions (not copied)
    scenario(policy_engine(Net(0), 2, bf16=True), reference_engine(Net(1), 2, bf16=True), dtype=torch.bfloat16,
             tag="zero2 bf16")
    expect_mismatch(policy_engine(Net(0), 2), reference_engine(Net(1, out=4), 2))


def test_zero12():
    run(zero12_worker)


def gathered_copied_in_wait():
    """The policy's gathered data of a ZeRO-3 param held at start() may be freed/reused by the policy forward
    before wait(): it is copied in wait() (late, current stream), not from start() (side stream)."""
    pol, ref = policy_engine(Net(0), 3), reference_engine(Net(1), 3)
    x = torch.zeros(4, 5)
    for _ in range(2):  # persistent params stay gathered from the second (traced) forward on
        with torch.no_grad():
            ref(x), pol(x)
    held = {n: p for n, p in pol.module.named_parameters() if p.ds_persist}
    rheld = {n: r for n, r in ref.module.named_parameters() if r.ds_persist}
    assert held and held.keys() == rheld.keys()
    assert all(p.data.numel() == p.ds_numel for p in list(held.values()) + list(rheld.values()))
    syncer = hk.ReferenceSyncer(pol, ref)
    syncer.start()
    late = syncer._pairs.late_names()
    assert {n + "(gathered)" for n in held} <= set(late) and not any(n in late for n in held)
    with torch.no_grad():  # the memory the policy held gathered at start() now holds something else
        for p in held.values():
            p.data.add_(1.0)
    want = {n: p.data.clone() for n, p in held.items()}
    syncer.wait()
    for n, r in rheld.items():
        assert torch.equal(r.data, want[n]), f"{n}: gathered data copied before wait()"


def zero3_resume(folder):
    """hk.save_humanline_state writes each rank's partitions; loading them into a fresh, warm reference (persistent
    params gathered) restores them and releases the stale gathered copies: its forward is the saved reference's."""
    pol, ref = policy_engine(Net(0), 3), reference_engine(Net(1), 3)
    syncer = hk.ReferenceSyncer(pol, ref, every=1)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        x = torch.randn(4, 5, generator=g)
        with torch.no_grad():
            ref(x)
        syncer.start()
        pol.backward(pol(x).square().mean())
        syncer.wait()
        pol.step()
    hk.save_humanline_state(folder, syncer=syncer)
    assert sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")) == [
        "humanline_reference-rank00000-of-00002.safetensors", "humanline_reference-rank00001-of-00002.safetensors"]
    fresh = reference_engine(Net(2), 3)
    for _ in range(2):
        with torch.no_grad():
            fresh(torch.zeros(4, 5))  # persistent params now held gathered, with Net(2)'s values
    hk.load_humanline_state(folder, syncer=hk.ReferenceSyncer(pol, fresh, every=1))
    x = torch.randn(4, 5, generator=g)
    with torch.no_grad():
        assert torch.equal(fresh(x), ref(x)), "the restored reference's forward differs from the saved one's"
    assert same(full_weights(fresh), full_weights(ref))


def zero3_worker(rank, world, folder):
    _init_ds()
    zero3_resume(folder)
    scenario(policy_engine(Net(0), 3), reference_engine(Net(1), 3), tag="zero3")
    scenario(policy_engine(Net(0), 3), reference_engine(Net(1), 3), slices=3, tag="zero3 paced")
    gathered_copied_in_wait()
    scenario(policy_engine(Net(0), 3), reference_engine(Net(1), 3), every=3, steps=7, warm=True,
             tag="zero3 every=3, warm reference")
    # persistence differs: the reference's gathered copies are released, not copied
    scenario(policy_engine(Net(0), 3, persist=0), reference_engine(Net(1), 3), warm=True,
             tag="zero3 persistent reference only")
    scenario(policy_engine(Net(0), 3), reference_engine(Net(1), 3, persist=0), tag="zero3 persistent policy only")
    scenario(policy_engine(Net(0), 3, bf16=True), reference_engine(Net(1), 3, bf16=True), dtype=torch.bfloat16,
             warm=True, tag="zero3 bf16")
    # partitioned at construction, as for big models (Net's normal_() then sees empty params: default init)
    with deepspeed.zero.Init(config_dict_or_path=config(3)):
        pol, ref = Net(0), Net(1)
    scenario(policy_engine(pol, 3), reference_engine(ref, 3), tag="zero3 zero.Init")
    expect_mismatch(policy_engine(Net(0), 3), reference_engine(Net(1, out=4), 3))
    # ZeRO++ hpZ: once the reference holds secondary partitions its forward gathers those (needs an optimizer:
    # DeepSpeed's engine cannot set up hpZ without one)
    ref = Net(1)
    cfg = config(3)
    cfg["zero_optimization"]["zero_hpz_partition_size"] = 2
    ref = deepspeed.initialize(model=ref, optimizer=torch.optim.AdamW(ref.parameters(), lr=0.0), config=cfg)[0]
    with torch.no_grad():
        ref(torch.zeros(4, 5))
    expect_mismatch(policy_engine(Net(0), 3), ref, match="hpZ")
    expect_mismatch(policy_engine(Net(0), 3), Net(1))


def test_zero3(tmp_path):
    run(zero3_worker, str(tmp_path))
