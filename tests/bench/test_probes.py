"""The prepared GPU probes (bench/probes/): gif_split.py's kernels compute what they claim under the Triton
interpreter, and gif_cluster.cu builds for sm_90a without spills (nvcc). Their timing and their cross-program
synchronisation are a GPU's to check."""
import os
import shutil
import sys

import pytest
import torch

triton = pytest.importorskip("triton")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench",
                                "probes"))
import gif_cluster  # noqa: E402
import gif_split  # noqa: E402

pytestmark = pytest.mark.slow  # the GPU probes' CPU checks

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs under TRITON_INTERPRET=1")


def _inputs(N=5, V=3000):
    torch.manual_seed(0)
    x = (torch.randn(N, V) * 3).bfloat16()
    y = torch.randint(0, V, (N,), dtype=torch.int32)
    y[0] = V - 1  # the label in the last, partial chunk
    return x, y, torch.randn(N) * 0.1 - 2


def _check(out, logp, x, y, r):
    g_ref, lp_ref = gif_split.reference(x, y, r, 0.8, 1 / 0.7)
    # the bf16 gradient: one rounding, which the interpreter does by truncation (a bf16 ulp, 2^-7 relative)
    torch.testing.assert_close(out.float(), g_ref, rtol=2**-7, atol=1e-30)
    torch.testing.assert_close(logp, lp_ref, rtol=0, atol=1e-5)


@interpreted
def test_split_one_chunk_and_two_sweep_against_torch():
    x, y, r = _inputs()
    cnt = torch.zeros(x.shape[0], dtype=torch.int32)
    for gen in (1, 2):  # C = 1: the program waits on itself only; the second launch on the same counters
        out, logp, err = gif_split.split(x, y, r, 0.8, 1 / 0.7, 4096, 4, cnt=cnt, gen=gen)
        assert err.item() == 0 and (cnt == gen).all()
        _check(out, logp, x, y, r)
    _check(*gif_split.two_sweep(x, y, r, 0.8, 1 / 0.7, block=256), x, y, r)


@interpreted
@pytest.mark.parametrize("chunk", [256, 512, 1024])  # C = 12, 6, 3: not powers of two
def test_split_combines_the_chunks(chunk):
    """The interpreter runs programs one after another, so a row's first program would wait for ever on the others:
    the counters start high (nobody waits) and the kernel runs twice; the second run combines the partials that
    every program of the first published."""
    x, y, r = _inputs()
    N, V = x.shape
    C = triton.cdiv(V, chunk)
    out, logp = torch.zeros_like(x), torch.empty(N)
    ws, err = torch.full((N * C * 2,), float("nan")), torch.zeros(1, dtype=torch.int32)
    for _ in range(2):
        cnt = torch.full((N,), 1 << 20, dtype=torch.int32)
        gif_split._split_kernel[(N * C,)](x, y, r, 0.8, out, logp, ws, cnt, err, V, 1 / 0.7, C, C=C,
                                          CP=triton.next_power_of_2(C), CHUNK=chunk, num_warps=4)
        assert (cnt == (1 << 20) + C).all()  # each program counted itself in once
    assert err.item() == 0
    _check(out, logp, x, y, r)


@pytest.mark.skipif(not shutil.which("nvcc"), reason="needs nvcc")
def test_cluster_probe_builds_for_sm90a_without_spills(tmp_path):
    cubin, log = gif_cluster.build(str(tmp_path))  # the probe's own nvcc call (it raises if nvcc fails)
    assert os.path.getsize(cubin) > 0
    for cl, threads in gif_cluster.CONFIGS:  # every configuration the probe launches is in the cubin
        assert f"gif_cluster_{cl}_{threads}" in log
    assert log.count("0 bytes spill stores, 0 bytes spill loads") == len(gif_cluster.CONFIGS), log


