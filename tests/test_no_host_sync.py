"""A default loss call (``validate=True``) reads no tensor value on the host: no ``.item()``, ``bool(tensor)``,
``.cpu()``, ``.tolist()``, ``.numpy()``, ``int()``/``float()`` of a tensor, ``nonzero`` or device synchronisation.

On CPU such a read costs nothing, so these tests make each of them raise during the call; on a GPU the same call
would stall the host (and break CUDA-graph capture, see ``test_gpu.py``). The label range check is a device-side
assert; on CPU tensors its failure is still a ``ValueError``.
"""
import contextlib

import pytest
import torch

import humanline_kernels as hk

_READS = ("item", "__bool__", "tolist", "cpu", "numpy", "__int__", "__float__", "nonzero")


@contextlib.contextmanager
def no_host_reads(monkeypatch):
    def boom(name):
        def f(*a, **k):
            raise AssertionError(f"host read of a tensor value: Tensor.{name}")
        return f
    with monkeypatch.context() as m:
        for name in _READS:
            m.setattr(torch.Tensor, name, boom(name))
        m.setattr(torch.cuda, "synchronize", boom("synchronize"))
        yield


def _inputs(seed=0, B=4, T=6, V=37):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T + 1, V, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[1, :2] = -100
    ref = torch.randn(B, T, generator=g) - 3.5
    return logits, labels, ref, torch.randn(B, generator=g)


def _calls():
    def fused_grpo(x, y, ref, adv):
        return hk.fused.grpo(x[:, :-1], y, ref, adv)[0]

    def fused_grpo_gif(x, y, ref, adv):
        return hk.fused.grpo(x[:, :-1], y, ref, adv, grad_in_forward=True, beta=0.04)[0]

    def fused_dpo(x, y, ref, adv):
        return hk.fused.dpo(x[:, :-1], y, ref)[0]

    def fused_kto(x, y, ref, adv):
        return hk.fused.kto(x[:, :-1], y, ref, adv > 0, ref[:2], ref[:2] + 0.1, y[:2] != -100)[0]

    def logprobs(x, y, ref, adv):
        return hk.token_logprobs(x[:, :-1], y).sum()

    def linear(name):
        def f(x, y, ref, adv):  # hidden [B, T, 8] and weight [V, 8] made from the logits leaf x
            h = x[:, :-1, :8] * 0.5
            w = x[0, :, :8].repeat(8, 1)[: x.shape[-1]]
            args = {"grpo": (ref, adv), "dpo": (ref,), "kto": (ref, adv > 0)}[name]
            return getattr(hk.fused_linear, name)(h, w, y, *args, chunk_bytes=2 * 37 * 4)[0]
        return f

    return {"fused.grpo": fused_grpo, "fused.grpo(grad_in_forward)": fused_grpo_gif, "fused.dpo": fused_dpo,
            "fused.kto": fused_kto, "token_logprobs": logprobs, "fused_linear.grpo": linear("grpo"),
            "fused_linear.dpo": linear("dpo"), "fused_linear.kto": linear("kto")}


@pytest.mark.parametrize("interp", ["1", "0"], ids=["interpreter", "eager"])
@pytest.mark.parametrize("name", list(_calls()))
def test_default_call_reads_nothing_on_the_host(name, interp, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", interp)
    x, y, ref, adv = _inputs()
    fn = _calls()[name]
    with no_host_reads(monkeypatch):
        loss = fn(x, y, ref, adv)
        (grad,) = torch.autograd.grad(loss, x)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


@pytest.mark.parametrize("name", ["fused.grpo", "fused.dpo", "token_logprobs", "fused_linear.dpo"])
def test_the_device_side_label_check_still_rejects_bad_labels(name, monkeypatch):
    x, y, ref, adv = _inputs()
    y[2, 3] = 37
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 37\).*got 37 at index \[2, 3\]"):
        _calls()[name](x, y, ref, adv)


def test_the_patches_catch_a_host_read(monkeypatch):
    """The guard itself works: a bool() of a tensor inside it raises."""
    t = torch.ones(2)
    with no_host_reads(monkeypatch), pytest.raises(AssertionError, match="__bool__"):
        bool(t.any())
