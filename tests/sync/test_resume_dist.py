"""Resume under torch.distributed (gloo, world size 2, CPU): FSDP2 and FSDP1 in a plain loop (the policy and optimizer
through torch.distributed.checkpoint, the reference's shards through hk.save_humanline_state: one file per rank, no
gather) and the humanline DPO trainer under DDP (the replicated reference written once); each resumed run ends as
the uninterrupted one on every rank."""
import functools
import importlib.util
import os

import pytest
import torch
import torch.distributed as dist
from test_sync_dist import Net, fsdp1_wrap, fsdp2_wrap, full_sd, sd_equal

import humanline_kernels as hk
from tools.distributed import run

try:
    import transformers
    _TRANSFORMERS = tuple(int(x) for x in transformers.__version__.split(".")[:2])
except ImportError:  # the TRL test below needs it; the rest do not
    _TRANSFORMERS = (0, 0)

pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available"),
              pytest.mark.slow]  # slow: distributed runs stopped and resumed


def _loop(wrap, every, xs, folder=None, stop=None, resume=None):
    """One run: steps over ``xs``; saves everything after ``stop`` steps into ``folder`` and returns, or resumes
    from ``resume`` first. Returns the full state dicts of the policy and the reference."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    pol, ref = wrap(Net(0)), wrap(Net(0))
    opt = torch.optim.AdamW(pol.parameters(), lr=0.05)
    syncer = hk.ReferenceSyncer(pol, ref, every=every)
    start = 0
    if resume is not None:
        msd, osd = get_state_dict(pol, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=os.path.join(resume, "policy"))
        set_state_dict(pol, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = hk.load_humanline_state(resume, syncer=syncer)["step"]
    for t in range(start, len(xs)):
        x = xs[t]
        with torch.no_grad():
            r = ref(x)
        syncer.start()
        ((pol(x) - r).square().mean() + pol(x).mean()).backward()
        syncer.wait()
        opt.step()
        opt.zero_grad()
        if stop is not None and t + 1 == stop:
            msd, osd = get_state_dict(pol, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(folder, "policy"))
            hk.save_humanline_state(folder, syncer=syncer, extra={"step": stop})
            return None
    return full_sd(pol), full_sd(ref)


def fsdp_worker(rank, world, out):
    g = torch.Generator().manual_seed(10 + rank)
    xs = [torch.randn(6, 5, generator=g) for _ in range(7)]
    wraps = {"fsdp2": fsdp2_wrap, "fsdp2-root": functools.partial(fsdp2_wrap, per_layer=False),
             "fsdp1": fsdp1_wrap}
    for name, wrap in wraps.items():
        every, s = 3, 4
        folder = os.path.join(out, name)
        full = _loop(wrap, every, xs)
        _loop(wrap, every, xs, folder=folder, stop=s)
        files = sorted(f for f in os.listdir(folder) if f.startswith("humanline"))
        assert files == ["humanline_reference-rank00000-of-00002.safetensors",
                         "humanline_reference-rank00001-of-00002.safetensors", "humanline_state.json"], files
        resumed = _loop(wrap, every, xs, resume=folder)
        for a, b, what in zip(full, resumed, ("policy", "reference")):
            assert sd_equal(a, b), f"{name}: {what} differs from the uninterrupted run's"
        # the shards alone (no policy restored) are refused: saved with another policy
        pol, ref = wrap(Net(0)), wrap(Net(0))
        try:
            hk.load_humanline_state(folder, syncer=hk.ReferenceSyncer(pol, ref, every=every))
        except ValueError as e:
            assert "another policy" in str(e) or "another rank" in str(e), e
        else:
            raise AssertionError("a state saved with another policy was accepted")


def test_fsdp_plain_loop_resume(tmp_path):
    run(fsdp_worker, str(tmp_path))
    # one process cannot load the state of two shards
    pol, ref = Net(0), Net(0)
    with pytest.raises(ValueError, match="sharded over 2 ranks"):
        hk.load_humanline_state(tmp_path / "fsdp2", syncer=hk.ReferenceSyncer(pol, ref))


def _resume_tests():
    """tests/integrations/trl/test_resume.py, by path (the trainer runs are its)."""
    spec = importlib.util.spec_from_file_location("hk_resume_tests", os.path.join(
        os.path.dirname(os.path.abspath(__file__)), os.pardir, "integrations", "trl", "test_resume.py"))
    R = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(R)
    return R


def _trl_worker(rank, world, port, out):
    os.environ.update(CUDA_VISIBLE_DEVICES="", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      ACCELERATE_USE_CPU="1")
    torch.set_num_threads(1)
    R = _resume_tests()
    import pathlib
    path = os.path.join(out, "tiny")
    res = {}
    for mode in ("sync", "lookahead"):
        full, resumed = R._run_three(
            lambda o, cbs: R._trainer(path, "dpo", o, 6, 3, cbs, sync_every=2, ddp_backend="gloo",
                                      humanline_reference=mode), pathlib.Path(out) / mode, 3)
        R._assert_same_run(full, resumed, 3)
        res[mode] = {"wrapped": type(resumed.model_wrapped).__name__,
                     "params": [p.detach().clone() for p in resumed.model.parameters()],
                     "files": sorted(f for f in os.listdir(pathlib.Path(out) / mode / "stopped" /
                                                           "checkpoint-3") if f.startswith("humanline"))}
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.skipif(_TRANSFORMERS < (5, 18),
                    reason="transformers < 5.18 loads the optimizer state of a CPU DDP run to map_location 'cpu:0', "
                           "which torch.load cannot restore (the stock Trainer fails alike; fixed in 5.18)")
def test_trl_dpo_ddp_resume(tmp_path):
    import torch.multiprocessing as mp

    from tools.distributed import free_port
    tiny = _resume_tests().tiny
    tiny.tiny_model().save_pretrained(str(tmp_path / "tiny"))
    tiny.tiny_tokenizer().save_pretrained(str(tmp_path / "tiny"))
    mp.spawn(_trl_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    for mode in ("sync", "lookahead"):
        assert r0[mode]["wrapped"] == "DistributedDataParallel"
        for p, q in zip(r0[mode]["params"], r1[mode]["params"]):
            assert torch.equal(p, q)
    # the replicated reference once; the lookahead's windows per rank (each rank has its own batches)
    assert r0["sync"]["files"] == ["humanline_reference.safetensors", "humanline_state.json"]
    assert r0["lookahead"]["files"] == ["humanline_lookahead-rank00000-of-00002.safetensors",
                                        "humanline_lookahead-rank00001-of-00002.safetensors", "humanline_state.json"]
