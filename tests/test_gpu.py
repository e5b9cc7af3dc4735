"""Compiled kernels on a real GPU: every fused loss against ``hk.reference`` (fp32 and bf16, clip on and off, each
GRPO ``loss_type``, gradient in the forward, in place), no host sync with default arguments, CUDA-graph capture.

Each test asserts through ``compiled_kernels`` that compiled Triton kernels ran and nothing took the interpreter
or the eager path.
"""
import pytest
import torch
from test_fused_losses import _data, _run

import humanline_kernels as hk

pytestmark = pytest.mark.gpu

GRPO_CASES = [dict(loss_type=t, beta=0.04) for t in ("dapo", "bnpo", "grpo")] + [
    dict(loss_type="dr_grpo", max_completion_length=40), dict(loss_type="bnpo", normalizer=30.5),
    dict(loss_type="dapo", grad_in_forward=True, beta=0.04), dict(loss_type="grpo", grad_in_forward=True),
    dict(loss_type="dapo", grad_in_forward=True, inplace_backward=True), dict(loss_type="dapo", inplace_backward=True),
    dict(loss_type="dapo", kl_ref_logps="shifted", beta=0.1)]


def _cuda_data(dtype, seed=0, B=4, T=37, V=3001):
    x, y, ref = _data(B, T, V, dtype=dtype, seed=seed)
    return x.cuda(), y.cuda(), ref.cuda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("clip", [hk.HumanlineClip(-1.5, 1.5), None], ids=["clip", "noclip"])
