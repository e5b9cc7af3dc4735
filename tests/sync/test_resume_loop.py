"""Resume in a plain PyTorch loop (docs/sync.md, "Resume"): ``hk.save_humanline_state`` beside the policy and
optimizer checkpoint, ``hk.load_humanline_state`` after restoring them; the resumed loop ends where the
uninterrupted one does. Faults: a step that fails after ``start()`` (the copy in flight), a process killed while
the state is written, damaged files."""
import copy
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

import humanline_kernels as hk


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.norm, self.l2 = nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 3)  # (a buffer too)

    def forward(self, x):
        return self.l2(torch.relu(self.norm(self.l1(x))))


def data(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 5, generator=g) for _ in range(n)]


def loss_fn(pol, ref_out, x):
    return (pol(x) - ref_out).square().mean() + pol(x).mean()


class Run:
    """policy, reference, optimizer and syncer of one run; ``step(x)`` is one optimizer step."""

    def __init__(self, every):
        self.pol = Net()
        self.ref = copy.deepcopy(self.pol).eval()
        self.opt = torch.optim.AdamW(self.pol.parameters(), lr=0.05)
        self.syncer = hk.ReferenceSyncer(self.pol, self.ref, every=every)

    def step(self, x, fail_after_start=False):
        with torch.no_grad():
            r = self.ref(x)
        self.syncer.start()
        loss = loss_fn(self.pol, r, x)
        if fail_after_start:
            raise RuntimeError("out of memory (simulated)")
        loss.backward()
        self.syncer.wait()
        self.opt.step()
        self.opt.zero_grad()

    def save(self, folder):
        os.makedirs(folder, exist_ok=True)
        torch.save({"policy": self.pol.state_dict(), "optim": self.opt.state_dict()}, os.path.join(folder, "ckpt.pt"))
        hk.save_humanline_state(folder, syncer=self.syncer)

    def load(self, folder):
        ck = torch.load(os.path.join(folder, "ckpt.pt"))
        self.pol.load_state_dict(ck["policy"])
        self.opt.load_state_dict(ck["optim"])
        return hk.load_humanline_state(folder, syncer=self.syncer)


def same_models(a, b):
    for x, y in ((a.pol, b.pol), (a.ref, b.ref)):
        for (n, p), q in zip(x.state_dict().items(), y.state_dict().values()):
            assert torch.equal(p, q), n


@pytest.mark.parametrize("every,s", [(1, 3), (3, 4), (4, 6)])
def test_plain_loop_resume(tmp_path, every, s):
    xs = data(9)
    full = Run(every)
    for x in xs:
        full.step(x)
    part = Run(every)
    for x in xs[:s]:
        part.step(x)
    part.save(tmp_path)
    resumed = Run(every)
    resumed.load(tmp_path)
    assert resumed.syncer.step == s
    for x in xs[s:]:
        resumed.step(x)
    same_models(full, resumed)
    without = Run(every)  # the policy and optimizer alone (the syncer's counter restored): another run
    ck = torch.load(tmp_path / "ckpt.pt")
    without.pol.load_state_dict(ck["policy"])
    without.opt.load_state_dict(ck["optim"])
    without.syncer.load_state_dict({"step": s, "every": every})
    for x in xs[s:]:
        without.step(x)
    assert any(not torch.equal(p, q) for p, q in zip(full.pol.parameters(), without.pol.parameters()))


def test_lookahead_resume_through_the_helper(tmp_path):
    xs = data(8)

    def run(lookahead, pol, opt):
        for x, ref in lookahead:
            loss_fn(pol, ref, x).backward()
            lookahead.wait()
            opt.step()
            opt.zero_grad()
            if stop is not None and lookahead.step == stop:
                return

    def logps(model, x):
        return model(x)

    stop = None
    pol = Net()
    opt = torch.optim.AdamW(pol.parameters(), lr=0.05)
    run(hk.LookaheadReference(pol, xs, logps, every=3), pol, opt)
    stop, pol2 = 4, Net()
    opt2 = torch.optim.AdamW(pol2.parameters(), lr=0.05)
    la = hk.LookaheadReference(pol2, xs, logps, every=3)
    run(la, pol2, opt2)
    hk.save_humanline_state(tmp_path, lookahead=la, extra={"step": 4})
    ck = copy.deepcopy((pol2.state_dict(), opt2.state_dict()))
    stop, pol3 = None, Net()
    pol3.load_state_dict(ck[0])
    opt3 = torch.optim.AdamW(pol3.parameters(), lr=0.05)
    opt3.load_state_dict(ck[1])
    la3 = hk.LookaheadReference(pol3, xs[4:], logps, every=3)
    assert hk.load_humanline_state(tmp_path, lookahead=la3) == {"step": 4}
    run(la3, pol3, opt3)
    for p, q in zip(pol.parameters(), pol3.parameters()):
        assert torch.equal(p, q)


