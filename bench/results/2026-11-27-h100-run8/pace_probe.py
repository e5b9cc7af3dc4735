"""Run 8, call 2 (issue 54, target 3): does a copy spread over the GEMM chain cost less than one issued at once?

Call 1's clock probe: beside 60 GEMMs of 8192^3 (bf16, power-capped at ~1370 MHz), 16 GiB copied at once cost the
GEMMs ~80 % of the copy's own time whether ``copy_`` (copy engines) or a kernel did it, and the SM clock did not
drop: not SMs, not power, but the memory system. A compute-bound GEMM leaves HBM bandwidth unused; a copy that asks
for it at a lower rate might fit beside. Phases (20 windows each, interleaved twice): the GEMMs alone; 15 copies of
1 GiB queued at once; the same 15 copies paced, one after every 4th GEMM (the side stream waits on an event the
main stream records); and the sync's real size (2.46 GB, bf16, one copy) at once and paced in 15 slices. Writes
``OUT/pace_probe.json``. A record of what ran. Usage: pace_probe.py OUT
"""
import json
import statistics
import sys

import torch

out = sys.argv[1]
dev = torch.device("cuda")
n = 8192
a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
E = 1 << 29  # 1 GiB of bf16
src = torch.randn(E, device=dev).to(torch.bfloat16)
dst = torch.empty_like(src)
S = 1_230_000_000  # the 1.5 B model's bf16 sync: 2.46 GB
ssrc = torch.empty(S, device=dev, dtype=torch.bfloat16).normal_()
sdst = torch.empty_like(ssrc)
side = torch.cuda.Stream()
big = [(dst, src)] * 15
sl = [(sdst[i * (S // 15):(i + 1) * (S // 15)], ssrc[i * (S // 15):(i + 1) * (S // 15)]) for i in range(15)]
whole = [(sdst, ssrc)]


def window(pairs, paced):
    main = torch.cuda.current_stream()
    s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s0.record(main)
    side.wait_stream(main)
    k = 0
    for i in range(60):
        torch.mm(a, b, out=c)
        if pairs and (not paced and i == 0 or paced and i % 4 == 0 and k < len(pairs)):
            todo = pairs if not paced else [pairs[k]]
            k += 1
            if paced:
                side.wait_stream(main)
            with torch.cuda.stream(side):
                for d, s in todo:
                    d.copy_(s)
    s1.record(main)
    main.wait_stream(side)
    torch.cuda.synchronize()
    return s0.elapsed_time(s1)


phases = {"alone": ([], False), "15 GiB at once": (big, False), "15 GiB paced": (big, True),
          "sync 2.46 GB at once": (whole, False), "sync 2.46 GB paced (15 slices)": (sl, True)}
for p in phases.values():
    window(*p)
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "phases": {k: [] for k in phases}}
for _ in range(2):
    for name, p in phases.items():
        res["phases"][name] += [window(*p) for _ in range(20)]
base = statistics.median(res["phases"]["alone"])
res["summary"] = {}
for name, w in res["phases"].items():
    med = statistics.median(w)
    res["summary"][name] = {"median_ms": med, "added_pct": 100 * (med / base - 1),
                            "spread_pct": 100 * (max(w) - min(w)) / med}
    print(f"{name:34s} {med:8.2f} ms  added {100 * (med / base - 1):6.2f} %  (min {min(w):.2f}, max {max(w):.2f})")
json.dump(res, open(f"{out}/pace_probe.json", "w"), indent=1)
