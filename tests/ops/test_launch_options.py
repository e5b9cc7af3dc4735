"""Every Triton launch states the compiler options whose defaults Triton may change (fused multiply-adds: Triton 3.9
announces its default going to off in 3.10), so that an upgrade cannot change a result unseen.

The launches are those of the compile gate's cases (``tools/compile_gate.py --record-only``: the real launch
wrappers on ``meta`` tensors, recorded and not compiled, in a few seconds)."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools")


def test_every_launch_states_fp_fusion():
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(TOOLS), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, os.path.join(TOOLS, "compile_gate.py"), "--arch", "90", "--record-only"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rec = json.loads(out.stdout)
    assert {launch["kernel"] for launch in rec["launches"]} == set(rec["kernels"])  # every kernel was reached
    unstated = [launch for launch in rec["launches"] if launch["options"].get("enable_fp_fusion") is not True]
    assert not unstated, unstated[:5]
