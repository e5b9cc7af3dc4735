"""The benchmark CLI: ``python -m bench --help`` lists the suites and exits 0, a bad suite is a one-line error,
every suite writes to ``bench/out/`` by default (ignored by git) and prints what it wrote, and a missing
matplotlib is said, not silent."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow  # the benchmark suites' CPU runs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(*args):
    """The CLI in a subprocess that sees no GPU: these tests check flags and CPU smoke runs (on run 4's H200,
    ``bench gpu`` here did not refuse but ran every stage until the test's timeout)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "bench", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env=env)


def test_help_lists_every_suite():
    from bench.__main__ import SUITES
    r = _bench("--help")
    assert r.returncode == 0 and r.stderr == ""
    for name in SUITES:
        assert f"  {name} " in r.stdout
    assert set(SUITES) == {"logits", "linear", "sync", "host", "e2e", "checkpoint", "tune", "gpu", "report"}


@pytest.mark.parametrize("args", [(), ("nope",)])
def test_bad_suite_is_one_line(args):
    r = _bench(*args)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "python -m bench --help" in r.stderr


@pytest.mark.parametrize("suite", ["logits", "linear", "sync", "host", "e2e", "checkpoint", "tune", "gpu", "report"],
                         ids=lambda s: f"bench-{s}")  # (an id "gpu" would be the gpu marker's keyword: skipped)
def test_every_suites_bad_flag_is_one_line(suite):
    """bench/cli.py's parser in every program: a bad flag is one line on stderr, exit 2, no usage block."""
    r = _bench(suite, "--bogus")
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and f"python -m bench {suite} --help" in r.stderr, r.stderr


def test_gpu_suite_refuses_cpu_in_one_line():
    r = _bench("gpu")
    assert r.returncode == 2 and "needs a CUDA device" in r.stderr and "Traceback" not in r.stderr


def test_default_output_is_bench_out_for_every_suite():
    import argparse
    import importlib

    from bench.__main__ import SUITES
    for name, (mod, _) in SUITES.items():
        if name == "report":  # writes nothing but the generated pages (--readme)
            continue
        m = importlib.import_module(mod)
        seen = {}

        def fake_parse(self, args=None, namespace=None, _seen=seen):
            _seen.update({a.dest: a.default for a in self._actions})
            raise SystemExit(0)
        orig = argparse.ArgumentParser.parse_args
        argparse.ArgumentParser.parse_args = fake_parse
        try:
            with pytest.raises(SystemExit):
                m.main([])
        finally:
            argparse.ArgumentParser.parse_args = orig
        assert seen.get("out") == os.path.join("bench", "out"), (name, seen.get("out"))
    with open(os.path.join(ROOT, ".gitignore")) as f:
        assert "/bench/out/" in f.read().split()


def test_save_prints_paths_and_says_when_the_plot_is_skipped(tmp_path, monkeypatch, capsys):
    from bench import common
    rows = [{"impl": "a", "V": 1, "ratio": 1.0}, {"impl": "a", "V": 2, "ratio": 1.5}]
    common.save("t", rows, {}, str(tmp_path), x="V", y="ratio")
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 't.json'}" in out
    if common.pyplot() is not None:
        assert f"wrote {tmp_path / 't.png'}" in out and (tmp_path / "t.png").exists()
    monkeypatch.setattr(common, "pyplot", lambda: None)
    common.save("u", rows, {}, str(tmp_path), x="V", y="ratio")
    out = capsys.readouterr().out
    assert "no plot for u: matplotlib is not installed" in out and not (tmp_path / "u.png").exists()


def test_host_quick_runs(tmp_path, monkeypatch):
    """``python -m bench host --quick``: launches counted, CPU and device times recorded, JSON written."""
    import json

    from bench import bench_host
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert bench_host.main(["--quick", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "host_quick.json").read_text())
    rows, kernels = saved["rows"], saved["meta"]["kernels"]
    assert {r["impl"] for r in rows} >= {"token_logprobs", "fused.dpo", "fused_linear.grpo"}
    assert all(r["launches"] > 0 and r["cpu_ms"] > 0 and r["cpu_cold_ms"] > 0 for r in rows)
    # what was counted, by name: the counts add up to the launches, and a fused-linear call's GEMMs are among them
    assert all(sum(kernels[r["impl"]].values()) == r["launches"] for r in rows)
    assert any(n.startswith("aten::mm") for n in kernels["fused_linear.grpo"])
    assert all(r["syncs"] is None and r["gpu_drained_reps"] is None for r in rows)  # CUDA-only checks


