"""ReferenceSyncer on one device (plain module): step semantics, casts, resume, re-collection, bad input."""
import pytest
import torch
from torch import nn

import humanline_kernels as hk


def make(seed, dtype=torch.float32):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.ReLU(), nn.Linear(7, 3, bias=False), nn.BatchNorm1d(3))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()  # LayerNorm/BatchNorm params must differ between the two models too
    return m.to(dtype)


def sd(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def assert_sd_equal(a, b, cast=None):
    assert a.keys() == b.keys()
    for k in a:
        v = b[k].to(cast) if cast is not None and b[k].is_floating_point() else b[k]
        assert torch.equal(a[k], v), k


@pytest.mark.parametrize("every", [1, 3])
@pytest.mark.parametrize("overlap", [True, False])
def test_sync_steps_hold_pre_step_policy(every, overlap):
    pol, ref = make(0), make(1)
    syncer = hk.ReferenceSyncer(pol, ref, every=every, overlap=overlap)
    opt = torch.optim.AdamW(pol.parameters(), lr=0.1)
    x = torch.randn(6, 5)
    for t in range(7):
        ref_before = sd(ref)
        with torch.no_grad():
            ref(x)  # reference forward (BatchNorm in train mode updates its running stats: buffers move too)
        ref_after_fwd = sd(ref)
        assert syncer.start() == (t % every == 0)
        pol(x).square().mean().backward()
        pol_pre = sd(pol)
        with torch.no_grad():
            pol.eval()
            pre_out = pol(x)
            pol.train()
        assert syncer.wait() == (t % every == 0)
        assert syncer.step == t + 1
        opt.step()
        opt.zero_grad()
        if t % every == 0:
            assert_sd_equal(sd(ref), pol_pre)
            with torch.no_grad():
                ref.eval()
                assert torch.equal(ref(x), pre_out)
                ref.train()
            assert not torch.equal(pol[0].weight, ref[0].weight)  # the policy moved on after the sync
        else:
            assert_sd_equal(sd(ref), ref_after_fwd)
            assert ref_before.keys() == ref_after_fwd.keys()


def test_bf16_reference_casts_and_wait_without_start():
    pol, ref = make(0), make(1, torch.bfloat16)
    syncer = hk.ReferenceSyncer(pol, ref)
    assert syncer.wait() is True  # no start(): wait() copies itself
    assert_sd_equal(sd(ref), sd(pol), cast=torch.bfloat16)
    x = torch.randn(4, 5)
    pol.eval(), ref.eval()
    with torch.no_grad():
        assert torch.equal(ref(x.bfloat16()), pol.bfloat16()(x.bfloat16()))


def test_grad_accumulation_counts_optimizer_steps():
    pol, ref = make(0), make(1)
    syncer = hk.ReferenceSyncer(pol, ref, every=2)
    opt = torch.optim.SGD(pol.parameters(), lr=0.5)
    xs = torch.randn(3, 4, 5)
    synced = []
    for _ in range(4):
        with torch.no_grad():
            [ref(x) for x in xs]  # all micro-batches' reference forwards first
        synced.append(syncer.start())
        assert syncer.start() == synced[-1]  # a second start() in the same step is a no-op
        for x in xs:
            pol(x).sum().backward()
        pre = sd(pol)
        assert syncer.wait() == synced[-1]
        opt.step()
        opt.zero_grad()
        if synced[-1]:
            assert_sd_equal(sd(ref), pre)
    assert synced == [True, False, True, False] and syncer.step == 4


def test_resume_restores_counter_and_recollects():
    pol, ref = make(0), make(1)
    a = hk.ReferenceSyncer(pol, ref, every=3)
    for _ in range(4):
        a.sync()
    state = a.state_dict()
    assert state == {"step": 4, "every": 3}
    pol2, ref2 = make(2), make(3)
    b = hk.ReferenceSyncer(pol2, ref2, every=3)
    b.load_state_dict(state)
    assert b.step == 4 and not b.start() and not b.wait()  # step 4: no sync
    ref_before = sd(ref2)
    assert_sd_equal(sd(ref2), ref_before)
    assert b.sync() is False and b.sync() is True and b.step == 7  # steps 5, 6
    assert_sd_equal(sd(ref2), sd(pol2))
    with pytest.raises(ValueError, match="step"):
        b.load_state_dict({"step": -1})


def test_load_state_dict_warns_on_different_every():
    import warnings
    pol, ref = make(0), make(1)
    s = hk.ReferenceSyncer(pol, ref, every=2)
    with pytest.warns(UserWarning, match="every=3.*keeping every=2"):
        s.load_state_dict({"step": 5, "every": 3})
    assert s.every == 2 and s.step == 5 and s.is_sync_step is False  # not silently changed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.load_state_dict({"step": 4, "every": 2})
        s.load_state_dict({"step": 4})
    assert s.step == 4 and s.is_sync_step


def test_bad_arguments_are_value_errors():
    """Not a module, a None reference, a malformed state dict: a ValueError naming the argument, at once (a dict
    used to be accepted and fail with an AttributeError at the first sync)."""
    pol = make(0)
    for kw, match in ((dict(policy={"w": 1}, reference=make(1)), "policy must be a torch.nn.Module"),
                      (dict(policy=pol, reference=None), "reference must be a torch.nn.Module"),
                      (dict(policy=pol, reference=pol), "different modules"),
                      (dict(policy=pol, reference=make(1), use_kernel="yes"), "use_kernel"),
                      (dict(policy=pol, reference=make(1), use_kernel=1), "use_kernel must be None, True or False"),
                      (dict(policy=pol, reference=make(1), use_kernel=0), "use_kernel must be None, True or False"),
                      (dict(policy=pol, reference=make(1), overlap="yes"), "overlap must be a bool")):
        with pytest.raises(ValueError, match=match):
            hk.ReferenceSyncer(**kw)
    s = hk.ReferenceSyncer(pol, make(1))
    for state, match in (({}, "without step"), ([4, 1], "got list"), ({"step": True}, "step"),
                         ({"step": 2, "every": 0}, "every"), ({"step": 2.0}, "step")):
        with pytest.raises(ValueError, match=match):
            s.load_state_dict(state)
    assert s.step == 0  # nothing half-applied


def test_recollects_after_to_and_assign_load():
    pol, ref = make(0), make(1)
    syncer = hk.ReferenceSyncer(pol, ref)
    syncer.sync()
    ref.to(torch.bfloat16)  # parameter .data replaced: groups must change dtype
    pol.load_state_dict(make(5).state_dict(), assign=True)  # parameter objects replaced
    syncer.sync()
    assert_sd_equal(sd(ref), sd(pol), cast=torch.bfloat16)


def test_mismatched_models_raise():
    with pytest.raises(ValueError, match="every"):
        hk.ReferenceSyncer(make(0), make(1), every=0)
    pol = make(0)
    ref = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.ReLU(), nn.Linear(7, 4, bias=False), nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match="not wrapped identically.*shape"):
        hk.ReferenceSyncer(pol, ref).sync()
    ref = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3, bias=False))
    with pytest.raises(ValueError, match="not wrapped identically"):
        hk.ReferenceSyncer(pol, ref).sync()


