"""Host cost of one loss call: kernel launches, CPU enqueue time and GPU time, forward + backward.

``python -m bench host [--quick] [--out DIR] [--n N] [--vocab V] [--d D]``;
``python -m bench host --proxy [--triton] [--calls C] [--repeats R] [--out DIR]``: the host's glue without a GPU
(see :mod:`bench.host_proxy`: the compiled-kernel branch on tiny CPU tensors, every Triton launch stubbed, against a
minimal ``autograd.Function`` measured in the same run; ``--triton`` times each call through Triton's own launch
path too, up to a no-op driver launcher).

For each logits-level loss (and ``token_logprobs``) at ``N`` tokens x ``V`` (default 8192 x 32000, bf16) and each
fused-linear loss at ``D`` (default 2048): the number of device kernels one forward + backward launches (torch
profiler, CUDA kernel events), the CPU time to enqueue it (per call over a burst of calls issued back to back with
the GPU kept busy beforehand, so the host never waits; median; ``cpu_cold_ms``: the burst's first call alone, right
after a sync), and the GPU time (``do_bench`` median). docs/design.md's host target: launches <= 8
(logits) or <= 4 per chunk + 5 (fused linear), CPU time <= half the GPU time. ``--quick``: a CPU smoke run of the
harness (eager paths; launch counts are then aten ops, not kernels).
"""
from __future__ import annotations

import collections
import os
import statistics
import time

import torch

from . import common
from .cli import Parser


def _calls(N, V, D, device, dtype):
    import humanline_kernels as hk
    g = torch.Generator(device=device).manual_seed(0)
    B = 8
    T = N // B
    x = (torch.randn(B, T, V, device=device, generator=g) * 2).to(dtype).requires_grad_()
    y = torch.randint(0, V, (B, T), device=device, generator=g)
    y[:, : T // 8] = -100
    ref = torch.randn(B, T, device=device, generator=g) - 10.0
    adv = torch.randn(B, device=device, generator=g)
    des = torch.arange(B, device=device) % 2 == 0
    h = torch.randn(B, T, D, device=device, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, D, device=device, generator=g) * D ** -0.5).to(dtype).requires_grad_()
    kw = dict(validate=False)

    def grad(loss, wrt):
        return torch.autograd.grad(loss, wrt)

    kl_rows = (ref[:2], ref[:2] - 0.1, y[:2] != -100)  # made once: not part of the call being measured
    calls = {
        "token_logprobs": lambda: grad(hk.token_logprobs(x, y, **kw).sum(), x),
        "fused.grpo": lambda: grad(hk.fused.grpo(x, y, ref, adv, beta=0.04, **kw)[0], x),
        "fused.grpo(grad_in_fwd)": lambda: grad(hk.fused.grpo(x, y, ref, adv, beta=0.04, grad_in_forward=True,
                                                              **kw)[0], x),
        "fused.dpo": lambda: grad(hk.fused.dpo(x, y, ref, **kw)[0], x),
        "fused.kto": lambda: grad(hk.fused.kto(x, y, ref, des, *kl_rows, **kw)[0], x),
        "fused.grpo(validate=True)": lambda: grad(hk.fused.grpo(x, y, ref, adv, beta=0.04)[0], x),
        "fused_linear.grpo": lambda: grad(hk.fused_linear.grpo(h, w, y, ref, adv, **kw)[0], (h, w)),
        "fused_linear.dpo": lambda: grad(hk.fused_linear.dpo(h, w, y, ref, **kw)[0], (h, w)),
        "fused_linear.kto": lambda: grad(hk.fused_linear.kto(h, w, y, ref, des, *kl_rows, **kw)[0], (h, w)),
    }
    from humanline_kernels.ops import linear as LC
    rows = LC.max_rows_for(V, h.dtype, hk.fused_linear.CHUNK_BYTES)  # the chunks the calls above will cut
    chunks = {"fused_linear.grpo": len(LC.grpo_chunks(B, T, rows)), "fused_linear.dpo": len(LC.pair_chunks(B, T, rows)),
              "fused_linear.kto": len(LC.row_chunks(B, T, rows))}
    return calls, chunks


