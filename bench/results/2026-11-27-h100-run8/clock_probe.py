"""Run 8's clock probe (issue 54, target 3): why does a copy that needs no SM still cost compute-bound GEMMs time?

Run 7 (H200) showed a same-dtype device copy runs beside a kernel holding every SM (the copy engines), yet under
``bench sync``'s GEMM chain it added +0.72-0.77 %, against +1.62 % for our copy kernel. One candidate: the power
limit. 8192^3 bf16 GEMMs run an H100 at its power cap; the copy's HBM traffic takes power, and the SM clock drops
for everyone. If so, the GEMMs' loss tracks the clock, and no placement of the copy removes it.
Four phases of 20 windows each (a window: 60 GEMMs of 8192^3 on the main stream; beside them on a side stream
nothing, or 16 copies of 1 GiB bf16 by ``copy_`` (cudaMemcpyAsync: copy engines), by a same-dtype kernel
(``torch.mul(src, 1)``), or fp32 -> bf16 casts (a kernel) of the same element count), with ``nvidia-smi`` sampling
SM clock, power and the throttle reasons every 10 ms. Writes ``OUT/clock_probe.json``. A record of what ran.
"""
import json
import statistics
import subprocess
import sys
import time

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
src32 = torch.randn(E, device=dev)
side = torch.cuda.Stream()
COPIES = 16
copies = {
    "none": None,
    "copy_ (copy engines)": lambda: dst.copy_(src),
    "kernel same dtype (mul by 1)": lambda: torch.mul(src, 1, out=dst),
    "kernel fp32->bf16 cast": lambda: dst.copy_(src32),
}
reason = "clocks_event_reasons.active"  # (called clocks_throttle_reasons.active before driver 535)
if subprocess.run(["nvidia-smi", f"--query-gpu={reason}", "--format=csv"], capture_output=True).returncode:
    reason = "clocks_throttle_reasons.active"
fields = f"timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,{reason}"
smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-lms", "10"],
                       stdout=subprocess.PIPE, text=True)


def window(copy):
    main = torch.cuda.current_stream()
    s0, s1, c1 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    s0.record(main)
    if copy is not None:
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for _ in range(COPIES):
                copy()
            c1.record(side)
    for _ in range(60):
        torch.mm(a, b, out=c)
    s1.record(main)
    if copy is not None:
        main.wait_stream(side)
    torch.cuda.synchronize()
    return s0.elapsed_time(s1), (s0.elapsed_time(c1) if copy is not None else 0.0)


for copy in copies.values():  # warm every path (and the clocks) first
    window(copy)
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copies_per_window": COPIES,
       "copy_bytes_each": E * 2, "phases": {}}
for _ in range(2):  # two rounds, phases interleaved, so drift over time shows as a round-to-round difference
    for name, copy in copies.items():
        alone = copy is None
        # the copy alone (no GEMMs): its own time, for the bytes moved
        t_copy = None
        if not alone:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(COPIES):
                copy()
            e1.record()
            torch.cuda.synchronize()
            t_copy = e0.elapsed_time(e1)
        t0 = time.time()
        g, cp = zip(*(window(copy) for _ in range(20)))
        t1 = time.time()
        ph = res["phases"].setdefault(name, {"windows": [], "spans": [], "copy_alone_ms": [], "copy_beside_ms": []})
        ph["windows"] += list(g)
        ph["copy_beside_ms"] += list(cp)
        ph["spans"].append([t0, t1])
        if t_copy is not None:
            ph["copy_alone_ms"].append(t_copy)
time.sleep(0.1)
smi.terminate()
samples = []
for line in smi.stdout.read().splitlines():
    p = [x.strip() for x in line.split(",")]
    try:
        ts = time.mktime(time.strptime(p[0].split(".")[0], "%Y/%m/%d %H:%M:%S")) + float("0." + p[0].split(".")[1])
        samples.append((ts, float(p[1]), float(p[2]), float(p[3]), float(p[4]), p[5]))
    except (ValueError, IndexError):
        continue
base = statistics.median(res["phases"]["none"]["windows"])
print(f"{'phase':32} {'GEMM window ms':>15} {'added %':>8} {'copy alone ms':>14} {'SM MHz':>7} {'W':>6} throttle")
for name, ph in res["phases"].items():
    inside = [s for s in samples if any(t0 + 0.05 <= s[0] <= t1 for t0, t1 in ph["spans"])]
    ph["samples"] = len(inside)
    ph["sm_mhz"] = statistics.mean(s[1] for s in inside) if inside else None
    ph["power_w"] = statistics.mean(s[3] for s in inside) if inside else None
    ph["throttle"] = sorted({s[5] for s in inside})
    ph["median_window_ms"] = statistics.median(ph["windows"])
    ph["added_pct"] = 100 * (ph["median_window_ms"] / base - 1)
    ca = statistics.median(ph["copy_alone_ms"]) if ph["copy_alone_ms"] else 0.0
    print(f"{name:32} {ph['median_window_ms']:15.2f} {ph['added_pct']:8.2f} {ca:14.2f} "
          f"{ph['sm_mhz'] or 0:7.0f} {ph['power_w'] or 0:6.0f} {','.join(ph['throttle'])} ({len(inside)} samples)")
res["samples"] = samples
json.dump(res, open(f"{out}/clock_probe.json", "w"), indent=1)
