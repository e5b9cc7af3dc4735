"""The call path of every public loss: one Triton-or-eager decision, the eager path outside the ``humanline``
custom ops, the kernel path at most three hops (in at most three files) from the public function to each launch,
forward and backward, and the custom ops entered only while ``torch.compile`` traces."""
import inspect
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import humanline_kernels as hk
from humanline_kernels import ops
from humanline_kernels.ops import _jit

PKG = os.path.dirname(hk.__file__)
SHIM = os.path.join(PKG, "ops", "_jit.py")  # the launcher's twin picker and the custom-op shim: plumbing


class _Namespaces(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func.namespace)
        return func(*args, **(kwargs or {}))


def _calls():
    g = torch.Generator().manual_seed(0)
    B, T, V, D = 4, 5, 33, 8
    x = torch.randn(B, T + 1, V, generator=g, requires_grad=True)
    y = torch.randint(0, V, (B, T), generator=g)
    ref = torch.randn(B, T, generator=g) - 3
    adv = torch.randn(B, generator=g)
    des = torch.tensor([True, False, True, False])
    h = torch.randn(B, T, D, generator=g, requires_grad=True)
    w = torch.randn(V, D, generator=g, requires_grad=True)
    kl = (ref, ref - 0.2, y != -100)
    m = y != -100
    lp = torch.randn(B, T, generator=g, requires_grad=True)
    return {
        "token_logprobs": lambda: hk.token_logprobs(x[:, :-1], y).sum(),
        "fused.grpo": lambda: hk.fused.grpo(x[:, :-1], y, ref, adv, beta=0.04)[0],
        "fused.grpo(grad_in_forward)": lambda: hk.fused.grpo(x[:, :-1], y, ref, adv, grad_in_forward=True)[0],
        "fused.dpo": lambda: hk.fused.dpo(x[:, :-1], y, ref)[0],
        "fused.kto": lambda: hk.fused.kto(x[:, :-1], y, ref, des, *kl)[0],
        "fused_linear.token_logprobs": lambda: hk.fused_linear.token_logprobs(h, w, y).sum(),
        "fused_linear.grpo": lambda: hk.fused_linear.grpo(h, w, y, ref, adv)[0],
        "fused_linear.dpo": lambda: hk.fused_linear.dpo(h, w, y, ref)[0],
        "fused_linear.kto": lambda: hk.fused_linear.kto(h, w, y, ref, des, *kl)[0],
        "losses.grpo": lambda: hk.losses.grpo(lp, ref, adv, m)[0],
        "losses.dpo": lambda: hk.losses.dpo(lp, ref, m)[0],
        "losses.kto": lambda: hk.losses.kto(lp, ref, m, des, *kl)[0],
        # objectives of the sequence sums: one frame more (the primitive's wrapper) than the losses above
        "fused.ipo": lambda: hk.fused.ipo(x[:, :-1], y, ref)[0],
        "fused.dpo(hinge)": lambda: hk.fused.dpo(x[:, :-1], y, ref, loss_type="hinge")[0],
        "fused_linear.slic": lambda: hk.fused_linear.slic(h, w, y)[0],
        "losses.simpo": lambda: hk.losses.simpo(lp, m)[0],
    }


OBJECTIVES = ("fused.ipo", "fused.dpo(hinge)", "fused_linear.slic")


@pytest.mark.parametrize("interp", ["0", "1"], ids=["eager", "kernels"])
@pytest.mark.parametrize("name", list(_calls()))
def test_no_custom_op_outside_torch_compile(name, interp, monkeypatch):
    """The eager path never enters a ``humanline`` op; the kernel path calls its launchers directly (the
    dispatcher's cost is paid only while tracing), and still launches kernels."""
    monkeypatch.setenv("TRITON_INTERPRET", interp)
    fn = _calls()[name]
    _jit.LAUNCHES.clear()
    with _Namespaces() as mode:
        loss = fn()
        loss.backward()
    assert "humanline" not in mode.seen, mode.seen
    ran = {path for path, _ in _jit.LAUNCHES}
    if interp == "1" and not name.startswith("losses."):
        assert ran == {"interpreted"}, ran
    else:
        assert ran == set(), ran


def _path_frames():
    """The package's frames from the outermost to the launching one, without the ``_jit`` plumbing."""
    frames = [f for f in inspect.stack()[2:] if f.filename.startswith(PKG) and f.filename != SHIM]
    return [(os.path.relpath(f.filename, PKG), f.function) for f in reversed(frames)]


@pytest.mark.parametrize("name", [n for n in _calls() if not n.startswith("losses.")])
def test_at_most_three_hops_to_every_launch(name, monkeypatch):
    limit = 4 if name in OBJECTIVES else 3
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from humanline_kernels.ops import dpo, grpo, kto, logprobs, sequence, token_terms
    paths = []
    real = _jit.launcher

    def recording(kernel, t):
        paths.append(_path_frames())
        return real(kernel, t)
    for mod in (logprobs, token_terms, dpo, kto, grpo, sequence):  # every module that launches
        monkeypatch.setattr(mod, "launcher", recording)
    _calls()[name]().backward()
    assert paths
    for frames in paths:
        hops, files = len(frames) - 1, {f for f, _ in frames}
        assert hops <= limit and len(files) <= 3, frames
        # forward: from the public function (its module is the level's); backward: from autograd's backward
        assert frames[0][1] in ("backward", name.split(".")[-1].split("(")[0]), frames


def test_one_decision_per_call(monkeypatch):
    """``ops.use_kernels`` is asked once per public call."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    asked = []
    real = ops.use_kernels
    monkeypatch.setattr(ops, "use_kernels", lambda *a: asked.append(1) or real(*a))
    for name, fn in _calls().items():
        asked.clear()
        fn().backward()
        assert len(asked) == (0 if name.startswith("losses.") else 1), name
