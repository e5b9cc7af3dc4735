"""The public API fuzzed (issue 52): ``tools/fuzz_api.py`` draws cases with hypothesis (a fixed seed and example
budget) and checks each against ``hk.reference`` (valid calls), a ValueError naming the argument before any kernel
runs (corrupted ones), and, always, untouched inputs and guard elements. It runs in a subprocess: a case that
crashes the process (an abort, a segfault, a CUDA fault) fails this test naming the case, instead of killing the
pytest worker.

Budgets: ``HK_FUZZ_EXAMPLES`` cases (CI: 1000, about 35 s on one core of the CI machine, a minute when it is busy),
or ``HK_FUZZ_PROFILE=long`` (5000 cases and another seed, by hand: about 3 min). On a GPU,
``test_fuzz_public_api_cuda`` runs the compiled kernels with ``CUDA_LAUNCH_BLOCKING=1``, and a sample under
``compute-sanitizer --tool memcheck`` when the image has it. A failing case replays with
``python tools/fuzz_api.py --replay '<its JSON line>'``.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("hypothesis")

pytestmark = pytest.mark.slow  # a thousand drawn cases

HERE = os.path.dirname(os.path.abspath(__file__))
LONG = os.environ.get("HK_FUZZ_PROFILE") == "long"
EXAMPLES = int(os.environ.get("HK_FUZZ_EXAMPLES", 5000 if LONG else 1000))
SEED = 520 if LONG else 52


def _fuzz(tmp_path, *extra, env=None, timeout=900, prefix=()):
    """Runs the worker; returns its summary (cases run, by level, loss and outcome)."""
    log = tmp_path / "cases.jsonl"
    cmd = [*prefix, sys.executable, os.path.join(os.path.dirname(HERE), "tools", "fuzz_api.py"), "--seed", str(SEED),
           "--log", str(log), *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]),
           **(env or {})}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = log.read_text().splitlines() if log.exists() else []
    summary = [ln for ln in p.stdout.splitlines() if ln.startswith("FUZZ ")]
    if p.returncode != 0:
        if p.returncode < 0 or not summary:  # killed by a signal, or died before its summary: a crash
            raise AssertionError(f"the fuzz worker crashed (exit {p.returncode}) in the case\n  "
                                 f"{lines[-1] if lines else '(none logged)'}\nreplay: python tools/fuzz_api.py "
                                 f"--replay '<that line>'\n{p.stderr[-3000:]}")
        raise AssertionError(f"a fuzz case failed (hypothesis' report below; its last case: "
                             f"{lines[-1] if lines else ''})\n{p.stdout[-6000:]}\n{p.stderr[-6000:]}")
    return json.loads(summary[-1][len("FUZZ "):])


def _report(capsys, name, summary):
    by = {}
    for key, n in summary["counts"].items():
        outcome = key.rsplit(": ", 1)[1]
        by[outcome] = by.get(outcome, 0) + n
    with capsys.disabled():
        print(f"\n{name}: {summary['cases']} cases ({', '.join(f'{k} {v}' for k, v in sorted(by.items()))})")


def test_fuzz_public_api(tmp_path, capsys):
    summary = _fuzz(tmp_path, "--examples", str(EXAMPLES), timeout=3600 if LONG else 900)
    _report(capsys, "fuzz (CPU: Triton interpreter and eager paths)", summary)
    assert summary["cases"] == EXAMPLES
    outcomes = {key.rsplit(": ", 1)[1] for key in summary["counts"]}
    assert {"ok", "refused", "unchecked"} <= outcomes, summary  # every oracle was exercised
    assert "interpreted" in summary["launch_paths"], summary  # the Triton kernels ran, in the interpreter


@pytest.mark.gpu
def test_fuzz_public_api_cuda(tmp_path, capsys):
    """The same fuzz on the compiled kernels, each launch synchronous (a fault is named by its case); the value
    checks that are device-side asserts on CUDA are left out (they end the context), their validate=False twins
    run. With compute-sanitizer on the image, a sample of the cases runs under its memcheck as well."""
    n = int(os.environ.get("HK_FUZZ_EXAMPLES", 5000 if LONG else 300))  # (each new shape compiles its kernels)
    summary = _fuzz(tmp_path, "--device", "cuda", "--examples", str(n), env={"CUDA_LAUNCH_BLOCKING": "1"},
                    timeout=3600 if LONG else 540)
    _report(capsys, "fuzz (CUDA, compiled kernels)", summary)
    assert summary["cases"] == n
    assert "compiled" in summary["launch_paths"] and "interpreted" not in summary["launch_paths"], summary
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        pytest.skip("compute-sanitizer is not on this image (the CUDA_LAUNCH_BLOCKING run above passed)")
    # the sample: cases of the run above that launch kernels, the validate=False ones with malformed layouts first
    # (run 5 drew 4 fresh cases instead, all refused before any kernel: a sanitizer run that checked nothing)
    k = int(os.environ.get("HK_FUZZ_SANITIZER_EXAMPLES", "20"))
    cases = [json.loads(line) for line in (tmp_path / "cases.jsonl").read_text().splitlines()]
    launching = [c for c in cases if c["entry"] != "syncer" and c["level"] != "losses"
                 and (c["corrupt"] is None or c["corrupt"].startswith("unchecked"))]
    launching.sort(key=lambda c: c["corrupt"] is None)
    chosen = tmp_path / "sample.jsonl"
    chosen.write_text("".join(json.dumps(c) + "\n" for c in launching[:k]))
    sample = _fuzz(tmp_path, "--device", "cuda", "--cases", str(chosen),
                   prefix=(sanitizer, "--tool", "memcheck", "--error-exitcode", "99"), timeout=3600 if LONG else 540)
    _report(capsys, "fuzz under compute-sanitizer memcheck", sample)
    assert sample["cases"] == min(k, len(launching)) > 0, sample
    assert "compiled" in sample["launch_paths"], sample