def test_host_kernel_names_lose_their_template_arguments():
    from bench import bench_host
    assert bench_host._short("void cutlass::Kernel2<cutlass_80_tensorop<a, b<c>>>(Params)") == \
        "void cutlass::Kernel2(Params)"
    assert bench_host._short("Memset (Device)") == "Memset (Device)"
    assert len(bench_host._short("k" * 500)) == 90


@pytest.mark.gpu
def test_host_harness_sees_a_sync_and_a_drained_queue():
    """``bench host``'s own checks on a GPU: a call that reads a value back syncs, one that only enqueues does not;
    with nothing queued ahead the GPU is idle when a tiny call returns."""
    from bench import bench_host
    x = torch.ones(4, device="cuda")
    assert bench_host._syncs(lambda: x.sum().item(), "cuda") is True
    assert bench_host._syncs(lambda: x * 2, "cuda") is False
    _, _, drained = bench_host._cpu_ms(lambda: torch.cuda.synchronize(), "cuda", reps=3)
    assert drained == 3


def test_host_proxy_runs_and_refuses_bad_flags(tmp_path):
    """``python -m bench host --proxy``: every entry point timed against the floor of the same run, each with the
    design's target where one applies; a non-positive ``--calls`` is a one-line error."""
    import json

    from bench import bench_host
    assert bench_host.main(["--proxy", "--calls", "2", "--repeats", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "host_proxy.json").read_text())
    rows = {r["impl"]: r for r in data["rows"]}
    assert {"floor", "token_logprobs", "fused.grpo", "fused.dpo", "fused.kto", "fused_linear.grpo"} <= set(rows)
    assert data["meta"]["floor_us"] > 0 and all(r["ratio"] > 0 for r in rows.values())
    assert rows["fused.grpo"]["target"] == 1.5 and rows["fused.grpo(validate)"]["target"] == pytest.approx(1.9)
    assert rows["fused_linear.grpo"]["target"] == 2.5 and rows["floor"]["target"] is None
    assert rows["floor(summed)"]["ratio"] == 1.0 and rows["token_logprobs"]["floor"] == "floor(summed)"
    assert rows["fused.grpo"]["floor"] == "floor" and rows["python lower bound (grpo)"]["target"] is None
    for flags in (("--proxy", "--calls", "0"), ("--triton",)):
        r = _bench("host", *flags)
        assert r.returncode == 2 and len([ln for ln in r.stderr.splitlines() if "error:" in ln]) == 1
        assert "Traceback" not in r.stderr


def test_linear_masks_quick_runs_and_refuses_bad_flags(tmp_path, monkeypatch):
    """``python -m bench linear --ignored``: ours dense and supervised and the peers at each mask against one dense
    floor, the target recorded; a percentage outside [0, 100) is a one-line error."""
    import json

    from bench import bench_linear
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the eager CPU path: the smoke run, not the interpreter
    assert bench_linear.main(["--quick", "--ignored", "0", "50", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "linear_masks_quick.json").read_text())
    rows = data["rows"]
    assert {r["ignored_pct"] for r in rows} == {0, 50}
    for pct in (0, 50):
        names = {r["impl"] for r in rows if r["ignored_pct"] == pct and r["ms"]}
        assert {"lm_head_gemm_fwd_bwd", "ours_dpo", "ours_dpo(supervised)", "ours_grpo(supervised)"} <= names
    assert data["meta"]["target"] == {"impl": "ours_dpo(supervised)", "ignored_pct": 50, "ratio_to_gemm": 0.55}
    assert data["meta"]["timing"]["rounds"] == 2 and all(r["spread_pct"] is not None for r in rows if r["ms"])
    r = _bench("linear", "--quick", "--ignored", "100")
    assert r.returncode == 2 and len([ln for ln in r.stderr.splitlines() if "error:" in ln]) == 1
    assert "Traceback" not in r.stderr


