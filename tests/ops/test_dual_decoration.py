"""Kernels are decorated twice (``humanline_kernels.ops._jit``): a GPU machine imports Triton without
``TRITON_INTERPRET`` (so Triton's own ``tl.max``/``tl.sum`` are compiled-kind objects) and still runs the
interpreted twins for CPU tensors. That set-up is reproduced here in a child process, on CPU."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CHILD = r"""
import json, os
os.environ.pop("TRITON_INTERPRET", None)
import triton, triton.language as tl, torch
from triton.runtime.jit import JITFunction
import humanline_kernels as hk
from humanline_kernels import ops
from humanline_kernels.ops import _jit
assert isinstance(tl.max, JITFunction)  # Triton's standard library in compiled form, as on a GPU machine
ops.INTERPRET_CPU_DEFAULT = True  # what tests/conftest.py does on a GPU machine
spaces = {"tl": tl, "tl.core": tl.core, "tl.tensor": tl.core.tensor, "tl.math": tl.math, "tl.standard": tl.standard}
before = {k: dict(vars(ns)) for k, ns in spaces.items()}
g = torch.Generator().manual_seed(0)
x = torch.randn(3, 5, 300, generator=g, requires_grad=True)
y = torch.randint(0, 300, (3, 5), generator=g)
ref = torch.randn(3, 5, generator=g) - 5.0
adv = torch.randn(3, generator=g)
errs = {}
lp = hk.token_logprobs(x, y)
errs["logp"] = (lp - hk.reference.token_logprobs(x, y)).abs().max().item()
loss = hk.fused.grpo(x, y, ref, adv, beta=0.04, grad_in_forward=True)[0]
xr = x.detach().requires_grad_()
lr = hk.reference.grpo(hk.reference.token_logprobs(xr, y), ref, adv, y != -100, beta=0.04)[0]
errs["grpo"] = abs(loss.item() - lr.item())
errs["grad"] = (torch.autograd.grad(loss, x)[0] - torch.autograd.grad(lr, xr)[0]).abs().max().item()
leaked = sorted(f"{k}.{n}" for k, ns in spaces.items() for n, v in vars(ns).items()
                if n in before[k] and before[k][n] is not v)  # replaced; added names are the interpreter's own
print(json.dumps({"errs": errs, "paths": sorted({p for p, _ in _jit.LAUNCHES}),
                  "tl_max_restored": isinstance(tl.max, JITFunction), "leaked": leaked}))
"""


def test_interpreted_twins_run_when_triton_was_imported_for_the_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["paths"] == ["interpreted"], res
    assert res["tl_max_restored"], "the interpreter's patches leaked out of the launch"
    # its device-function calls (helpers, tl.max's body) patch triton.language and never restore it: before the
    # fix 61-64 builtins of tl.core (where, maximum, load, ...) stayed the interpreter's after these launches
    assert res["leaked"] == [], res["leaked"]
    assert all(v < 1e-4 for v in res["errs"].values()), res


def test_interpreter_without_numpy_says_so(monkeypatch):
    """TRITON_INTERPRET=1 on a machine without NumPy: a clear error naming it, not a silent eager fallback."""
    import torch

    import humanline_kernels as hk
    from humanline_kernels import ops
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(ops, "_numpy_available", lambda: False)
    with pytest.raises(ModuleNotFoundError, match="needs NumPy: pip install numpy"):
        hk.token_logprobs(torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long))
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the eager path needs no NumPy
    assert hk.token_logprobs(torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long)).shape == (2, 3)


def test_interpreted_launch_patches_the_language_once_per_namespace_set(monkeypatch):
    """Triton patches ``triton.language`` again on every device-function call (a helper, ``tl.max``'s body), about
    2 ms each, half of an interpreted launch before ``_jit`` kept one patch per launch: the patch count of a call
    does not grow with its rows (programs), each of which calls helpers."""
    import torch
    from triton.runtime import interpreter as interp

    import humanline_kernels as hk
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    hk.token_logprobs(torch.randn(1, 1, 40), torch.zeros(1, 1, dtype=torch.long))  # the one-time set-up first
    original, counts = interp._patch_builtin, []

    def counted(*args):
        counts[-1] += 1
        return original(*args)
    monkeypatch.setattr(interp, "_patch_builtin", counted)
    for rows in (1, 9):
        counts.append(0)
        x = torch.randn(rows, 1, 40, requires_grad=True)
        hk.token_logprobs(x, torch.zeros(rows, 1, dtype=torch.long)).sum().backward()
    assert 0 < counts[0] == counts[1], counts
