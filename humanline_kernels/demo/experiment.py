"""The experiment: the setup (the behaviour model, the starting policy, the offline data), every arm at every
learning rate of the grid for every seed (in worker processes on CPU), the table, the verdict and the plot."""
from __future__ import annotations

import os
import sys
import time

import torch

import humanline_kernels as hk

from . import arms, stats, task

DEFAULT_LRS = (3e-4, 1e-3, 3e-3)


def cpu_capability():
    """The vector instruction set ATen dispatches to on this CPU (AVX512, AVX2, DEFAULT ...)."""
    return torch.backends.cpu.get_cpu_capability()


def cores():
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def run(objective="dpo", steps=60, seeds=8, lrs=DEFAULT_LRS, seed=0, device="auto", batch=16, sft_steps=100,
        eval_n=256, clip=None, sync_every=None, resample_every=10, plot_path=None, workers=None, quiet=False,
        out=sys.stdout, pool_prompts=512):
    """Run the three arms over the learning-rate grid and seeds; print the table and verdict; return the numbers."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    clip = clip or hk.HumanlineClip()
    # the paper's defaults: sync every step for instruction following, every 12-24 steps for GRPO
    sync_every = sync_every or (12 if objective == "grpo" else 1)
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        def tqdm(it, **_):
            return it
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)  # tiny models: one thread per process is faster (see _workers)
    try:
        return _run(objective, steps, seeds, lrs, seed, device, batch, sft_steps, eval_n, clip, sync_every,
                    resample_every, plot_path, workers, quiet, out, tqdm, pool_prompts)
    finally:
        torch.set_num_threads(threads)


def _cpu_s():
    """CPU seconds of this process and of its children that have ended (the worker processes, once joined); this
    process's alone where there is no ``resource`` module (Windows)."""
    try:
        import resource
    except ImportError:  # pragma: no cover
        return time.process_time()
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


def _run(objective, steps, seeds, lrs, seed, device, batch, sft_steps, eval_n, clip, sync_every, resample_every,
         plot_path, workers, quiet, out, tqdm, pool_prompts):
    t0, cpu0 = time.perf_counter(), _cpu_s()
    gen = torch.Generator().manual_seed(seed)
    behaviour = task.fit_sft(task.make_model(seed + 1, device), sft_steps, gen, device, p_rule=0.3, p_whole=0.5)
    start = task.fit_sft(task.make_model(seed + 2, device), sft_steps, gen, device, p_rule=0.6)
    pool = arms.offline_pool(behaviour, pool_prompts, gen, device) if objective != "grpo" else None
    info = {"objective": objective, "steps": steps, "batch": batch, "seeds": seeds, "lrs": list(lrs), "seed": seed,
            "sft_steps": sft_steps, "eval_n": eval_n, "device": device,
            "cpu": cpu_capability() if device == "cpu" else None, "clip": clip, "sync_every": sync_every,
            "resample_every": resample_every,
            "behaviour": task.rule_rate(behaviour, torch.Generator().manual_seed(seed), device, eval_n),
            "start": task.rule_rate(start, torch.Generator().manual_seed(seed), device, eval_n)}
    info["setup_s"] = time.perf_counter() - t0
    grid = [(arm, lr, seed * 1000 + s) for s in range(seeds) for lr in lrs for arm in arms.ARMS]
    common = dict(objective=objective, steps=steps, batch=batch, clip=clip, sync_every=sync_every,
                  resample_every=resample_every, device=device, eval_every=max(1, steps // 6), eval_n=eval_n,
                  curve_n=min(eval_n, 128))
    bar = (lambda it, total: it) if quiet else (
        lambda it, total: tqdm(it, total=total, desc=f"{objective}: arms x lrs x seeds", leave=False))
    workers = _workers(workers, device, len(grid))
    if workers == 1:
        runs = [arms.train_arm(arm, start=start, pool=pool, lr=lr, seed=s, **common)
                for arm, lr, s in bar(grid, len(grid))]
    else:
        runs = _run_pool(grid, start, pool, common, workers, bar)
    info["workers"] = workers
    best = stats.select_best(runs)
    info["total_s"], info["cpu_s"] = time.perf_counter() - t0, _cpu_s() - cpu0
    print_table(best, info, out)
    line = stats.verdict(best, objective)
    print(line, file=out)
    shown = plot(best, plot_path, info) if plot_path else None
    if shown:
        print(shown, file=out)
    return {"best": best, "runs": runs, "info": info, "verdict": line}


# ------------------------------------------------------------------------------------------- worker processes
def _workers(asked, device, jobs):
    """CPU: one process per core (up to 4), one thread each: the models are so small that intra-op threads
    only add overhead, while the runs of the grid are independent. CUDA: one process."""
    if asked is not None:
        return max(1, min(asked, jobs))
    if device != "cpu":
        return 1
    return max(1, min(cores(), 4, jobs))


def _worker_init(threads):
    torch.set_num_threads(threads)


def _worker_run(job):
    arm, lr, s, state, pool, common = job
    start = task.make_model(0, common["device"])
    start.load_state_dict(state)
    return arms.train_arm(arm, start=start, pool=pool, lr=lr, seed=s, **common)


def _run_pool(grid, start, pool, common, workers, bar):
    import concurrent.futures as cf
    import multiprocessing as mp

    state = {k: v.detach().cpu() for k, v in start.state_dict().items()}
    # spawn, not fork: a forked child of a process that already ran torch's thread pools can deadlock
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init, initargs=(1,)) as ex:
        futures = {ex.submit(_worker_run, (arm, lr, s, state, pool, common)): i
                   for i, (arm, lr, s) in enumerate(grid)}
        runs = [None] * len(grid)
        for f in bar(cf.as_completed(futures), len(futures)):
            runs[futures[f]] = f.result()
    return runs


