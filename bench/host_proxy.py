"""Host glue of one loss call, measured without a GPU: the compiled-kernel branch on tiny CPU tensors with every
Triton launch replaced by a no-op (``python -m bench host --proxy``).

What is left is what the host does around the kernels in a forward + backward: argument checks, the params
object, output allocation, the custom-op or direct call, autograd. The floor, measured in the same run, is a
minimal ``torch.autograd.Function`` that allocates the call's outputs and does nothing else (21-24 us on the
development machine: autograd's own forward and ``.backward()``); the calls whose output is per token or per
sequence, summed before ``.backward()``, are measured against ``floor(summed)``, the same floor with an output of
the labels' shape and the same sum. ``python lower bound (grpo)`` calibrates what Python cannot avoid: one
Function, two allocations and three no-op launch calls of the kernels' arity. docs/design.md's host target: logits-level
losses and ``token_logprobs`` with ``validate=False`` at most 1.5x the floor, ``validate=True`` at most 0.4x of
the floor more, a one-chunk fused-linear loss at most 2.5x. Liger's ``triton_grpo_loss`` and fused-linear GRPO,
stubbed the same way, are the peer rows when Liger is installed.

``--triton`` adds Triton's own launch path to each row (``JITFunction.run``: the binder, the specialisation of
every argument, the cache lookup, the launch metadata) through a stand-in driver whose launcher does nothing; the
first call of each variant compiles it for sm_90 with the ptxas inside the triton wheel, as the compile gate
does. What remains outside the proxy is the driver's C launcher and ``cuLaunchKernelEx`` itself.
"""
from __future__ import annotations

import collections
import contextlib
import gc
import platform
import statistics
import time
import warnings

import torch

# shapes of the proxy: tiny on purpose (the kernels do nothing; what is timed must be the host's work)
B, T, V, D = 2, 4, 16, 8


@contextlib.contextmanager
def stubbed_launches(devices=("cpu",)):
    """Every Triton launch is a no-op, and tensors of ``devices`` take the compiled-kernel branch (as CUDA tensors
    would): CPU tensors here, ``meta`` ones for bench/live_bytes.py."""
    from triton.runtime.jit import JITFunction

    from humanline_kernels.ops import _jit
    global _TRITON_RUN
    run = _TRITON_RUN = JITFunction.run
    JITFunction.run = lambda self, *args, **kwargs: None
    added = [d for d in devices if d not in _jit.COMPILED_DEVICES]  # (a device routed already stays routed)
    _jit.COMPILED_DEVICES.update(added)
    try:
        yield
    finally:
        JITFunction.run = run
        _jit.COMPILED_DEVICES.difference_update(added)


class _Utils:
    """The driver utilities a compiled kernel asks for before its first launch: an H100's limits, a dummy
    module and function handle."""

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}

    def load_binary(self, name, kernel, shared, device):
        return 1, 1, 32, 0, 1024  # module, function, registers, spills, max threads a block

    def unload_module(self, module):
        pass


class StandInDriver:
    """A Triton driver for ``sm_<arch>`` on device 0, stream 0, whose kernel launcher only counts (``launched``):
    enough for ``JITFunction.run`` to specialise, compile and "launch" without a GPU (also the compile gate's,
    tests/compile_gate.py)."""

    def __init__(self, arch=90):
        from triton.backends.compiler import GPUTarget
        self.target, self.utils, self.launched = GPUTarget("cuda", arch, 32), _Utils(), 0

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def launcher_cls(self, src, metadata):
        def launch(*args):
            self.launched += 1
        return launch