def test_linear_rows_are_timed_in_interleaved_rounds_after_a_warm_and_a_peak_call(monkeypatch):
    """``bench linear``'s rows: each case runs once in turn (a warm call and, on CUDA, a peak-memory call; a case that
    raises gets its note and is not timed), then the runnable ones, the floor among them, in rounds that run every
    row in turn, so that the ratio to the floor is not one timed call against another (``do_bench(rep=20)`` at ~37 ms
    a call timed one call a row: run 11's floor 36.6 and 38.3 ms in two stages)."""
    from bench import bench_linear
    monkeypatch.setattr(bench_linear, "TIMING", (3, 2))
    order = []

    def fails():
        order.append("bad")
        raise RuntimeError("no kernel")
    cases = {"lm_head_gemm_fwd_bwd": lambda: order.append("floor"), "ours_dpo": lambda: order.append("ours"),
             "peer": "unavailable: not installed", "broken": fails}
    h, w = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    rows = {r["impl"]: r for r in bench_linear._time_cases(cases, h, w, quick=False)}
    # (on the CPU there is no peak-memory call: ``common.peak_extra_bytes`` is None without CUDA)
    assert order == ["floor", "ours", "bad"] + ["floor", "ours"] + ["floor", "floor", "ours", "ours"] * 3
    assert rows["lm_head_gemm_fwd_bwd"]["ratio_to_gemm"] == 1 and rows["ours_dpo"]["ms"] > 0
    assert rows["ours_dpo"]["spread_pct"] >= 0 and rows["ours_dpo"]["ratio_to_gemm"] > 0
    assert rows["peer"]["ms"] is None and rows["peer"]["note"] == "unavailable: not installed"
    assert rows["broken"]["ms"] is None and rows["broken"]["note"] == "failed: RuntimeError: no kernel"


def test_linear_profile_quick_lists_each_rows_work_and_refuses_unknown_rows(tmp_path, monkeypatch):
    """``python -m bench linear --profile``: each named row's work per call, a total row first that sums the rest;
    a row that is not in the table is a one-line error naming the rows there are."""
    import json

    from bench import bench_linear
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert bench_linear.main(["--quick", "--profile", "ours_dpo", "lm_head_gemm_fwd_bwd", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "linear_profile_quick.json").read_text())["rows"]
    for impl in ("ours_dpo", "lm_head_gemm_fwd_bwd"):
        mine = [r for r in rows if r["impl"] == impl]
        assert mine[0]["kernel"].startswith("(all ") and len(mine) > 1
        assert mine[0]["ms_per_call"] == pytest.approx(sum(r["ms_per_call"] for r in mine[1:]))
    assert any(r["kernel"] == "aten::mm" and r["per_call"] == 3 for r in rows if r["impl"] == "lm_head_gemm_fwd_bwd")
    r = _bench("linear", "--quick", "--profile", "nope")
    assert r.returncode == 2 and "error: --profile: no runnable row ['nope']" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("interp", ["1", "0"], ids=["interpreter", "eager"])
def test_gpu_parity_stage_runs_on_a_small_cpu_shape(interp, monkeypatch):
    """``bench gpu``'s parity stage (every fused path, packed batches and the supervised tokens included, against
    hk.reference) is code a GPU session runs unseen: run it here on a small shape so it cannot fail for a typo."""
    from bench import bench_gpu
    monkeypatch.setenv("TRITON_INTERPRET", interp)
    rows = bench_gpu.parity(N=64, V=50, D=16, device="cpu")
    names = {r["case"] for r in rows}
    assert {"fused.dpo packed (host cu)", "fused.grpo packed grad_in_forward (device cu)",
            "fused_linear.dpo supervised D=16 (grad wrt weight)"} <= names
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad


def test_gpu_stage_is_killed_at_its_budget_with_its_children(tmp_path):
    """bench gpu's stage runner kills a silent command and the processes it started (pytest-xdist workers, spawned
    ranks) at the budget, not at the next line of output."""
    import io
    import time

    from bench import bench_gpu
    pidfile = tmp_path / "child"
    code = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pidfile)!r}, 'w').write(str(c.pid)); print('started', flush=True); time.sleep(60)")
    t0 = time.time()
    rc, tail = bench_gpu._sub([sys.executable, "-c", code], io.StringIO(), timeout=3)
    assert time.time() - t0 < 30 and rc != 0
    assert tail == ["started", "killed after 3 s"]
    child = int(pidfile.read_text())
    for _ in range(50):  # the child was SIGKILLed with its group; wait until the kernel has reaped or marked it
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        try:
            if open(f"/proc/{child}/stat").read().split()[2] == "Z":
                break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the stage's child process outlived the kill")


