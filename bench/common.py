"""Shared benchmark helpers: timing, peak memory, copy-bandwidth floor, environment record, JSON/PNG/table output.

Timings are medians of ``triton.testing.do_bench`` on CUDA for calls of a few ms (its ``warmup`` and ``rep`` are
milliseconds: a 37 ms call at ``rep=20`` is timed once), and of CUDA events around each call in interleaved rounds
(``call_ms``, ``interleaved``) for calls of tens of ms; on CPU (smoke runs only) a plain median of wall times.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time

import torch


def env_info() -> dict:
    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": (torch.cuda.get_device_name() if torch.cuda.is_available()
                   else f"cpu ({platform.processor() or platform.machine()})"),
        "cuda": torch.version.cuda,
    }
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = None
    from importlib import metadata
    for mod, dist in (("liger_kernel", "liger-kernel"), ("quack", "quack-kernels"), ("trl", "trl"),
                      ("cut_cross_entropy", "cut-cross-entropy")):
        try:
            m = __import__(mod)
        except Exception:
            info[mod] = None
            continue
        try:  # (Liger has no __version__: run 5 recorded "installed" for its 0.8.5 wheel)
            info[mod] = getattr(m, "__version__", None) or metadata.version(dist)
        except Exception:
            info[mod] = "installed"
    # the version of the package that ran (an older one is compared by running it: bench logits --baseline)
    import subprocess
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=30)
        info["commit"] = out.stdout.strip() or None
    except Exception:
        info["commit"] = None
    return info


def driver_version() -> str | None:
    """The NVIDIA driver version (``nvidia-smi``), or None without one."""
    if not torch.cuda.is_available():
        return None
    import subprocess
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:
        return None
    return out.splitlines()[0] if out else None


def time_ms(fn, *, warmup=25, rep=100) -> float:
    """Median milliseconds of ``fn()``."""
    if torch.cuda.is_available():
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    fn()
    times = []
    for _ in range(max(3, min(rep // 10, 10))):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def call_ms(calls, device) -> list[float]:
    """Milliseconds of each call in ``calls`` (zero-argument callables, run in order): CUDA events around each call
    on ``device == "cuda"`` (the GPU's time for it, the host running ahead; one synchronize at the end), the wall
    clock on the CPU. For calls of tens of ms whose every time is kept (an e2e step, a sync step's round)."""
    if device != "cuda":
        out = []
        for fn in calls:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in calls]
    for fn, (start, end) in zip(calls, ev):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in ev]


def interleaved(fns, device, rounds=6, calls=5):
    """Median ms of each step in ``fns`` (name -> callable) over ``rounds`` x ``calls`` calls, timed in rounds that
    run every step ``calls`` times in turn, so that the card's drift (clock, temperature) falls on every row alike
    instead of on the rows measured last: run 10 (H200) timed bench sync's GEMM chain alone 0.8 % slower at the end
    of the sequential table than at its start, as much as the differences between the rows, and run 11 timed bench
    linear's GEMM floor 36.6 and 38.3 ms in two stages of one call. Also each step's median in each round (a row's
    spread). For steps of tens of ms (``call_ms``)."""
    for fn in fns.values():  # warm-up: compile, allocate, a paced syncer learns its points
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    times, by_round = {k: [] for k in fns}, {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = call_ms([fn] * calls, device)  # CUDA events around each call: the GPU's time for the step
            times[name] += t
            by_round[name].append(statistics.median(t))
    return {k: statistics.median(v) for k, v in times.items()}, by_round


def peak_extra_bytes(fn) -> int | None:
    """Peak CUDA memory allocated by ``fn()`` beyond what was allocated before it (None on CPU)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def copy_bandwidth_bytes_per_ms(nbytes=1 << 30, device=None) -> float:
    """Device copy bandwidth (bytes read + written per ms) of a plain ``dst.copy_(src)``, measured now."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        nbytes = min(nbytes, 64 << 20)
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms


def save(name: str, rows: list[dict], meta: dict, out_dir: str, *, x: str | None = None, y: str = "ratio_to_floor",
         series: str = "impl", bar: str | tuple | None = None, label: tuple = (), logx: bool = False,
         target: str | None = None) -> str:
    """Print ``rows`` as a table, write ``out_dir/name.json`` and a PNG, and print the paths written.

    The PNG is a line plot of ``y`` against ``x`` per ``series`` or, with ``bar``, horizontal bars of that column
    (a tuple of columns: one panel each, side by side) labelled by ``series`` and the ``label`` columns, on a log
    axis with ``logx``, each row's ``target`` column (when given and set) marked on its bar; without matplotlib it
    is skipped, and said so."""
    os.makedirs(out_dir, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    widths = {k: max(len(k), *(len(_fmt(r.get(k))) for r in rows)) for k in keys}
    print("  ".join(k.ljust(widths[k]) for k in keys))
    for r in rows:
        print("  ".join(_fmt(r.get(k)).ljust(widths[k]) for k in keys))
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"env": env_info(), "meta": meta, "rows": rows}, f, indent=2)
    print(f"wrote {path}")
    if x is None and bar is None:
        return path
    plt = pyplot()
    if plt is None:
        print(f"no plot for {name}: matplotlib is not installed (pip install matplotlib, or the .[bench] extra)")
        return path
    if bar is not None:
        bars = (bar,) if isinstance(bar, str) else tuple(bar)
        fig, axes = plt.subplots(1, len(bars), figsize=(8 * len(bars) ** 0.5, 0.3 * len(rows) + 1.2), squeeze=False)
        for ax, col in zip(axes[0], bars):
            shown = [r for r in rows if r.get(col) is not None][::-1]
            names = [" ".join(str(r.get(k)) for k in (series, *label)) for r in shown]
            ax.barh(names, [r[col] for r in shown])
            marks = [(n, r[target]) for n, r in zip(names, shown) if target and r.get(target) is not None]
            if marks:
                ax.scatter([v for _, v in marks], [n for n, _ in marks], marker="|", s=300, color="red",
                           zorder=3, label=target)
                ax.legend(fontsize=7)
            if logx:
                ax.set_xscale("log")
            ax.set_xlabel(col + (" (log scale)" if logx else ""))
    else:
        fig, ax = plt.subplots(figsize=(7, 4))
        styles = [(m, ls) for ls in ("-", "--", ":") for m in ("o", "s", "^", "D")]  # tell 10+ series apart
        for i, s in enumerate(dict.fromkeys(r.get(series) for r in rows)):
            pts = [(r[x], r[y]) for r in rows if r.get(series) == s and r.get(y) is not None]
            if pts:
                m, ls = styles[i % len(styles)]
                ax.plot(*zip(*pts), marker=m, linestyle=ls, color=plt.cm.tab20(i % 20), label=str(s))
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.legend(fontsize=7)
    fig.suptitle(f"{name} ({env_info()['device']})", fontsize=9)
    fig.tight_layout()
    png = os.path.join(out_dir, f"{name}.png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    print(f"wrote {png}")
    return path


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    return plt


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)
