"""Run 8, call 2 (issue 53, target 2): the persistent gradient-in-forward grid's launch shapes, timed in one process.

Call 1's ncu (``ncu_gif.log``) found the kernel reading only 1.10x the two-pass floor's bytes (DRAM 2.53 GB read,
2.08 GB written, for 2.10 GB of logits: the second sweep comes from L1 and L2, not HBM) at 66 % of the DRAM
bandwidth: one 16 KiB block in flight an SM is too little. Candidates, each a set of ``ops.constants``: the
softmax sweep and the gradient sweep through Triton's cp.async pipeline (``GIF_STAGES``, ``GIF_GRAD_STAGES``), two
programs an SM of 8 warps, 64 bytes a thread.
For each: forward + backward (``autograd.grad``, as ``bench logits``) against the two-pass floor from the copy
measured in the same run, and the loss and gradient against the default's (must be equal: the same sums in the
same order). Writes ``OUT/gif_sweep.json``. A record of what ran. Usage: gif_sweep.py OUT
"""
import contextlib
import json
import sys
from unittest import mock

import torch

sys.path.insert(0, ".")
import humanline_kernels as hk  # noqa: E402
from bench import common  # noqa: E402
from bench.bench_logits import _inputs  # noqa: E402
from humanline_kernels.ops import constants, tuning  # noqa: E402

out = sys.argv[1]
CONFIGS = [
    {},
    {"GIF_STAGES": 2},
    {"GIF_STAGES": 3},
    {"GIF_STAGES": 4},
    {"GIF_GRAD_STAGES": 3},
    {"GIF_STAGES": 3, "GIF_GRAD_STAGES": 3},
    {"GIF_STAGES": 4, "GIF_GRAD_STAGES": 4},
    {"GIF_PROGRAMS_PER_SM": 2, "GIF_WARPS": 8},
    {"GIF_PROGRAMS_PER_SM": 2, "GIF_WARPS": 8, "GIF_STAGES": 3, "GIF_GRAD_STAGES": 3},
    {"GIF_BYTES_PER_THREAD": 64},
    {"GIF_BYTES_PER_THREAD": 64, "GIF_STAGES": 3},
]
OTHER_V = [CONFIGS[i] for i in (0, 2, 5, 6)]  # at V = 151936 and 32000: the default and the likeliest
bw = common.copy_bandwidth_bytes_per_ms()
rows = []
for V in (128256, 151936, 32000):
    x, y, ref = _inputs(8192, V, "cuda", torch.bfloat16)
    adv = torch.randn(1, device="cuda")
    floor2 = 2 * x.numel() * 2 / bw

    def call():
        loss = hk.fused.grpo(x, y, ref, adv, beta=0.04, validate=False, grad_in_forward=True)[0]
        return loss, torch.autograd.grad(loss, x)[0]

    base = None
    for cfg in CONFIGS if V == 128256 else OTHER_V:
        with mock.patch.multiple(constants, **cfg) if cfg else contextlib.nullcontext():
            for f in tuning.CLEARS:
                f()
            try:
                loss, g = call()
                torch.cuda.synchronize()
            except Exception as e:  # a config that does not compile or launch: say so, go on
                print(f"V={V} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            if base is None:
                base = (loss.detach().clone(), g.clone())
            same = bool(torch.equal(loss, base[0])) and bool(torch.equal(g, base[1]))
            gdiff = (g.float() - base[1].float()).abs().max().item()
            del g
            ms = common.time_ms(call)
        for f in tuning.CLEARS:
            f()
        row = {"V": V, "N": 8192, "config": cfg or "default", "ms": ms, "floor2_ms": floor2,
               "ratio_2pass": ms / floor2, "equal_to_default": same, "max_grad_diff": gdiff}
        rows.append(row)
        print(f"V={V:6d} {str(cfg or 'default'):70s} {ms:7.3f} ms  {ms / floor2:.3f}x 2-pass  equal={same} "
              f"(max grad diff {gdiff:.3g})", flush=True)
    del x
    torch.cuda.empty_cache()
json.dump({"env": common.env_info(), "copy_bytes_per_ms": bw, "rows": rows}, open(f"{out}/gif_sweep.json", "w"),
          indent=1)
