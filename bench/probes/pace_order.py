"""Run 9's follow-up: why tests/test_sync_gpu.py::test_paced_parts_wait_for_the_compute_at_their_point failed on the
H200 (part 2, issued after a ~0.5 s sleep kernel, was already done when the host queried it). The test's step again,
with the host's clock at the sleep's launch, at each part's issue and at the query, and each part's event queried as
it is issued: a host that stalls ~0.5 s somewhere shows where; parts finished early show ordering. Argument: the
copier (`kernel`, the default path; `foreach`, use_kernel=False). Prints one JSON line."""
import json
import sys
import time

import torch
from torch import nn

import humanline_kernels as hk


def make(seed, dtype=torch.float32):
    torch.manual_seed(seed)
    m = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.LayerNorm(256)) for _ in range(6)], nn.Linear(256, 17))
    return m.cuda().to(dtype)


def main(copier):
    pol, ref = make(0), make(1, torch.bfloat16)
    syncer = hk.ReferenceSyncer(pol, ref, every=1, slices=4, use_kernel=None if copier == "kernel" else False)
    x = torch.randn(64, 256, device="cuda")
    compute = torch.cuda.Stream()
    inner, log, done = syncer._issue, [], []
    t0 = [time.perf_counter()]

    def stamp(what):
        log.append((what, round((time.perf_counter() - t0[0]) * 1e3, 2), [e.query() for e in done]))

    def issue(plan, side):
        stamp(f"issue {len(done)} at point {syncer._pace.points}")
        inner(plan, side)
        done.append(syncer._done[torch.device("cuda", torch.cuda.current_device())])
        stamp(f"issued {len(done) - 1}")
    syncer._issue = issue
    with torch.cuda.stream(compute):
        for step in range(3):
            log.clear()
            done.clear()
            torch.cuda.synchronize()
            t0[0] = time.perf_counter()
            h = None
            if step:
                def slow(m, a):
                    stamp("sleep launch")
                    torch.cuda._sleep(1_000_000_000)
                    stamp("sleep launched")
                h = pol[3].register_forward_pre_hook(slow)
            syncer.start()
            y = pol(x).square().mean()
            stamp("forward done")
            y.backward()
            stamp("backward done")
            if h is not None:
                h.remove()
            if len(done) > 1:
                done[1].synchronize()
                stamp("done[1] synchronized")
            syncer.wait()
            torch.cuda.synchronize()
            stamp("step synchronized")
            print(json.dumps({"copier": copier, "step": step, "log": log}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "kernel")