def test_bench_time_reps_counts_calls_not_ms(monkeypatch):
    """do_bench's rep is in ms: a 50 ms step must be timed over ~reps calls, not once (a 1 % target needs that)."""
    import time

    from bench import bench_sync, common
    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(common, "time_ms", lambda fn, warmup=25, rep=100: seen.update(warmup=warmup, rep=rep) or 1.0)
    bench_sync.time_reps(lambda: time.sleep(0.05), reps=20)
    assert seen["rep"] >= 20 * 50 and seen["warmup"] >= 2 * 50


def test_bench_sync_quick_runs(tmp_path):
    import json
    import math

    from bench import bench_sync
    assert bench_sync.main(["--quick", "--out", str(tmp_path)]) == 0
    copy = json.load(open(tmp_path / "sync_copy.json"))
    assert len(copy["rows"]) == 9 and all(r["tensors"] == 290 and r["ratio_to_copy_bw"] > 0 for r in copy["rows"])
    overlap = json.load(open(tmp_path / "sync_overlap.json"))
    paced = [r for r in overlap["rows"] if "parts" in r]
    # --quick: 2 GEMMs (2 forward points, no gradients) and 3 parts, due at points 0, 0 and 1 once learned
    assert overlap["meta"]["slices"] == 3 and len(paced) == 2
    assert all(r["parts"] == {"start": 2, "points": 1, "wait": 0} for r in paced), paced
    fsdp2 = json.load(open(tmp_path / "sync_fsdp2.json"))
    # our sync vs the state_dict way: a ratio of two measured sync times (not of a possibly ~0 added time)
    assert math.isfinite(fsdp2["meta"]["state_dict_over_ours"]) and fsdp2["meta"]["state_dict_over_ours"] > 1
    assert {r["impl"] for r in fsdp2["rows"]} >= {"our sync alone (blocking)", "state_dict way alone"}


def test_copy_engines_are_the_default():
    """Same-device, same-dtype CUDA groups go to the copy engines unless the syncer is built with
    ``copy_engine=False``; every plan the syncer makes (and their slices) carries its choice; a non-bool is
    refused."""
    pol, ref = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    for engine in (True, False):
        kw = {} if engine else dict(copy_engine=False)
        syncer = hk.ReferenceSyncer(pol, ref, **kw)
        plan = syncer._plan(False)
        assert plan.copy_engine is engine and all(part.copy_engine is engine for part in plan.split(3))
    with pytest.raises(ValueError, match="copy_engine must be a bool"):
        hk.ReferenceSyncer(pol, ref, copy_engine=0)
