"""Peak live bytes of one fused-linear forward + backward at the real shape, counted on the CPU without a GPU
(``python -m bench linear --live-bytes``; issue 54, target 2).

How: the inputs are ``meta`` tensors (a shape and a dtype, no memory, no time), ``meta`` takes the compiled-kernel
branch with every Triton launch a no-op (:func:`bench.host_proxy.stubbed_launches`; a launch writes into tensors
allocated before it, so it allocates nothing), and :class:`LiveBytes`, a ``TorchDispatchMode``, sees every aten op
of the call, autograd's backward included. A storage that an op returns and that none of its tensor arguments
holds is a new allocation; it is freed when its storage's last reference goes (a weak reference to the storage,
not to the tensor: views such as the chunk's ``buf[:n].view(-1, V)`` keep it alive). Each allocation is rounded up
to 512 bytes, as the CUDA caching allocator rounds its blocks (so ``torch.cuda.memory_allocated`` moves by the
same amounts). The live total is taken after every allocation, with the frees since the last op applied first, so
its maximum is the peak ``torch.cuda.max_memory_allocated`` would show for the same sequence of allocations.

What it cannot see: allocations inside one op's own implementation (workspaces: cuBLAS keeps its workspace across
calls, so the GPU bench counts it in the baseline, not in the call) and the caching allocator's fragmentation
(``memory_reserved``, not what the bench reads). Which path a call takes is the package's public rule: a device type
in ``humanline_kernels.ops._jit.COMPILED_DEVICES`` runs the compiled kernels (``stubbed_launches`` adds ``meta``),
and ``dW`` accumulates in the weight's dtype on every device (docs/fused_linear.md, "dW's precision"), so no
device-dependent branch is left to pin. (Before issue 54 the fp32 ``dW`` accumulator was an
``addmm(out_dtype=float32)`` on CUDA and an upcast of each chunk's operands elsewhere, which this counter pinned.)

The protocol is ``bench linear``'s (``common.peak_extra_bytes`` after ``common.time_ms``): the call is the same
closure (``h.grad = w.grad = None``, forward, ``.backward()``), measured after a warm call, so the previous call's
gradients are in the baseline and are freed inside the measured call: ``peak_extra`` is then the peak minus those
gradients, i.e. the call's transient memory beyond the gradients it returns. The floor (``lm_head_gemm_fwd_bwd``)
writes its logits into a buffer allocated once outside the timed call and keeps no gradient, so its peak is its
``dW`` GEMM's output. ``peak_fresh`` is the same call without earlier gradients (every byte the call allocates
beyond its inputs, its returned gradients included).
"""
from __future__ import annotations

import contextlib
import os

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .cli import Parser

GiB = float(1 << 30)
GRANULE = 512  # the CUDA caching allocator's block rounding (kMinBlockSize)
SHAPE = dict(B=8, T=1024, D=4096, V=128256)  # bench linear's default: N = 8192 tokens
CHUNK_BYTES = 512 << 20  # bench linear's first --chunk-mib (the one DPO, KTO and log-probs use)
TARGET_OVER_FLOOR = 0.25 * GiB  # docs/design.md: peak at most the floor's + 0.25 GiB
LOSSES = ("grpo", "dpo", "kto")  # the target's rows; token_logprobs is counted too, without a target
# run 3 (bench/results/2026-11-26-h100/linear.json, H100, torch 2.11): the measured peaks this count reproduces
RUN3_GIB = {"floor": 0.978515625, "grpo": 2.0195322036743164, "dpo": 2.0195322036743164,
            "kto": 2.0195322036743164, "token_logprobs": 2.456862449645996}