@contextlib.contextmanager
def stand_in_driver():
    """Inside ``stubbed_launches``: :class:`StandInDriver` is Triton's active driver, and every JITFunction has fresh
    per-device caches for the while (kernels "compiled" here have no-op launchers and must not stay in the caches of
    a process that has a GPU); the caches and the previous driver come back afterwards. Launches stay stubbed until
    :func:`triton_runs`."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    # every JITFunction alive (ours, Triton's standard library, Liger's): triton 3.6 keeps no registry of them
    with warnings.catch_warnings():  # isinstance() on every object wakes torch's deprecated module attributes
        warnings.simplefilter("ignore")
        # pairs, not a dict: a JITFunction's hash parses its source (ops/_jit.py says when that fails)
        saved = [(o, o.device_caches) for o in gc.get_objects() if isinstance(o, JITFunction)]
    previous = driver._active
    for jf, _ in saved:
        jf.device_caches = collections.defaultdict(jf.create_binder)
    stdlib = _compiled_stdlib()
    stand_in = StandInDriver()
    driver.set_active(stand_in)  # before any binder is made: it reads the driver's target
    try:
        yield stand_in
    finally:
        for mod, name, value in stdlib:
            setattr(mod, name, value)
        for jf, caches in saved:
            jf.device_caches = caches
        gc.collect()  # the stand-in's kernels unload through the driver that loaded them, not through the previous
        driver.set_active(previous)


def _compiled_stdlib():
    """Triton <= 3.6 with ``TRITON_INTERPRET=1`` at import made its standard library (``tl.max``, ``tl.sum``, ...)
    interpreted functions, which the GPU code generator calls as Python (the compile then fails inside the
    interpreter): compiled-kind twins in their place while the stand-in compiles. Returns what to put back."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from humanline_kernels.ops._jit import stdlib_functions
    swapped = stdlib_functions(InterpretedFunction)
    twins = {}  # one twin per function, also where two modules export it
    for mod, name, value in swapped:
        if id(value) not in twins:
            twins[id(value)] = JITFunction(value.fn)
        setattr(mod, name, twins[id(value)])
    return swapped


@contextlib.contextmanager
def triton_runs():
    """Inside ``stand_in_driver``: launches go through Triton's own ``JITFunction.run`` (binder, specialisation,
    cache, compile on a variant's first call) to the stand-in's launcher; stubbed again afterwards."""
    from triton.runtime.jit import JITFunction
    stub, JITFunction.run = JITFunction.run, _TRITON_RUN
    try:
        yield
    finally:
        JITFunction.run = stub


_TRITON_RUN = None  # JITFunction.run as Triton defines it (set by stubbed_launches)


class _Floor(torch.autograd.Function):
    """Allocates a loss (or, given ``like``, a tensor shaped like it) and a gradient shaped like the input; nothing
    else."""

    @staticmethod
    def forward(ctx, x, like=None):
        ctx.shape = x.shape
        return x.new_empty(() if like is None else like.shape)

    @staticmethod
    def backward(ctx, g):
        return g.new_empty(ctx.shape), None


def _noop(**kwargs):
    pass


class _LowerBound(torch.autograd.Function):
    """What a logits-level GRPO call cannot do without in Python: one Function, its outputs in two allocations
    (the per-token planes, then loss, metrics and row weights), the row and finalize launch calls in the forward and
    the backward's allocation and launch call, each call passing as many keywords as its kernel takes (to a no-op:
    no checks, no params object, no launch wrapper)."""

    @staticmethod
    def forward(ctx, x, y, ref, adv):
        from humanline_kernels.ops import grpo, token_terms
        B, T = y.shape
        planes = torch.empty((7, B, T), dtype=torch.float32, device=x.device)
        small = torch.empty((B + 5,), dtype=torch.float32, device=x.device)
        _noop(**dict(zip(token_terms._token_terms_kernel.arg_names, (x, y, ref, adv, planes) * 16)))
        _noop(**dict(zip(grpo._grpo_finalize_kernel.arg_names, (planes, y, small) * 16)))
        loss, met = small[0], small[1:5]
        ctx.save_for_backward(x, y, planes, small)
        ctx.mark_non_differentiable(met)
        ctx.set_materialize_grads(False)
        return loss, met

    @staticmethod
    def backward(ctx, g, _):
        from humanline_kernels.ops import logprobs
        x, y, planes, small = ctx.saved_tensors
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _noop(**dict(zip(logprobs._logprobs_bwd_kernel.arg_names, (x, y, planes, small, g, out) * 16)))
        return out, None, None, None


