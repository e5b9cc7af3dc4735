"""After e2e_profile.py found offline_ref's and lookahead's kernels equal in time (190.0 / 190.2 ms a step) while
the plain steps differ by ~2 %: do the humanline arms (and the clip) make the host wait for the GPU? Two steps of
each arm after the warm-up under torch.cuda.set_sync_debug_mode("warn"), each synchronizing call listed with the
frames of ours that made it, and the host's time to enqueue a step."""
import sys
import time
import traceback
import warnings
from types import SimpleNamespace
from unittest import mock

import torch

from bench import bench_e2e as E
from bench import common

E.torch, E.common = torch, common
a = SimpleNamespace(**dict(E.FULL, slices=16, supervised=False))
import humanline_kernels as hk  # noqa: E402

orig = E._fused_loss
for arm, clip in (("offline_ref", False), ("offline_ref", True), ("lookahead", True), ("lookahead", False),
                  ("sync_ce", True)):
    def loss(m, b, r, c, _k=clip):
        return orig(m, b, r, hk.HumanlineClip() if _k else None)
    with mock.patch.object(E, "_fused_loss", loss):
        step, _, _ = E._build(arm, a, "cuda", torch.bfloat16)
        for i in range(3):
            step(i)
        torch.cuda.synchronize()
        seen = []

        def hook(message, category, filename, lineno, file=None, line=None):
            fr = [f"{f.filename.split('/')[-2]}/{f.filename.split('/')[-1]}:{f.lineno} {f.name}"
                  for f in traceback.extract_stack()[:-1]
                  if "humanline_kernels" in f.filename or "/bench/" in f.filename]
            seen.append((str(message)[:80], fr[-4:]))
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = hook
            host = []
            for i in range(3, 6):
                t0 = time.perf_counter()
                step(i)
                host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        print(f"{arm} clip={clip}: {len(seen)} synchronizing calls in 3 steps; host ms a step (no sync) "
              f"{[round(h, 1) for h in host]}", flush=True)
        for m, fr in seen[:12]:
            print("   ", m, "|", " <- ".join(reversed(fr)), flush=True)
        del step
        E._free("cuda")
sys.exit(0)