# ------------------------------------------------------------------------------------------------------- faults
def test_failure_after_start_leaves_the_new_reference_and_a_loud_syncer(tmp_path):
    """A step fails after start() launched the copy: abort() completes it (the reference is wholly the failed
    step's policy, never half), the syncer then refuses to go on (a retry would train against the wrong reference)
    until the last checkpoint is loaded, from which the run continues exactly."""
    xs = data(8)
    full = Run(2)
    for x in xs:
        full.step(x)
    run = Run(2)
    for x in xs[:3]:
        run.step(x)
    run.save(tmp_path)
    run.step(xs[3])  # step 3: no sync
    with pytest.raises(RuntimeError, match="out of memory"):
        run.step(xs[4], fail_after_start=True)  # step 4 syncs: the copy was launched
    assert run.syncer.abort() is True
    for (n, p), q in zip(run.ref.state_dict().items(), run.pol.state_dict().values()):
        assert torch.equal(p, q), n  # wholly the new weights (buffers included)
    assert run.syncer.step == 4
    for call in (run.syncer.start, run.syncer.wait, run.syncer.state_dict,
                 lambda: hk.save_humanline_state(tmp_path / "torn", syncer=run.syncer)):
        with pytest.raises(RuntimeError, match="restore the last checkpoint"):
            call()
    assert not (tmp_path / "torn" / "humanline_state.json").exists()
    run.load(tmp_path)
    for x in xs[3:]:
        run.step(x)
    same_models(full, run)


def test_failure_before_start_changes_nothing():
    """A step that fails before start() (in the reference forward, say) can be retried as it is."""
    xs = data(6)
    full = Run(1)
    for x in xs:
        full.step(x)
    run = Run(1)
    for i, x in enumerate(xs):
        if i == 2:
            with pytest.raises(RuntimeError):
                with torch.no_grad():
                    run.ref(x[:, :4])  # a bad batch: fails before start()
            assert run.syncer.abort() is False
        run.step(x)
    same_models(full, run)


_KILLED = textwrap.dedent("""
    import os, sys, time, torch
    sys.path.insert(0, {tests!r})
    import test_resume_loop as L
    from humanline_kernels.sync import _state
    run = L.Run(2)
    xs = L.data(6)
    for x in xs[:3]:
        run.step(x)
    run.save({good!r})
    for x in xs[3:5]:
        run.step(x)

    def slow(path, tensors, file_meta):  # the process is killed in the middle of writing the file
        with open(path, "wb") as f:
            f.write(b"partial")
            f.flush()
            print("WRITING", flush=True)
            time.sleep(60)
    _state._write_tensors = slow
    run.save({bad!r})
""")


@pytest.mark.slow
def test_killed_while_writing(tmp_path):
    good, bad = str(tmp_path / "ckpt-3"), str(tmp_path / "ckpt-5")
    code = _KILLED.format(tests=os.path.dirname(os.path.abspath(__file__)), good=good, bad=bad)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "WRITING"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    names = sorted(os.listdir(bad))
    assert names[0] == "ckpt.pt" and names[1].startswith("humanline_reference.safetensors.tmp-")
    assert "humanline_state.json" not in names and "humanline_reference.safetensors" not in names
    run = Run(2)
    with pytest.raises(ValueError, match="humanline_state.json is missing"):
        hk.load_humanline_state(bad, syncer=run.syncer, check_policy=False)
    run.load(good)  # the previous checkpoint is whole
    assert run.syncer.step == 3


def test_bad_arguments():
    run = Run(1)
    with pytest.raises(ValueError, match="syncer= .* lookahead="):
        hk.save_humanline_state("x")
    with pytest.raises(ValueError, match="syncer must be"):
        hk.save_humanline_state("x", syncer=run.pol)
    with pytest.raises(ValueError, match="save_reference must be a bool"):
        hk.save_humanline_state("x", syncer=run.syncer, save_reference="yes")


def test_checkpoint_size_and_time(tmp_path):
    """The cost the docs quote: the reference's file is the size of the reference's tensors."""
    run = Run(1)
    run.step(data(1)[0])
    t = time.perf_counter()
    hk.save_humanline_state(tmp_path, syncer=run.syncer)
    assert time.perf_counter() - t < 10
    nbytes = sum(v.numel() * v.element_size() for v in run.ref.state_dict().values())
    size = os.path.getsize(tmp_path / "humanline_reference.safetensors")
    assert nbytes <= size <= nbytes + 4096
