"""Run 8's host profile (issue 53, target 3): where the burst CPU time of one forward + backward goes on the GPU
machine's host. Run 5 measured fused.grpo at 0.729 ms of CPU a call against dpo's 0.516 (same 3 launches) and
grpo with the gradient in the forward at 0.461, where the CPU host proxy puts grpo's glue only ~22 us above dpo's:
the extra ~0.2 ms is something only a CUDA host shows. For each call of ``bench host`` (N = 8192, V = 32000,
bf16): the median CPU time of a call with the GPU kept busy (so the host never waits), then cProfile over 300
calls, the top functions by their own time. A record of what ran, not package code. Usage: host_profile.py OUT
"""
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from bench.bench_host import _calls  # noqa: E402

out = sys.argv[1]
calls, _ = _calls(8192, 32000, 2048, "cuda", torch.bfloat16)
names = ["token_logprobs", "fused.grpo", "fused.grpo(grad_in_fwd)", "fused.dpo", "fused.kto"]
busy = torch.randn(4096, 4096, device="cuda")


def keep_busy(k=40):
    for _ in range(k):
        busy @ busy


report = io.StringIO()
for name in names:
    fn = calls[name]
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        keep_busy()
        for _ in range(8):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    med = statistics.median(times) * 1e3
    prof = cProfile.Profile()
    for _ in range(15):
        keep_busy()
        prof.enable()
        for _ in range(20):
            fn()
        prof.disable()
        torch.cuda.synchronize()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s).sort_stats("tottime")
    st.print_stats(22)
    print(f"=== {name}: median CPU {med:.3f} ms a call (unprofiled, 80 calls)", file=report)
    print(s.getvalue(), file=report)
    print(f"{name}: median CPU {med:.3f} ms", flush=True)
open(f"{out}/host_profile.txt", "w").write(report.getvalue())
print(report.getvalue()[:6000])
