"""Run 8, call 5 (H200; issue 53, target 1): ncu's view of the folded forward kernel of fused.dpo and fused.kto
(call 4: KTO's is 535 us against DPO's 498 at V = 128256; the backward kernels are equal). Two calls; ncu profiles
the second's forward kernel (``--launch-skip 1``). A record of what ran. Usage: kto_ncu.py dpo|kto
"""
import sys

import torch

sys.path.insert(0, ".")
import humanline_kernels as hk  # noqa: E402
from bench.bench_logits import _inputs  # noqa: E402

mode = sys.argv[1]
V = 128256
x, y, ref = _inputs(8192, V, "cuda", torch.bfloat16)
N = x.shape[1]
half = ref.new_zeros(2, N // 2)
des = torch.tensor([True, False], device="cuda")
for _ in range(2):
    v = x.view(2, N // 2, V)
    loss = (hk.fused.dpo(v, y.view(2, -1), half, validate=False) if mode == "dpo" else
            hk.fused.kto(v, y.view(2, -1), half, des, validate=False))[0]
    torch.autograd.grad(loss, x)
torch.cuda.synchronize()
print("done", mode)
