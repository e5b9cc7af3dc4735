"""The canary: a tiny run of every objective whose per-step losses fingerprint the numerics behind the record.

It runs with the CPU's rounding pinned (ATen's scalar kernels, MKL's reproducible mode, one thread) and takes
seconds, where the record's runs take minutes; it goes through everything the table's numbers come from (data,
training, the package's losses and syncer, evaluation), so a change to any of it shows. The pinning does not make
every x86 CPU give the same bits: the record's canary and the same code's on an Intel family 6 model 106 differ by
up to 9e-7 relative in 11 of 18 runs' losses, although MKL's CNR SGEMM is the demo's only MKL call and neither
libm's FMA paths nor oneDNN change a bit here. So a record keeps the bits of each CPU model a canary was measured
on (exact there), and on another CPU the losses must be within ``RTOL``: 5x the round-off of MKL's other code
paths (``MKL_CBWR=AVX2``: 1.8e-6) and 6x below what a 1e-5 relative change of the learning rate moves them
(6.6e-5).
"""
from __future__ import annotations

import io
import json
import math
import os
import platform
import subprocess
import sys

from . import arms, experiment

SETTINGS = dict(steps=3, seeds=2, lrs=(3e-3,), sft_steps=3, eval_n=16, batch=8, sync_every=1, resample_every=2,
                pool_prompts=32)
ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "TRITON_INTERPRET": "0",
       "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
RTOL = 1e-5
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this copy's import root


def run():
    """A tiny run of each objective (``SETTINGS``), in this process: every arm's per-step losses, held-out and
    reported rule rates and clamped fraction, per learning rate and seed."""
    out = {}
    for objective in arms.OBJECTIVES:
        res = experiment.run(objective, **SETTINGS, device="cpu", workers=1, quiet=True, out=io.StringIO())
        out[objective] = {f"{r['arm']} lr {r['lr']:g} seed {r['seed']}": {k: r[k] for k in ("losses", "heldout",
                                                                                           "report", "clip_frac")}
                          for r in res["runs"]}
    return out


def run_subprocess():
    """:func:`run` in a fresh interpreter under ``ENV`` (the pinned rounding must be set before torch starts),
    from this copy of the package."""
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    p = subprocess.run([sys.executable, "-c", "import json; from humanline_kernels.demo import canary; "
                        "print(json.dumps(canary.run()))"], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=600)
    if p.returncode:
        raise RuntimeError(f"the demo's canary run failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def cpu_key():
    """The CPU model a canary ran on, as a record keys it: vendor, family and model from /proc/cpuinfo (Linux),
    else what :mod:`platform` says."""
    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                k, _, v = line.partition(":")
                fields.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    if all(k in fields for k in ("vendor_id", "cpu family", "model")):
        return f"{fields['vendor_id']} family {fields['cpu family']} model {fields['model']}"
    return f"{platform.machine()} {platform.processor() or 'unknown'}"


def differences(want, got, rtol=0.0):
    """The runs (``"objective arm lr L seed S"``) whose values differ between two canaries: in any bit (``rtol``
    0), or, with ``rtol``, floats beyond that relative difference (everything else must still be equal)."""
    def same(a, b):
        if isinstance(a, float) and isinstance(b, float):
            # losses near 0 (GRPO's first steps give ~1e-8) are held to rtol on the 1e-8 scale, not their own
            return a == b or math.isclose(a, b, rel_tol=rtol, abs_tol=rtol * 1e-8)
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(map(same, a, b))
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return a == b
    runs = {(o, k) for c in (want, got) for o in c for k in c[o]}
    return [f"{o} {k}" for o, k in sorted(runs) if not same(want.get(o, {}).get(k), got.get(o, {}).get(k))]


def check(record, now, cpu):
    """Whether the canary ``now``, measured on ``cpu`` (:func:`cpu_key`), says that the code still computes what
    ``record`` measured: ``("same", msg)`` for the bits of a canary in the record, ``("close", msg)`` on a CPU the
    record has no canary for when every loss is within ``RTOL`` of the record's, else ``("differ", msg)`` (on a
    CPU the record has a canary for, any bit)."""
    exact = {record.get("canary_cpu"): record["canary"], **record.get("canary_other_cpus", {})}
    for key, bits in exact.items():
        if now == bits:
            return "same", f"the canary's bits are those recorded for {key or 'the record CPU'}"
    if cpu in exact:
        diff = differences(exact[cpu], now)
        return "differ", (f"{len(diff)} canary runs differ from the bits recorded for this CPU ({cpu}), e.g. "
                          f"{diff[:3]}")
    diff = differences(record["canary"], now, RTOL)
    if diff:
        return "differ", (f"{len(diff)} canary runs differ from the record's by more than round-off (relative "
                          f"{RTOL:g}; this CPU, {cpu}, has no canary in the record), e.g. {diff[:3]}")
    return "close", (f"this CPU ({cpu}) has no canary in the record; its canary is within {RTOL:g} "
                     f"relative of the record's")
