"""Run 8's profile target (issue 53, target 2): one call of fused.grpo at N = 8192, V = 128256, bf16, forward +
backward, as ``bench logits`` times it; ``ncu --clock-control none`` picks the kernel. ``MODE``: ``gif`` (the
gradient in the forward: the persistent grid), ``fold`` (the three-pass path: folded forward, then the backward
kernel). The first call compiles; the profiled one is the second (``--launch-skip``). A record of what ran.
Usage: gif_ncu.py MODE
"""
import sys

import torch

sys.path.insert(0, ".")
import humanline_kernels as hk  # noqa: E402
from bench.bench_logits import _inputs  # noqa: E402

mode = sys.argv[1]
x, y, ref = _inputs(8192, 128256, "cuda", torch.bfloat16)
adv = torch.randn(1, device="cuda")
for _ in range(2):
    loss = hk.fused.grpo(x, y, ref, adv, beta=0.04, validate=False, grad_in_forward=mode == "gif")[0]
    torch.autograd.grad(loss, x)
torch.cuda.synchronize()
print("done", mode)
