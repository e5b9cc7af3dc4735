"""The kernel-level profile that e2e_gap.py's last branch asks for: where offline_ref's and lookahead's steps differ.
Both run bench e2e's arm at its full size (the same model, data and optimizer); a few steps of each are recorded by
torch.profiler after the warm-up. Per step: the GPU span (first kernel start to last kernel end), the time some
kernel runs (the union of kernel intervals: a gap is GPU idle, e.g. the host behind), and each kernel family's
summed time; then the families whose time differs most between the two arms. ``--quick``: the CPU smoke size
(CPU ops in place of kernels; the times mean nothing). Writes profile.json into OUT when given."""
import argparse
import json
import re
import sys
from collections import defaultdict
from types import SimpleNamespace

import torch
from e2e_gap import setup

from bench import bench_e2e as E

ARMS = ("offline_ref", "lookahead")
# kernel name -> family: the GEMMs (cuBLAS/cuBLASLt/nvjet), attention, our Triton kernels, the optimizer, the rest
FAMILIES = (("gemm", r"nvjet|gemm|cutlass|sm90_xmma|cublas|ampere_|sm80_"), ("attention", r"flash|fmha|attention|sdpa"),
            ("hk triton", r"_kernel|_fold|_terms|_linear|_grad|_fwd|_bwd"), ("adamw", r"adam|multi_tensor"),
            ("copy", r"copy|Memcpy|memcpy"), ("elementwise/reduce", r"elementwise|reduce|vectorized|index|cat"))


def family(name):
    for fam, pat in FAMILIES:
        if re.search(pat, name, re.IGNORECASE):
            return fam
    return "other"


def _union(intervals):
    busy, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy


def work(events, cuda):
    """The profiled events that are work: the GPU's (kernels, copies, memsets) on CUDA, leaf CPU ops on the smoke
    size. The step annotations are left out: on a GPU they appear on its timeline too (gpu_user_annotation),
    spanning the step's kernels, and counted as work they hide its idle time (run 10's first profile did that)."""
    if cuda:
        return [e for e in events
                if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("hk_step_")]
    return [e for e in events if not e.cpu_children and not e.name.startswith("hk_step_")]


def profile_arm(arm, a, device, dtype, steps):
    cuda = device == "cuda"
    step, _, _ = E._build(arm, a, device, dtype)
    for i in range(a.warmup):
        step(i)
    if cuda:
        torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        for k in range(steps):
            with torch.profiler.record_function(f"hk_step_{k}"):
                step(a.warmup + k)
        if cuda:
            torch.cuda.synchronize()
    kern = work(prof.events(), cuda)
    iv = [(e.time_range.start, e.time_range.end) for e in kern]
    span = (max(x[1] for x in iv) - min(x[0] for x in iv)) if iv else 0.0
    busy = _union(iv)
    fam, top = defaultdict(float), defaultdict(lambda: [0.0, 0])
    for e in kern:
        d = e.time_range.end - e.time_range.start
        fam[family(e.name)] += d
        top[e.name][0] += d
        top[e.name][1] += 1
    per = 1e3 * steps  # us -> ms a step
    out = {"steps": steps, "span_ms": span / per, "busy_ms": busy / per, "idle_ms": (span - busy) / per,
           "kernels_a_step": len(kern) / steps, "families_ms": {k: v / per for k, v in sorted(fam.items())},
           "kernels_ms": {k: [v[0] / per, v[1] / steps] for k, v in top.items()}}
    del step
    E._free(device)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", help="folder for profile.json")
    p.add_argument("--quick", action="store_true", help="tiny fp32 model on CPU (a smoke run)")
    p.add_argument("--steps", type=int, default=4, help="profiled steps an arm (default 4)")
    a = p.parse_args(argv)
    cfg, device, dtype = setup(p, a)
    cfg = SimpleNamespace(**cfg)
    res = {}
    for arm in ARMS:
        res[arm] = r = profile_arm(arm, cfg, device, dtype, a.steps)
        print(f"{arm}: span {r['span_ms']:.2f} ms/step, kernels busy {r['busy_ms']:.2f}, idle {r['idle_ms']:.2f}, "
              f"{r['kernels_a_step']:.0f} kernels/step", flush=True)
    x, y = (res[k] for k in ARMS)
    fams = sorted(set(x["families_ms"]) | set(y["families_ms"]))
    print(f"{'family':20s} {ARMS[0]:>12s} {ARMS[1]:>12s} {'diff ms':>9s}")
    for f in fams:
        u, v = x["families_ms"].get(f, 0.0), y["families_ms"].get(f, 0.0)
        print(f"{f:20s} {u:12.3f} {v:12.3f} {v - u:+9.3f}")
    names = set(x["kernels_ms"]) | set(y["kernels_ms"])
    diff = sorted(names, key=lambda n: -abs(y["kernels_ms"].get(n, [0, 0])[0] - x["kernels_ms"].get(n, [0, 0])[0]))
    print("kernels whose time a step differs most (ms a step, calls a step):")
    for n in diff[:25]:
        u, v = x["kernels_ms"].get(n, [0.0, 0]), y["kernels_ms"].get(n, [0.0, 0])
        print(f"  {v[0] - u[0]:+8.3f}  {u[0]:8.3f} ({u[1]:g})  {v[0]:8.3f} ({v[1]:g})  {n[:110]}")
    summary = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
               "arms": {k: {kk: vv for kk, vv in r.items() if kk != "kernels_ms"} for k, r in res.items()},
               "top_kernel_diffs_ms": {n[:200]: [x["kernels_ms"].get(n, [0, 0])[0], y["kernels_ms"].get(n, [0, 0])[0]]
                                       for n in diff[:40]}}
    if a.out:
        with open(f"{a.out}/profile.json", "w") as f:
            json.dump(summary, f, indent=1)
    print(json.dumps({k: {kk: round(vv, 3) for kk, vv in r.items() if kk in ("span_ms", "busy_ms", "idle_ms")}
                      for k, r in res.items()}), flush=True)
    return summary


if __name__ == "__main__":
    sys.exit(main() and 0)
