"""Run 8, call 2 (issue 53, targets 1 and 3): is KTO's extra time on the H200 the host's?

Run 7 (H200) measured fused.kto 1.068x / 1.058x the 3-pass floor at V = 128256 / 151936 where dpo was 1.044x /
1.033x, though the two launch the same kernels with the same code in their hot loops (``compare_compiled``: 85
registers each, 6.59 SASS instructions an element) and the same bytes. On this GPU machine's host KTO's glue costs
~0.28 ms more than DPO's (run 8 call 1, ``host_profile.txt``: 1.001 against 0.726 ms a call), and ``do_bench``
times from before the forward launch to after the backward's: whatever the host spends between the two launches
beyond the forward kernel's own time (~0.5 ms at V = 128256 on an H200) is GPU idle time inside the window.
Each loss at each V timed twice: as ``bench logits`` does, and as one CUDA graph replay of the same forward +
backward (no host in the window). If the graph rows are level and the plain rows are not, the gap is the host's.
Writes ``OUT/graph_gap.json``. A record of what ran. Usage: graph_gap.py OUT
"""
import json
import sys

import torch

sys.path.insert(0, ".")
import humanline_kernels as hk  # noqa: E402
from bench import common  # noqa: E402
from bench.bench_logits import _inputs  # noqa: E402

out = sys.argv[1]
bw = common.copy_bandwidth_bytes_per_ms()
rows = []
for V in (128256, 151936):
    x, y, ref = _inputs(8192, V, "cuda", torch.bfloat16)
    N = x.shape[1]
    half = ref.new_zeros(2, N // 2)
    des = torch.tensor([True, False], device="cuda")
    adv = torch.randn(1, device="cuda")
    calls = {
        "dpo": lambda v: hk.fused.dpo(v.view(2, N // 2, V), y.view(2, -1), half, validate=False)[0],
        "kto": lambda v: hk.fused.kto(v.view(2, N // 2, V), y.view(2, -1), half, des, validate=False)[0],
        "grpo": lambda v: hk.fused.grpo(v, y, ref, adv, beta=0.04, validate=False)[0],
        "token_logprobs": lambda v: hk.token_logprobs(v, y, validate=False).sum(),
    }
    floor3 = 3 * x.numel() * 2 / bw
    for name, fn in calls.items():
        def step(leaf):
            loss = fn(leaf)
            return loss, torch.autograd.grad(loss, leaf)[0]
        leaf = x.detach().requires_grad_()
        plain = common.time_ms(lambda: step(leaf))
        # the graph's leaf first used on the warm-up stream (autograd syncs a leaf's gradient with the stream of
        # its first use, which must not be the legacy default stream while a capture runs; tests/test_gpu.py)
        gleaf = x.detach().requires_grad_()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step(gleaf)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = step(gleaf)
        graphed = common.time_ms(graph.replay)
        del static, graph
        torch.cuda.empty_cache()
        row = {"V": V, "N": N, "impl": name, "plain_ms": plain, "graph_ms": graphed, "floor3_ms": floor3,
               "plain_x_floor": plain / floor3, "graph_x_floor": graphed / floor3}
        rows.append(row)
        print(f"V={V:6d} {name:15s} plain {plain:.3f} ms ({plain / floor3:.3f}x)  graph {graphed:.3f} ms "
              f"({graphed / floor3:.3f}x)", flush=True)
    del x
    torch.cuda.empty_cache()
json.dump({"env": common.env_info(), "copy_bytes_per_ms": bw, "rows": rows}, open(f"{out}/graph_gap.json", "w"),
          indent=1)