def test_e2e_gap_quick_takes_each_difference_away(monkeypatch, capsys):
    """e2e_gap.py (prepared for the next GPU run) on the CPU smoke size: every variant runs, the copy taken away
    leaves the reference at theta_0 (sync_ce-copy's step-2 loss is offline_ref's, sync_ce's is not), and the
    reference-forward timing runs on both sets of weights."""
    monkeypatch.syspath_prepend(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the harness is under test, not the kernels: the eager paths
    import e2e_gap
    res = e2e_gap.main(["--quick", "--steps", "1"])
    assert set(res["ms"]) == {"offline_ref", "offline_ref+clip", "lookahead", "lookahead-clip", "sync_ce",
                              "sync_ce-copy", "offline_ref, no mask sync", "lookahead, no mask sync",
                              "sync_ce, no mask sync", "lookahead, no mode switch", "offline_ref (again)"}
    assert res["loss"]["sync_ce-copy"] == res["loss"]["offline_ref"] == res["loss"]["offline_ref (again)"]
    # without the packed-sequence check (transformers' host sync) the unpacked batches give the same losses
    for arm in ("offline_ref", "lookahead", "sync_ce"):
        assert res["loss"][f"{arm}, no mask sync"] == res["loss"][arm]
    assert res["loss"]["lookahead, no mode switch"] == res["loss"]["lookahead"]  # no dropout in the e2e model
    assert set(res["smi"].values()) == {None}  # no nvidia-smi sampling on the CPU
    assert res["loss"]["sync_ce"] != res["loss"]["offline_ref"]
    assert res["loss"]["lookahead"] == pytest.approx(res["loss"]["sync_ce"], abs=1e-5)
    assert set(res["reference_forward_ms"]) == {"theta_0", "trained", "theta_0 again"}
    assert "reference forward ms by weights" in capsys.readouterr().out


def test_e2e_models_forward_asks_transformers_for_packed_sequences(monkeypatch):
    """e2e_gap.py's "no mask sync" variants take away a host sync by replacing
    ``transformers.masking_utils.find_packed_sequence_indices`` (run 10: two synchronizing calls a step, there).
    That only means something while bench e2e's forward calls it: a transformers that stops calling it (or renames
    it) fails here, not silently in a GPU run."""
    from types import SimpleNamespace

    from transformers import masking_utils

    from bench import bench_e2e as E
    calls = []
    orig = masking_utils.find_packed_sequence_indices

    def spy(position_ids):
        calls.append(position_ids.shape)
        return orig(position_ids)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", spy)
    E.torch = torch
    a = SimpleNamespace(**dict(E.QUICK, supervised=False))
    model = E._policy(a, "cpu", torch.float32)
    ids = E._batches(a, "cpu")[0][0]
    with torch.no_grad():
        E._hidden(model, ids)
    assert calls == [torch.Size([a.batch, a.seq])]
    assert orig(torch.arange(a.seq).expand(a.batch, -1)) is None  # unpacked rows: None, what the variants return


def test_e2e_profile_quick_compares_the_two_arms(monkeypatch, tmp_path):
    """e2e_profile.py (run 10's kernel-level profile) on the CPU smoke size: both arms profiled, the step
    annotations kept out of the work (they span the step: counted, they would hide its idle time), JSON written."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    import e2e_profile
    res = e2e_profile.main([str(tmp_path), "--quick", "--steps", "1"])
    assert set(res["arms"]) == {"offline_ref", "lookahead"}
    for r in res["arms"].values():
        assert 0 < r["busy_ms"] <= r["span_ms"] and r["kernels_a_step"] > 0
    assert not any(n.startswith("hk_step_") for n in res["top_kernel_diffs_ms"])
    assert (tmp_path / "profile.json").exists()
    # on a GPU the step annotation is a CUDA-timeline event too: it is not work
    from types import SimpleNamespace
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    evs = [SimpleNamespace(name="hk_step_0", device_type=cuda, cpu_children=[]),
           SimpleNamespace(name="nvjet_sm90_gemm", device_type=cuda, cpu_children=[]),
           SimpleNamespace(name="aten::mm", device_type=cpu, cpu_children=[])]
    assert [e.name for e in e2e_profile.work(evs, True)] == ["nvjet_sm90_gemm"]
    assert [e.name for e in e2e_profile.work(evs, False)] == ["nvjet_sm90_gemm", "aten::mm"]