# entry points whose output is summed before .backward() (per-token log-probs, per-sequence sums): measured against
# floor(summed), a floor with an output of the labels' shape and the same sum
SUMMED = ("floor(summed)", "token_logprobs", "token_logprobs(entropy)", "fused.sequence_logratios")


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
        # the floor of the calls whose output is per token or per sequence, summed before .backward() as they are
        "floor(summed)": lambda: bwd(_Floor.apply(x, y).sum(), x),
        "python lower bound (grpo)": lambda: bwd(_LowerBound.apply(x, y, ref, adv)[0], x),
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
        from liger_kernel.ops import grpo_loss
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
    except Exception:
        return {}
    from triton.runtime.jit import JITFunction
    if not isinstance(getattr(grpo_loss, "_grpo_loss_fwd_kernel", None), JITFunction):
        # decorated while TRITON_INTERPRET=1 (a test process): the stub would miss its launches and the row would
        # time Triton's interpreter
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


def _launches(fn):
    """Triton launches of one call of ``fn`` (ours and a peer's alike), counted at ``JITFunction.run``."""
    from triton.runtime.jit import JITFunction
    n, stub = 0, JITFunction.run

    def count(self, *args, **kwargs):
        nonlocal n
        n += 1
    JITFunction.run = count
    try:
        fn()
    finally:
        JITFunction.run = stub
    return n


def measure(calls=200, repeats=15, progress=print, triton=False):
    """Rows ``{impl, us_median, us_min, us_max, ratio}``: every entry point, interleaved with the floor. With
    ``triton``, also ``launches`` (Triton launches a call) and ``triton_us`` (the same call through Triton's own
    launch path, :func:`triton_runs`), timed right after the stubbed one, and ``triton_us_per_launch``."""
    rows = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(stubbed_launches())
        fns = _calls()
        if triton:
            stack.enter_context(stand_in_driver())
            with triton_runs():  # compiles each variant once (seconds), outside the timed windows
                for fn in fns.values():
                    fn()
        for fn in fns.values():  # warm-up: first-call work (imports, Triton's binder) is not the steady state
            for _ in range(20):
                fn()
        gc.collect()
        gc.disable()  # a collection inside one timed window is noise, not glue
        stack.callback(gc.enable)
        floor = []
        for i, (name, fn) in enumerate(fns.items()):
            progress(f"[host proxy {i + 1}/{len(fns)}] {name}")
            floor += _time_us(fns["floor"], calls, 2)  # the machine drifts: the floor is sampled throughout
            t = _time_us(fn, calls, repeats)
            row = {"impl": name, "us_median": statistics.median(t), "us_min": min(t), "us_max": max(t)}
            if triton:
                row["launches"] = _launches(fn)
                with triton_runs():
                    for _ in range(5):
                        fn()
                    row["triton_us"] = statistics.median(_time_us(fn, calls, repeats))
                extra = row["triton_us"] - row["us_median"]
                row["triton_us_per_launch"] = extra / row["launches"] if row["launches"] else None
            rows.append(row)
    f = statistics.median(floor)
    summed = next(r["us_median"] for r in rows if r["impl"] == "floor(summed)")
    for r in rows:
        r["floor"] = "floor(summed)" if r["impl"] in SUMMED else "floor"
        r["ratio"] = r["us_median"] / (summed if r["impl"] in SUMMED else f)
    return rows, {"floor_us": f, "floor_spread_us": [min(floor), max(floor)], "floor_summed_us": summed,
                  "calls": calls, "repeats": repeats,
                  "shapes": dict(B=B, T=T, V=V, D=D), "cpu": _cpu_model(), "threads": torch.get_num_threads(),
                  "triton_launch_path": bool(triton)}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
