"""Host glue of one loss call, measured without a GPU: the compiled-kernel branch on tiny CPU tensors with every
Triton launch replaced by a no-op (``python -m bench host --proxy``).

What is left is what the host does around the kernels in a forward + backward: argument checks, the params
object, output allocation, the custom-op or direct call, autograd. The floor, measured in the same run, is a
minimal ``torch.autograd.Function`` that allocates the call's outputs and does nothing else (21-24 us on the
development machine: autograd's own forward and ``.backward()``). docs/design.md's host target: logits-level
losses and ``token_logprobs`` with ``validate=False`` at most 1.5x the floor, ``validate=True`` at most 0.4x of
the floor more, a one-chunk fused-linear loss at most 2.5x. Liger's ``triton_grpo_loss`` and fused-linear GRPO,
stubbed the same way, are the peer rows when Liger is installed.
"""
from __future__ import annotations

import contextlib
import gc
import platform
import statistics
import time

import torch

# shapes of the proxy: tiny on purpose (the kernels do nothing; what is timed must be the host's work)
B, T, V, D = 2, 4, 16, 8


@contextlib.contextmanager
def stubbed_launches():
    """Every Triton launch is a no-op, and CPU tensors take the compiled-kernel branch (as CUDA tensors would)."""
    from triton.runtime.jit import JITFunction

    from humanline_kernels.ops import _jit
    run = JITFunction.run
    JITFunction.run = lambda self, *args, **kwargs: None
    _jit.COMPILED_DEVICES.add("cpu")
    try:
        yield
    finally:
        JITFunction.run = run
        _jit.COMPILED_DEVICES.discard("cpu")


class _Floor(torch.autograd.Function):
    """Allocates a loss and a gradient shaped like the input; nothing else."""

    @staticmethod
    def forward(ctx, x):
        ctx.shape = x.shape
        return x.new_empty(())

    @staticmethod
    def backward(ctx, g):
        return g.new_empty(ctx.shape)


def _calls():
    import humanline_kernels as hk
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, V, generator=g, requires_grad=True)
    y = torch.randint(0, V, (B, T), generator=g)
    ref = torch.randn(B, T, generator=g) - 3.0
    adv = torch.randn(B, generator=g)
    des = torch.tensor([True, False])
    h = torch.randn(B, T, D, generator=g, requires_grad=True)
    w = torch.randn(V, D, generator=g, requires_grad=True)
    kl_rows = (ref, ref - 0.1, y != -100)
    nv = dict(validate=False)
    one = dict(validate=False, chunk_bytes=1 << 20)
    several = dict(validate=False, chunk_bytes=T * V * 4)  # one row (KTO, GRPO) or one pair (DPO) a chunk

    def bwd(out, wrt):
        out.backward()
        return wrt

    calls = {
        "floor": lambda: bwd(_Floor.apply(x), x),
        "token_logprobs": lambda: bwd(hk.token_logprobs(x, y, **nv).sum(), x),
        "token_logprobs(entropy)": lambda: bwd(hk.token_logprobs(x, y, return_entropy=True, **nv)[0].sum(), x),
        "fused.grpo": lambda: bwd(hk.fused.grpo(x, y, ref, adv, **nv)[0], x),
        "fused.grpo(validate)": lambda: bwd(hk.fused.grpo(x, y, ref, adv)[0], x),
        "fused.grpo(grad_in_forward)": lambda: bwd(hk.fused.grpo(x, y, ref, adv, grad_in_forward=True, **nv)[0], x),
        "fused.grpo(inplace)": lambda: bwd(hk.fused.grpo(x.detach().clone().requires_grad_(), y, ref, adv,
                                                         inplace_backward=True, **nv)[0], x),
        "fused.dpo": lambda: bwd(hk.fused.dpo(x, y, ref, **nv)[0], x),
        "fused.dpo(validate)": lambda: bwd(hk.fused.dpo(x, y, ref)[0], x),
        "fused.kto": lambda: bwd(hk.fused.kto(x, y, ref, des, *kl_rows, **nv)[0], x),
        "fused_linear.grpo": lambda: bwd(hk.fused_linear.grpo(h, w, y, ref, adv, **one)[0], h),
        "fused_linear.grpo(2 chunks)": lambda: bwd(hk.fused_linear.grpo(h, w, y, ref, adv, **several)[0], h),
        "fused_linear.dpo": lambda: bwd(hk.fused_linear.dpo(h, w, y, ref, **one)[0], h),
        "fused_linear.dpo(1 pair a chunk)": lambda: bwd(hk.fused_linear.dpo(h, w, y, ref, **several)[0], h),
        "fused_linear.kto": lambda: bwd(hk.fused_linear.kto(h, w, y, ref, des, *kl_rows, **one)[0], h),
    }
    if hasattr(hk.fused, "sequence_logratios"):
        calls["fused.sequence_logratios"] = lambda: bwd(hk.fused.sequence_logratios(x, y, ref, **nv)[0].sum(), x)
    calls.update(_liger_calls(x, y, ref, adv, h, w))
    return calls


def _liger_calls(x, y, ref, adv, h, w):
    """Liger's GRPO losses on the same tensors (their Triton launches stubbed too), when Liger is installed."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
        from liger_kernel.ops.grpo_loss import GrpoLossFunction  # noqa: F401
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
    except Exception:
        return {}
    mask = torch.ones(B, T, dtype=torch.int64)
    loss_fn = LigerFusedLinearGRPOLoss(beta=0.0)
    xl = torch.cat([x.detach(), x.detach()[:, -1:]], 1).requires_grad_()  # Liger wants [B, T + 1, V]

    def grpo():  # as bench_logits calls it: GRPO with the k3 KL, reduced, the gradient formed in the forward
        out = triton_grpo_loss(xl, None, ref, y, adv, completion_mask=mask, temperature=1.0, beta=0.04,
                               loss_type="dapo", reduce=True)
        (out[0] if isinstance(out, tuple) else out).backward()

    def linear():
        loss = loss_fn(h, w, y, mask, adv, ref_per_token_logps=ref)[0]
        loss.backward()
    return {"liger triton_grpo_loss": grpo, "liger FusedLinearGRPO": linear}


def _time_us(fn, calls, repeats):
    """Per-call microseconds of ``calls`` consecutive calls, ``repeats`` times."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) * 1e6 / calls)
    return out


def measure(calls=200, repeats=15, progress=print):
    """Rows ``{impl, us_median, us_min, us_max, ratio}``: every entry point, interleaved with the floor."""
    rows = []
    with stubbed_launches():
        fns = _calls()
        for fn in fns.values():  # warm-up: first-call work (imports, Triton's binder) is not the steady state
            for _ in range(20):
                fn()
        gc.collect()
        gc.disable()  # a collection inside one timed window is noise, not glue
        try:
            floor = []
            for i, (name, fn) in enumerate(fns.items()):
                progress(f"[host proxy {i + 1}/{len(fns)}] {name}")
                floor += _time_us(fns["floor"], calls, 2)  # the machine drifts: the floor is sampled throughout
                t = _time_us(fn, calls, repeats)
                rows.append({"impl": name, "us_median": statistics.median(t), "us_min": min(t), "us_max": max(t)})
        finally:
            gc.enable()
    f = statistics.median(floor)
    for r in rows:
        r["ratio"] = r["us_median"] / f
    return rows, {"floor_us": f, "floor_spread_us": [min(floor), max(floor)], "calls": calls, "repeats": repeats,
                  "shapes": dict(B=B, T=T, V=V, D=D), "cpu": _cpu_model(), "threads": torch.get_num_threads()}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