def test_failures_are_logged_as_they_happen(tmp_path, monkeypatch):
    """``HK_FAILURE_LOG``: each failure's traceback appended when reported (a suite killed at its cap keeps them),
    once (the xdist controller writes, its workers do not), long ones cut to their end; passes write nothing."""
    import types

    import conftest
    log = tmp_path / "failures.log"
    monkeypatch.setenv("HK_FAILURE_LOG", str(log))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)

    def rep(nodeid, failed, text):
        return types.SimpleNamespace(nodeid=nodeid, when="call", failed=failed, longreprtext=text)
    conftest.pytest_runtest_logreport(rep("tests/a.py::ok", False, ""))
    conftest.pytest_runtest_logreport(rep("tests/a.py::bad", True, "E   AssertionError: 2.8e-5"))
    conftest.pytest_runtest_logreport(rep("tests/a.py::long", True, "x" * 9000 + "E   the reason"))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    conftest.pytest_runtest_logreport(rep("tests/a.py::twice", True, "reported by the controller instead"))
    text = log.read_text()
    assert "=== tests/a.py::bad (call)\nE   AssertionError: 2.8e-5" in text
    assert "E   the reason" in text and len(text) < 7000
    assert "::ok" not in text and "::twice" not in text


def _worktrees():
    out = subprocess.run(["git", "worktree", "list", "--porcelain"], cwd=ROOT, capture_output=True, text=True)
    return {line.split(" ", 1)[1] for line in out.stdout.splitlines() if line.startswith("worktree ")}


def test_logits_baseline_refuses_a_ref_git_does_not_know():
    before = _worktrees()
    r = _bench("logits", "--quick", "--baseline", "no-such-ref-of-ours")
    assert r.returncode == 2 and r.stdout == "" and "not a commit of this repository" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert _worktrees() == before