@pytest.mark.parametrize("case", GRPO_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_grpo_matches_reference(case, clip, dtype, compiled_kernels):
    x, y, ref = _cuda_data(dtype)
    adv = torch.tensor([1.0, -0.5, 0.7, 2.0], device="cuda")
    kw = dict(case, clip=clip)
    if kw.get("kl_ref_logps") == "shifted":
        kw["kl_ref_logps"] = ref - 0.2
    _run("grpo", x, y, ref, (adv,), kw, upstream=1.0 if case.get("loss_type") != "grpo" else 2.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("clip", [hk.HumanlineClip(-1.5, 1.5), None], ids=["clip", "noclip"])
@pytest.mark.parametrize("inplace", [False, True], ids=["", "inplace"])
def test_dpo_kto_match_reference(dtype, clip, inplace, compiled_kernels):
    x, y, ref = _cuda_data(dtype, seed=1)
    kw = dict(clip=clip, inplace_backward=inplace, temperature=0.8)
    _run("dpo", x, y, ref, (), dict(kw, beta=0.2, label_smoothing=0.1))
    des = torch.tensor([True, False, True, False], device="cuda")
    kl = (ref[:2] - 0.1, ref[:2], y[:2] != -100)
    _run("kto", x, y, ref, (des, *kl), dict(kw, beta=0.3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_token_logprobs_entropy_and_temperature(dtype, compiled_kernels):
    x, y, _ = _cuda_data(dtype, seed=2, V=50257)
    lp, ent = hk.token_logprobs(x[:, :-1], y, temperature=0.7, return_entropy=True)
    z = x[:, :-1].float() / 0.7
    lr = hk.reference.token_logprobs(x[:, :-1].float(), y, temperature=0.7)
    q = torch.log_softmax(z, -1)
    er = torch.where(y != -100, -(q.exp() * q).sum(-1), 0.0)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(lp, lr, atol=tol, rtol=0)
    torch.testing.assert_close(ent, er, atol=1e-4 if dtype == torch.float32 else 2e-2, rtol=1e-4)


def _default_calls():
    """Each loss as a trainer calls it: default keywords (``validate=True``, default clip)."""
    x, y, ref = _cuda_data(torch.bfloat16, seed=3, V=32000)
    adv = torch.randn(4, device="cuda")
    des = torch.tensor([True, False, True, True], device="cuda")
    h = torch.randn(4, 37, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(32000, 64, device="cuda", dtype=torch.bfloat16) * 0.1
    return {
        "token_logprobs": ((x,), lambda x: hk.token_logprobs(x[:, :-1], y).sum()),
        "fused.grpo": ((x,), lambda x: hk.fused.grpo(x[:, :-1], y, ref, adv)[0]),
        "fused.grpo(grad_in_forward)": ((x,), lambda x: hk.fused.grpo(x[:, :-1], y, ref, adv,
                                                                      grad_in_forward=True)[0]),
        "fused.dpo": ((x,), lambda x: hk.fused.dpo(x[:, :-1], y, ref)[0]),
        "fused.kto": ((x,), lambda x: hk.fused.kto(x[:, :-1], y, ref, des, ref[:2], ref[:2] - 0.1,
                                                   y[:2] != -100)[0]),
        "fused_linear.grpo": ((h, w), lambda h, w: hk.fused_linear.grpo(h, w, y, ref, adv)[0]),
        "fused_linear.dpo": ((h, w), lambda h, w: hk.fused_linear.dpo(h, w, y, ref)[0]),
        "fused_linear.kto": ((h, w), lambda h, w: hk.fused_linear.kto(h, w, y, ref, des)[0]),
    }


CALLS = ["token_logprobs", "fused.grpo", "fused.grpo(grad_in_forward)", "fused.dpo", "fused.kto", "fused_linear.grpo",
         "fused_linear.dpo", "fused_linear.kto"]


@pytest.mark.parametrize("name", CALLS)
def test_default_call_has_no_host_sync(name, compiled_kernels):
    inputs, fn = _default_calls()[name]
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call inside raises
    try:
        loss = fn(*leaves)
        torch.autograd.grad(loss, leaves)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def capture_all():
    """Capture forward + backward of every default call in a CUDA graph, replay, compare with an eager run.

    Run by :func:`test_every_default_call_captures_in_a_cuda_graph` in a child process (``python tests/test_gpu.py``):
    a failed capture leaves the CUDA RNG in capture state and would fail every later test of the process."""
    from humanline_kernels.ops import _jit
    results = {}
    for name, (inputs, fn) in _default_calls().items():
        try:
            _jit.LAUNCHES.clear()
            eager_leaves = [t.detach().clone().requires_grad_() for t in inputs]
            loss = fn(*eager_leaves)
            eager = (loss, *torch.autograd.grad(loss, eager_leaves))
            # leaves first used on the warm-up stream: autograd syncs a leaf's gradient with the stream of its
            # first use, which must not be the legacy default stream while a capture runs
            leaves = [t.detach().clone().requires_grad_() for t in inputs]

            def step():
                out = fn(*leaves)
                return (out, *torch.autograd.grad(out, leaves))
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static = step()
            graph.replay()
            torch.cuda.synchronize()
            err = max(((a.float() - b.float()).abs().max().item() for a, b in zip(static, eager)))
            paths = sorted({p for p, _ in _jit.LAUNCHES})
            results[name] = {"ok": err <= 1e-5 and paths == ["compiled"], "max_err": err, "paths": paths}
        except Exception as e:  # report this one; the process may be unusable for the next ones
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            break
    return results


def test_every_default_call_captures_in_a_cuda_graph():
    import json
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=600, env=env,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(res) == set(CALLS), res
    assert all(r["ok"] for r in res.values()), res


def test_bad_label_trips_the_device_side_assert_in_a_subprocess():
    """validate=True on CUDA: a bad label fails at the next sync (device-side assert), without a host sync in the
    call itself. Runs in a child process: a device-side assert leaves the CUDA context unusable."""
    import subprocess
    import sys
    code = ("import torch, humanline_kernels as hk\n"
            "x = torch.randn(2, 5, 11, device='cuda'); y = torch.randint(0, 11, (2, 5), device='cuda')\n"
            "y[1, 2] = 11\n"
            "lp = hk.token_logprobs(x, y)\n"
            "torch.cuda.synchronize()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "labels must lie in [0, 11)" in out.stderr or "device-side assert" in out.stderr, out.stderr[-2000:]


if __name__ == "__main__":
    import json
    print(json.dumps(capture_all()))