def _rounded(nbytes, granule):
    return 0 if nbytes == 0 else -(-nbytes // granule) * granule


class LiveBytes(TorchDispatchMode):
    """Live bytes of the storages created by aten ops while active: ``cur``, ``peak`` (since :meth:`reset`),
    ``extra`` (``peak`` over the baseline at :meth:`reset`), ``phases`` (the peak over the baseline inside and
    outside autograd's backward: ``{"forward": ..., "backward": ...}``) and ``at_peak`` (what was live at the peak,
    largest first: ``(bytes, dtype, shape, op)``)."""

    def __init__(self, granule=GRANULE):
        super().__init__()
        self.granule = granule
        self.live = {}  # storage id -> (weak ref, bytes, what)
        self.cur = self.peak = self.base = 0
        self.at_peak, self.phases = [], {}

    def _sweep(self):
        for k in [k for k, (ref, _, _) in self.live.items() if ref.expired()]:
            self.cur -= self.live.pop(k)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # out= results, in-place ops and views return a storage one of the arguments already holds
        held = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        new = []
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if s._cdata not in held and s._cdata not in self.live:
                    held.add(s._cdata)
                    new.append((s, (str(t.dtype).replace("torch.", ""), tuple(t.shape), func.__name__)))
        if new:
            self._sweep()  # frees since the last op first: the caching allocator reuses them for these
            for s, what in new:
                n = _rounded(s.nbytes(), self.granule)
                self.live[s._cdata] = (StorageWeakRef(s), n, what)
                self.cur += n
            phase = "backward" if torch._C._current_graph_task_id() >= 0 else "forward"
            self.phases[phase] = max(self.phases.get(phase, self.cur - self.base), self.cur - self.base)
            if self.cur > self.peak:
                self.peak = self.cur
                self.at_peak = sorted(((n, *what) for _, n, what in self.live.values()), reverse=True)
        return out

    def reset(self):
        """The baseline is what is live now (e.g. the previous call's gradients)."""
        self._sweep()
        self.base = self.peak = self.cur
        self.at_peak, self.phases = [], {}

    def now(self):
        """Live bytes over the baseline now."""
        self._sweep()
        return self.cur - self.base

    @property
    def extra(self):
        return self.peak - self.base


@contextlib.contextmanager
def gpu_like_meta():
    """``meta`` tensors down the compiled-kernel branch (``meta`` in ``COMPILED_DEVICES``, as ``cuda`` is) with
    Triton's launches stubbed. Nothing else differs between a CUDA and a meta call (see the module's docstring)."""
    from bench.host_proxy import stubbed_launches

    with stubbed_launches(devices=("meta",)):
        yield


def inputs(B, T, D, V, dtype=torch.bfloat16, device="meta"):
    """``bench linear``'s inputs (``_inputs``) as shapes: hidden, weight (both requiring grad), labels, reference
    log-probs, advantages, KTO's ``desirable``."""
    h = torch.empty((B, T, D), dtype=dtype, device=device, requires_grad=True)
    w = torch.empty((V, D), dtype=dtype, device=device, requires_grad=True)
    y = torch.zeros((B, T), dtype=torch.int64, device=device)
    ref = torch.zeros((B, T), dtype=torch.float32, device=device)
    adv = torch.zeros((B,), dtype=torch.float32, device=device)
    des = torch.arange(B, device=device) % 2 == 0
    return h, w, y, ref, adv, des


def cases(h, w, y, ref, adv, des, chunk_bytes=CHUNK_BYTES):
    """name -> a forward + backward, as ``bench linear``'s ``_cases`` writes them (its rows ``ours_grpo@512MiB``,
    ``ours_dpo``, ``ours_kto``, ``ours_token_logprobs(recompute)`` and the floor ``lm_head_gemm_fwd_bwd``), and the
    floor's logits buffer, which the bench allocates once outside the timed call."""
    import humanline_kernels as hk
    B, T, D = h.shape
    V = w.shape[0]
    h2 = h.view(-1, D)
    kw = dict(chunk_bytes=chunk_bytes, validate=False)

    def fb(loss_fn):
        def run():
            h.grad = w.grad = None
            loss_fn().backward()
        return run

    gz = torch.empty(B * T, V, device=h.device, dtype=h.dtype)

    def gemm():
        hd = h2.detach()
        torch.mm(hd, w.detach().t(), out=gz)
        torch.mm(gz, w.detach())
        torch.mm(gz.t(), hd)
    return {
        "floor": gemm,
        "grpo": fb(lambda: hk.fused_linear.grpo(h, w, y, ref, adv, **kw)[0]),
        "dpo": fb(lambda: hk.fused_linear.dpo(h, w, y, ref, **kw)[0]),
        "kto": fb(lambda: hk.fused_linear.kto(h, w, y, ref, des, **kw)[0]),
        "token_logprobs": fb(lambda: hk.fused_linear.token_logprobs(h, w, y, **kw).sum()),
    }, gz


def count(fn, granule=GRANULE, warm=True):
    """``(peak_extra, fresh, mode)`` of one call of ``fn``: ``peak_extra`` after a warm call (bench linear's
    protocol), ``fresh`` the first call's. ``mode`` is the :class:`LiveBytes` of the measured call."""
    with LiveBytes(granule) as first:
        fn()
    if not warm:
        return first.extra, first.extra, first
    with LiveBytes(granule) as mem:
        fn()  # its gradients stay in .grad, as after bench linear's timing loop
        mem.reset()
        fn()
    return mem.extra, first.extra, mem


def allocator_peak(fn):
    """Peak bytes over the start that the CPU allocator itself reports for ``fn()`` on real CPU tensors (the
    profiler's memory events, in time order): the check of :class:`LiveBytes` against an allocator. Frees of
    blocks allocated before the profiler started are not reported, so compare calls that free none."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    cur = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def measure(B=SHAPE["B"], T=SHAPE["T"], D=SHAPE["D"], V=SHAPE["V"], dtype=torch.bfloat16,
            chunk_bytes=CHUNK_BYTES, names=None, granule=GRANULE):
    """Rows ``{impl, peak_extra_bytes, peak_fresh_bytes, over_floor_bytes, target_bytes, meets_target, at_peak}``
    (the floor first) and the meta: the shape, the floor and the target (floor + 0.25 GiB)."""
    rows = []
    with gpu_like_meta():
        fns, gz = cases(*inputs(B, T, D, V, dtype), chunk_bytes=chunk_bytes)
        for name in names or fns:
            extra, fresh, mem = count(fns[name], granule)
            rows.append({"impl": name, "peak_extra_bytes": extra, "peak_fresh_bytes": fresh,
                         "forward_bytes": mem.phases.get("forward"), "backward_bytes": mem.phases.get("backward"),
                         "at_peak": [list(e) for e in mem.at_peak[:6]]})
        del gz
    floor = next((r["peak_extra_bytes"] for r in rows if r["impl"] == "floor"), None)
    target = None if floor is None else floor + int(TARGET_OVER_FLOOR)
    for r in rows:
        r["peak_extra_GiB"] = r["peak_extra_bytes"] / GiB
        r["peak_fresh_GiB"] = r["peak_fresh_bytes"] / GiB
        r["over_floor_GiB"] = None if floor is None else (r["peak_extra_bytes"] - floor) / GiB
        r["target_GiB"] = None if target is None or r["impl"] not in LOSSES else target / GiB
        r["meets_target"] = None if r["target_GiB"] is None else r["peak_extra_bytes"] <= target
        r["run3_GiB"] = RUN3_GIB.get(r["impl"]) if (B, T, D, V) == tuple(SHAPE.values()) else None
    meta = {"N": B * T, "B": B, "T": T, "D": D, "V": V, "dtype": str(dtype), "chunk_bytes": chunk_bytes,
            "granule": granule, "floor_bytes": floor, "target_bytes": target,
            "how": "meta tensors, Triton launches stubbed, a TorchDispatchMode counting storages (bench/live_bytes.py)",
            "protocol": "bench linear's: after a warm call, the previous gradients freed inside the call"}
    return rows, meta


def table(rows):
    """The rows as text (GiB): the peak (bench linear's protocol) and its forward and backward parts, the fresh
    peak, the peak over the floor's, the target, and run 3's measurement of the same row."""
    def g(x):
        return "-" if x is None else f"{x / GiB:.4f}"
    cols = ("peak_extra", "forward", "backward", "fresh", "over_floor", "target", "meets", "run 3")
    lines = [f"{'impl':15s}" + "".join(f"{c:>11s}" for c in cols) + "   (GiB)"]
    for r in rows:
        ok = "-" if r["meets_target"] is None else ("yes" if r["meets_target"] else "NO")
        vals = [g(r["peak_extra_bytes"]), g(r["forward_bytes"]), g(r["backward_bytes"]), g(r["peak_fresh_bytes"]),
                g(None if r["over_floor_GiB"] is None else r["over_floor_GiB"] * GiB),
                g(None if r["target_GiB"] is None else r["target_GiB"] * GiB), ok,
                g(None if r["run3_GiB"] is None else r["run3_GiB"] * GiB)]
        lines.append(f"{r['impl']:15s}" + "".join(f"{v:>11s}" for v in vals))
    return "\n".join(lines)


def main(argv=None):
    p = Parser(prog="python -m bench linear --live-bytes", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join("bench", "out"), help="output directory (default bench/out)")
    for k, v in SHAPE.items():
        p.add_argument(f"--{k}", type=int, default=v)
    p.add_argument("--chunk-mib", type=int, default=CHUNK_BYTES >> 20)
    a = p.parse_args(argv)
    return run(a.out, a.B, a.T, a.D, a.V, a.chunk_mib << 20)


def run(out, B=SHAPE["B"], T=SHAPE["T"], D=SHAPE["D"], V=SHAPE["V"], chunk_bytes=CHUNK_BYTES):
    """Count, print the table and write ``out/linear_live_bytes.json``."""
    import json
    import platform

    import triton
    rows, meta = measure(B, T, D, V, chunk_bytes=chunk_bytes)
    env = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "device": "none: meta tensors on the CPU"}  # (no peer runs here: common.env_info's imports not needed)
    print(table(rows))
    for r in rows:
        top = ", ".join(f"{n / GiB:.3f} {dt}{list(shape)} ({op})" for n, dt, shape, op in r["at_peak"][:4])
        print(f"  {r['impl']} at its peak: {top}")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "linear_live_bytes.json")
    with open(path, "w") as f:
        json.dump({"env": env, "meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {path}")
    return 0
