"""Run 8, call 4 (an H200; issue 53, target 1): where KTO's extra ~37 us over DPO goes at V = 128256 / 151936.

Call 3 (``graph_gap``) showed it is not the host: as a CUDA graph KTO is 1.065x the 3-pass floor against DPO's
1.042x. Each kernel's own time under the torch profiler (CUPTI), mean of 20 forward + backward calls, per name.
A record of what ran. Usage: kernel_times.py OUT
"""
import collections
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".")
import humanline_kernels as hk  # noqa: E402
from bench.bench_logits import _inputs  # noqa: E402

out = sys.argv[1]
res = {}
for V in (128256, 151936):
    x, y, ref = _inputs(8192, V, "cuda", torch.bfloat16)
    N = x.shape[1]
    half = ref.new_zeros(2, N // 2)
    des = torch.tensor([True, False], device="cuda")
    calls = {
        "dpo": lambda v: hk.fused.dpo(v.view(2, N // 2, V), y.view(2, -1), half, validate=False)[0],
        "kto": lambda v: hk.fused.kto(v.view(2, N // 2, V), y.view(2, -1), half, des, validate=False)[0],
    }
    for name, fn in calls.items():
        leaf = x.detach().requires_grad_()
        for _ in range(3):
            torch.autograd.grad(fn(leaf), leaf)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                torch.autograd.grad(fn(leaf), leaf)
            torch.cuda.synchronize()
        t = collections.defaultdict(list)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                t[e.name].append(e.device_time if hasattr(e, "device_time") else e.cuda_time)
        res[f"{name} V={V}"] = {k: {"n": len(v), "mean_us": sum(v) / len(v)} for k, v in t.items()}
        print(f"V={V} {name}:", {k[:40]: round(sum(v) / len(v), 1) for k, v in t.items()}, flush=True)
json.dump(res, open(f"{out}/kernel_times.json", "w"), indent=1)