# ------------------------------------------------------------------------------------------- table and plot
def print_table(best, info, out):
    print(f"\nhumanline demo: {info['objective']}, {info['steps']} steps x {info['batch']} sequences, "
          f"{info['seeds']} seeds, learning rates {', '.join(f'{x:g}' for x in info['lrs'])}, device={info['device']}"
          + (f" ({info['cpu']})" if info.get("cpu") else "") + "; "
          f"clip [{info['clip'].log_eps_p}, {info['clip'].log_eps_r}], sync every {info['sync_every']}"
          + (f", offline samples redrawn every {info['resample_every']} steps" if info["objective"] == "grpo" else "")
          + f"; setup {info['setup_s']:.1f}s, total {info['total_s']:.1f}s with {info['workers']} process(es) "
          f"({info['cpu_s']:.0f} CPU s)",
          file=out)
    print(f"rule rate of the behaviour model (offline data) {info['behaviour']:.3f}, "
          f"of the starting policy {info['start']:.3f}", file=out)
    head = (f"{'arm':<18} {'rule_rate':>15} {'heldout':>8} {'clip_frac':>9} {'syncs':>5} {'wall_s':>7} "
            f"{'sample_s':>8} {'best_lr':>8}")
    print(head, file=out)
    print("-" * len(head), file=out)
    for arm in arms.ARMS:
        r = best[arm]
        cf = "off" if r["clip_frac"] is None else f"{r['clip_frac']:.3f}"
        rate = f"{r['rule_rate']:.3f} +- {r['se']:.3f}"
        print(f"{arm:<18} {rate:>15} {r['heldout']:>8.3f} {cf:>9} {r['syncs']:>5} {r['wall_s']:>7.2f} "
              f"{r['sample_s']:>8.2f} {r['lr']:>8.0e}", file=out)
    print("rule_rate: reported prompts, mean +- s.e. over seeds at the arm's best learning rate (chosen on the "
          "held-out prompts: heldout); clip_frac: mean fraction of tokens clamped; wall_s: seconds per run of "
          "training, sampling included (sample_s).", file=out)


def plot(best, path, info):
    """The rule rate over training of each arm at its best learning rate (mean +- s.e. over seeds), to ``path``."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for arm in arms.ARMS:
        runs = best[arm]["runs"]
        steps = [s for s, _ in runs[0]["curve"]]
        points = [stats.mean_se([r["curve"][i][1] for r in runs]) for i in range(len(steps))]
        mean = [m for m, _ in points]
        se = [0.0 if s != s else s for _, s in points]
        line, = ax.plot(steps, mean, marker="o", ms=3, label=f"{arm} (lr {best[arm]['lr']:g})")
        ax.fill_between(steps, [m - s for m, s in zip(mean, se)], [m + s for m, s in zip(mean, se)],
                        color=line.get_color(), alpha=0.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("rule rate of own samples")
    ax.set_title(f"{info['objective'].upper()}: {info['seeds']} seeds, mean +- s.e., best lr per arm")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"