def _count_launches(fn, device):
    """``(launches, kernels)`` of one call: the device activity the torch profiler records (kernels, memsets, memcpys;
    aten ops on CPU) and, on CUDA, how many of each by name, so that a count over the budget says what the extra
    launches are (run 3: 12 for a one-chunk fused-linear loss where tests/ops/test_launch_budget.py counts 9 ops)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    if device == "cuda":
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        names = [e.name for e in prof.events() if e.name.startswith("aten::")]
    return len(names), dict(collections.Counter(_short(n) for n in names))


def _short(name, width=90):
    """A kernel's name without its template arguments, cut to ``width`` characters (cuBLAS's names run to
    thousands)."""
    out, depth = [], 0
    for ch in name:
        depth += (ch == "<") - (ch == ">") * (depth > 0)
        if depth == 0 and ch != ">":
            out.append(ch)
    return "".join(out).strip()[:width]


def _cpu_ms(fn, device, reps=30, burst=8):
    """``(warm ms, cold ms, drained)``, medians over ``reps``: the wall time of enqueueing ``fn`` while the GPU is still
    busy with earlier work (so no wait shows). ``warm``: per call over ``burst - 1`` calls issued back to back after a
    first one, as a training loop issues them; ``cold``: that first call alone, right after a
    ``torch.cuda.synchronize()`` that left the host idle while the queue drained (run 3 timed only this and got
    1.56 ms for ``token_logprobs``, whose whole call do_bench timed at 0.55 ms). ``drained``: in how many reps the GPU
    had run dry by the end of the burst (then the queue ahead was too short, or a call waited for the device, and
    that rep's time is not enqueue time alone)."""
    big = torch.randn(4096, 4096, device=device) if device == "cuda" else None
    warm, cold, drained = [], [], 0
    for _ in range(reps):
        if big is not None:
            torch.cuda.synchronize()
            for _ in range(20):  # ~50 ms of queued fp32 GEMMs ahead of the burst (estimated)
                big @ big
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        for _ in range(burst - 1):
            fn()
        t2 = time.perf_counter()
        cold.append((t1 - t0) * 1e3)
        warm.append((t2 - t1) * 1e3 / max(burst - 1, 1))
        if big is not None:
            drained += torch.cuda.current_stream().query()
    if device == "cuda":
        torch.cuda.synchronize()
    return statistics.median(warm), statistics.median(cold), drained


def _syncs(fn, device):
    """Whether one call synchronises the host with the device (torch's sync debug mode, CUDA only; else None)."""
    if device != "cuda":
        return None
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return False
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode("default")


def run(N, V, D, *, quick, out_dir):
    from humanline_kernels.ops import tuning
    # grad_in_fwd's row times the Triton kernel the option names, whatever the tuned table chose for this card (the
    # forcing is around the whole run: inside the timed call it would add its own host work to that row alone)
    with tuning.forced_path("triton"):
        return _run(N, V, D, quick=quick, out_dir=out_dir)


def _run(N, V, D, *, quick, out_dir):
    device = "cuda" if torch.cuda.is_available() and not quick else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    calls, chunks = _calls(N, V, D, device, dtype)
    rows, kernels = [], {}
    for i, (name, fn) in enumerate(calls.items()):
        print(f"[host {i + 1}/{len(calls)}] {name}", flush=True)
        fn()  # warm-up: compile, allocator
        launches, kernels[name] = _count_launches(fn, device)
        gpu = common.time_ms(fn, warmup=5 if quick else 25, rep=10 if quick else 100)
        reps = 3 if quick else 30
        cpu, cold, drained = _cpu_ms(fn, device, reps=reps, burst=2 if quick else 8)
        budget = 4 * chunks[name] + 5 if name in chunks else 8  # docs/design.md
        rows.append({"impl": name, "N": N, "V": V, "D": D if name in chunks else None, "launches": launches,
                     "launch_budget": budget, "cpu_ms": cpu, "cpu_cold_ms": cold, "gpu_ms": gpu,
                     "cpu_over_gpu": cpu / gpu,
                     "meets_host_target": launches <= budget and cpu <= 0.5 * gpu,
                     # the harness's own checks: a sync, or a GPU that ran dry during the timed call, makes cpu_ms
                     # more than enqueue time
                     "syncs": _syncs(fn, device),
                     "gpu_drained_reps": f"{drained}/{reps}" if device == "cuda" else None})
    meta = {"N": N, "V": V, "D": D, "dtype": str(dtype).replace("torch.", ""), "device": device,
            "what": "forward + backward of one call; launches = CUDA kernels, memsets and memcpys (aten ops on CPU)",
            "kernels": kernels}
    for r in rows:  # what a call over its budget launches (all of it is in the JSON's meta.kernels)
        if r["launches"] > r["launch_budget"]:
            print(f"{r['impl']}: {r['launches']} launches, budget {r['launch_budget']}: "
                  + ", ".join(f"{n} x{c}" for n, c in kernels[r["impl"]].items()))
    return common.save("host" + ("_quick" if quick else ""), rows, meta, out_dir, bar="cpu_over_gpu")


# the design's host targets for the proxy, as ratios to the floor (docs/design.md)
PROXY_TARGETS = {"logits": 1.5, "validate": 0.4, "fused_linear": 2.5}


def proxy_target(name):
    """The proxy's target ratio for an entry point (None for the floor and the peers)."""
    if name.startswith(("floor", "liger", "python lower bound")):
        return None
    if name.startswith("fused_linear"):
        return PROXY_TARGETS["fused_linear"] if "chunks" not in name and "a chunk" not in name else None
    return PROXY_TARGETS["logits"] + (PROXY_TARGETS["validate"] if "validate" in name else 0.0)


def run_proxy(calls, repeats, out_dir, triton=False):
    from . import host_proxy
    rows, meta = host_proxy.measure(calls=calls, repeats=repeats, progress=lambda s: print(s, flush=True),
                                    triton=triton)
    liger = [r["us_median"] for r in rows if r["impl"] == "liger triton_grpo_loss"]
    for r in rows:
        r["target"] = proxy_target(r["impl"])
        r["meets_target"] = None if r["target"] is None else r["ratio"] <= r["target"]
        r["vs_liger_grpo"] = r["us_median"] / liger[0] if liger else None
    meta["what"] = ("us per forward + backward of tiny CPU tensors, every Triton launch stubbed; ratio to a minimal "
                    "autograd.Function (floor) in the same run")
    if triton:
        meta["what"] += "; triton_us: the same call through Triton's JITFunction.run (a no-op driver launcher)"
    return common.save("host_proxy", rows, meta, out_dir, bar=("us_median", "triton_us") if triton else "ratio",
                       logx=True, target=None if triton else "target")


def main(argv=None):
    p = Parser(prog="python -m bench host", description=__doc__.split("\n")[0])
    p.add_argument("--proxy", action="store_true", help="the host's glue on CPU, launches stubbed (no GPU needed)")
    p.add_argument("--triton", action="store_true",
                   help="--proxy: also through Triton's own launch path (compiles each variant for sm_90 once)")
    p.add_argument("--calls", type=int, default=200, help="--proxy: calls per timed window (default 200)")
    p.add_argument("--repeats", type=int, default=15, help="--proxy: timed windows per entry point (default 15)")
    p.add_argument("--quick", action="store_true", help="tiny CPU smoke of the harness")
    p.add_argument("--out", default=os.path.join("bench", "out"))
    p.add_argument("--n", type=int, default=None, help="tokens (default 8192; 64 with --quick)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default 32000; 500 with --quick)")
    p.add_argument("--d", type=int, default=None, help="hidden size of the fused-linear calls (default 2048)")
    a = p.parse_args(argv)
    if a.triton and not a.proxy:
        p.error("--triton goes with --proxy (on a GPU, bench host times Triton's launches as they run)")
    if a.proxy:
        if a.calls < 1 or a.repeats < 1:
            p.error("--calls and --repeats must be positive")
        run_proxy(a.calls, a.repeats, a.out, triton=a.triton)
        return 0
    N = a.n or (64 if a.quick else 8192)
    V = a.vocab or (500 if a.quick else 32000)
    D = a.d or (32 if a.quick else 2048)
    if N % 16:
        p.error("--n must be a multiple of 16 (8 rows, DPO pairs)")
    run(N, V, D, quick=a.quick, out_dir=a.out)
    return 0