def test_logits_baseline_times_the_ref_in_a_worktree_it_removes(tmp_path, monkeypatch):
    """``--baseline REF``: the ref's own ``bench logits`` in a worktree of it (its hk rows, named ``NAME @REF``, after
    this version's), the worktree gone afterwards, also when the ref's run fails."""
    from bench import bench_logits
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the CPU smoke times the eager paths
    before = _worktrees()
    rows = bench_logits.baseline_rows("HEAD", 8, [40], quick=True, only=["hk.token_logprobs"])
    assert rows and {r["impl"] for r in rows} <= {"hk.token_logprobs @HEAD", "hk.token_logprobs(inplace) @HEAD"}
    assert all("ms" in r and r["V"] == 40 for r in rows)
    assert _worktrees() == before
    with pytest.raises(bench_logits.BaselineError, match="its bench logits failed"):
        bench_logits.baseline_rows("HEAD", 8, [0], quick=True, only=["nothing"])  # V = 0: the ref's run fails
    assert _worktrees() == before
    r = _bench("logits", "--quick", "--n", "8", "--vocab", "40", "--only", "hk.token_logprobs", "--baseline", "HEAD",
               "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    impls = {row["impl"] for row in json.loads((tmp_path / "logits_quick.json").read_text())["rows"]}
    assert {"hk.token_logprobs", "hk.token_logprobs @HEAD"} <= impls, impls
    assert _worktrees() == before


@pytest.mark.parametrize("args, says", [(("report",), "give at least one run folder"),
                                        (("report", "bench/results/nope"), "no run folder"),
                                        (("report", "--check", "nope.md"), "no page at"),
                                        (("report", "--bogus"), "unrecognized arguments")])
def test_report_bad_flags_are_one_line(args, says):
    r = _bench(*args)
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and says in r.stderr, r.stderr


def test_report_prints_each_section_from_the_newest_run_that_has_it(tmp_path):
    """Each section from the first run given that holds its JSON, with the card and the versions; a section no
    run holds says so. ``--check`` passes on the pages as committed and fails, with a diff, on an edited copy."""
    from bench import report
    runs = ["bench/results/2026-11-26-h200", "bench/results/2026-11-26-h100"]
    text = report.render(runs)
    logits, linear = text.index("**Logits path**"), text.index("**Fused linear**")
    assert "NVIDIA H200" in text[logits:linear] and "`bench/results/2026-11-26-h200`" in text[logits:linear]
    assert "NVIDIA H100" in text[linear:] and "`bench/results/2026-11-26-h100`" in text[linear:]
    assert "torch 2.11.0+cu130, triton 3.6.0" in text and "TRL 1.16.0" in text
    assert "**End to end**: not measured in" in text  # no run holds e2e.json yet
    assert "| `liger triton_grpo_loss` |" in text and "| `hk.fused.grpo` |" in text  # ours beside the peers
    r = _bench("report", *runs)
    assert r.returncode == 0 and r.stdout.strip() == text
    assert _bench("report", "--check").returncode == 0
    with open(os.path.join(ROOT, "docs", "benchmarks.md"), encoding="utf-8") as f:
        page = f.read()
    edited = tmp_path / "benchmarks.md"
    edited.write_text(page.replace("| `hk.fused.dpo` |", "| `hk.fused.dpo` | 0.1 |", 1), encoding="utf-8")
    r = _bench("report", "--check", str(edited))
    assert r.returncode == 1 and "generated blocks differ" in r.stderr and "+| `hk.fused.dpo`" in r.stdout


def test_checkpoint_cost_runs_and_refuses_bad_flags(tmp_path):
    """``python -m bench checkpoint``: the humanline checkpoint holds the reference's bytes on top of the stock
    one's, save_reference=False holds none; a non-positive size is a one-line error."""
    import json

    from bench import bench_checkpoint
    assert bench_checkpoint.main(["--hidden", "32", "--layers", "1", "--vocab", "64", "--repeat", "1",
                                  "--out", str(tmp_path)]) == 0
    rows = {r["arm"]: r for r in json.loads((tmp_path / "checkpoint.json").read_text())["rows"]}
    ref_mib = rows["humanline"]["humanline_mib"]
    assert ref_mib > 0 and rows["save_reference=False"]["humanline_mib"] < 0.01
    assert rows["humanline"]["checkpoint_mib"] == pytest.approx(rows["stock (humanline=False)"]["checkpoint_mib"]
                                                                + ref_mib, rel=0.01)
    r = _bench("checkpoint", "--hidden", "0")
    assert r.returncode == 2 and len([ln for ln in r.stderr.splitlines() if "error:" in ln]) == 1
    assert "Traceback" not in r.stderr


def test_checkpoint_checksums_cost_runs(tmp_path):
    """``python -m bench checkpoint --checksums``: a save and a load per reference dtype, the CRC-32 part of each
    timed inside them (it ran: a positive part of the whole) over a bf16 file half the fp32 one."""
    import json

    from bench import bench_checkpoint
    assert bench_checkpoint.main(["--checksums", "--hidden", "32", "--layers", "1", "--vocab", "64", "--repeat", "1",
                                  "--out", str(tmp_path)]) == 0
    rows = {r["reference"]: r for r in json.loads((tmp_path / "checkpoint_checksums.json").read_text())["rows"]}
    assert set(rows) == {"float32", "bfloat16"}
    for r in rows.values():
        assert 0 < r["save_crc_s"] < r["save_s"] and 0 < r["load_crc_s"] < r["load_s"]
    assert rows["bfloat16"]["file_mib"] == pytest.approx(rows["float32"]["file_mib"] / 2, rel=0.1)


def test_interleaved_rows_alternate_in_rounds():
    """``bench sync``'s overlap rows and ``bench linear``'s rows are timed in rounds that run every row in turn (after
    one warm-up call each), not one row after another: run 10 measured the chain alone 0.8 % slower at the end of a
    sequential table."""
    from bench import common
    order = []
    fns = {k: (lambda k=k: order.append(k)) for k in "abc"}
    ms, by_round = common.interleaved(fns, "cpu", rounds=3, calls=2)
    assert order == list("abc") + list("aabbcc") * 3
    assert set(ms) == set("abc") and all(len(v) == 3 for v in by_round.values())


def test_call_ms_puts_an_event_pair_around_each_call(monkeypatch):
    """``common.call_ms``'s CUDA branch (bench e2e's steps, bench sync's rounds) on a CPU machine, with events that
    log: a start and an end recorded around each call in order, one synchronize after the last, elapsed times read
    pairwise. A slip here would cost a GPU run its e2e and sync stages."""
    from types import SimpleNamespace

    from bench import common
    log = []

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing
            self.t = None

        def record(self):
            self.t = len(log)
            log.append("record")

        def elapsed_time(self, end):
            return float(end.t - self.t)

    monkeypatch.setattr(common.torch, "cuda", SimpleNamespace(Event=Event, synchronize=lambda: log.append("sync")))
    ms = common.call_ms([lambda k=k: log.append(f"call{k}") for k in range(3)], "cuda")
    assert log == [
        "record", "call0", "record", "record", "call1", "record", "record", "call2", "record", "sync"]
    assert ms == [2.0, 2.0, 2.0]
