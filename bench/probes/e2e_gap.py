"""After run 9 (H200): every humanline e2e arm was 1.027-1.035x offline_ref, lookahead (which copies nothing) 1.028x,
while the lm_head's clip costs nothing alone (clip_cost.py: 0.987x) and run 8's H100 had lookahead at 1.005x. Which
difference between the arms costs the ~5 ms? bench e2e's arms at its full size, each also with one difference
taken away or added (the clip forced on or off in the loss; the sync's start/wait made no-ops), in one process,
offline_ref first and last (the order's effect). Then one more difference that the arms carry: offline_ref's
reference forward runs on theta_0, the humanline arms' on trained weights (lr 1e-3 moves them by far more than the
init's spread), and the H200's GEMMs are power-bound, so their speed can depend on the data: the reference forward
timed on theta_0, on the policy after the arm's steps, and on theta_0 again. ``--quick``: the CPU smoke run (times
mean nothing). Prints one line an arm and a JSON line of median ms.

After run 10 (H200: the same arms 1.015-1.026x; the reference forward no slower on trained weights; under
torch.profiler both arms' kernels 190.0 / 190.2 ms a step; every arm makes two host syncs a step, in transformers'
mask building, ``masking_utils.find_packed_sequence_indices``'s ``.all()``): each arm also without that sync (our
batches are not packed, so the function's answer is None anyway), and nvidia-smi's mean SM clock and power over
each arm's timed steps (the H200's GEMMs run at its power cap: run 8's clock probe, throttle reason 0x4), so that a
slow arm shows whether it ran at a lower clock. And the lookahead without its window forward's mode switch
(``eval()`` before, each submodule's mode restored after, the FSDP2 reshard scan: ~1.6-2.6 ms of host time a step
for this model's 215 modules on a CI-class CPU), in case that host time is what the GPU waits for.

After run 11 (H200, two samples): the gap stays without the mask sync and without the mode switch; what separates
offline_ref from every other arm is the SM clock at the power cap (1883-1902 MHz against 1819-1884). ``--lr 1e-7``
leaves every bf16 weight as it is (each AdamW update under half an ulp), so every arm runs on theta_0's data: if the
arms then tie, the gap was their weights' power draw, not work they add."""
import argparse
import contextlib
import json
import math
import shutil
import statistics
import subprocess
import threading
import time
from types import SimpleNamespace
from unittest import mock

import torch

from bench import bench_e2e as E
from bench import common
from bench.bench_sync import time_reps

# (name, bench e2e's arm, the difference): the clip forced on or off in the loss, or the syncer's copy taken away
VARIANTS = (("offline_ref", "offline_ref", None), ("offline_ref+clip", "offline_ref", "clip"),
            ("lookahead", "lookahead", None), ("lookahead-clip", "lookahead", "no clip"),
            ("sync_ce", "sync_ce", None), ("sync_ce-copy", "sync_ce", "no copy"),
            ("offline_ref, no mask sync", "offline_ref", "no mask sync"),
            ("lookahead, no mask sync", "lookahead", "no mask sync"),
            ("sync_ce, no mask sync", "sync_ce", "no mask sync"),
            ("lookahead, no mode switch", "lookahead", "no mode switch"),
            ("offline_ref (again)", "offline_ref", None))


class Smi:
    """nvidia-smi's SM clock and power every 20 ms, read in a thread; ``window`` (bench e2e's ``timed``) records
    the span of an arm's timed steps, ``mean()`` the samples inside the last one."""

    def __init__(self):
        reason = "clocks_event_reasons.active"  # clocks_throttle_reasons.active before driver 535
        if subprocess.run(["nvidia-smi", f"--query-gpu={reason}", "--format=csv"], capture_output=True).returncode:
            reason = "clocks_throttle_reasons.active"
        self.samples, self.spans = [], []
        self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu=clocks.sm,power.draw,{reason}",
                                      "--format=csv,noheader,nounits", "-lms", "20"], stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            f = [x.strip() for x in line.split(",")]
            with contextlib.suppress(ValueError, IndexError):
                self.samples.append((time.monotonic(), float(f[0]), float(f[1]), f[2]))

    @contextlib.contextmanager
    def window(self):
        t0 = time.monotonic()
        yield
        self.spans.append((t0, time.monotonic()))

    def mean(self):
        t0, t1 = self.spans[-1]
        s = [x for x in self.samples if t0 <= x[0] <= t1]
        if not s:
            return None
        return {"sm_mhz": round(statistics.mean(x[1] for x in s), 1),
                "power_w": round(statistics.mean(x[2] for x in s), 1), "samples": len(s),
                "reasons": sorted({x[3] for x in s})}

    def close(self):
        self.proc.terminate()


@torch.no_grad()
def _bare_ref_logps(self, batch):
    return self.logps_fn(self.policy, batch).detach()


def run(arm, change, a, device, dtype, timed=None):
    from transformers import masking_utils

    import humanline_kernels as hk
    orig = E._fused_loss
    with contextlib.ExitStack() as stack:
        if change == "no mask sync":  # unpacked batches: the function's answer is None, found without the sync
            stack.enter_context(mock.patch.object(masking_utils, "find_packed_sequence_indices",
                                                  lambda position_ids: None))
        elif change == "no mode switch":  # the window forward without eval()/restore/reshard (host time; the
            # e2e model has no dropout, so the log-probs are the same)
            stack.enter_context(mock.patch.object(hk.LookaheadReference, "_ref_logps", _bare_ref_logps))
        elif change in ("clip", "no clip"):
            clip = hk.HumanlineClip() if change == "clip" else None
            stack.enter_context(mock.patch.object(E, "_fused_loss", lambda m, b, r, c: orig(m, b, r, clip)))
        elif change == "no copy":  # start() and wait() do nothing: the reference stays theta_0
            stack.enter_context(mock.patch.object(hk.ReferenceSyncer, "start", lambda self: True))
            stack.enter_context(mock.patch.object(hk.ReferenceSyncer, "wait", lambda self: None))
        try:
            return E.run_arm(arm, a, device, dtype, timed=timed)
        finally:
            E._free(device)


def ref_forward_by_weights(a, device, dtype, reps=20):
    """Median ms of ``_fused_ref_logps`` (no grad) on theta_0, on the policy after warmup + steps offline DPO steps,
    and on theta_0 again."""
    policy = E._policy(a, device, dtype)
    frozen0 = E._frozen_copy(policy)
    batch = E._batches(a, device)[0]

    def timed(model):
        return round(time_reps(torch.no_grad()(lambda: E._fused_ref_logps(model, batch)), reps=reps), 3)

    first = timed(frozen0)
    with mock.patch.object(E, "_policy", lambda *args, **kw: policy):
        step, _, _ = E._build("offline", a, device, dtype)
        for i in range(a.warmup + a.steps):
            step(i)
    trained = E._frozen_copy(policy)
    return {"theta_0": first, "trained": timed(trained), "theta_0 again": timed(frozen0)}


def setup(p, a):
    """bench e2e's configuration for a probe's flags (``--quick``, ``--steps``): ``(cfg dict, device, dtype)``;
    a bad flag is answered by ``p.error``. Shared with e2e_profile.py."""
    if a.steps < 1:
        p.error(f"--steps must be >= 1, got {a.steps}")
    lr = getattr(a, "lr", None)
    if lr is not None and not (lr > 0 and math.isfinite(lr)):
        p.error(f"--lr must be a positive number, got {lr}")
    if not a.quick and not torch.cuda.is_available():
        p.error("the full size needs a CUDA device; --quick is the CPU smoke run")
    E.torch, E.common = torch, common  # bench e2e's main() sets these after reading its flags
    cfg = dict(E.QUICK if a.quick else E.FULL, steps=a.steps, slices=16, supervised=False)
    if lr is not None:
        cfg["lr"] = lr
    return cfg, *(("cpu", torch.float32) if a.quick else ("cuda", torch.bfloat16))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny fp32 model on CPU (a smoke run)")
    p.add_argument("--steps", type=int, default=25, help="timed steps an arm (default 25)")
    p.add_argument("--lr", type=float, default=None,
                   help="AdamW learning rate (default bench e2e's); 1e-7 leaves bf16 weights unchanged, so every arm "
                        "runs on the same data")
    a = p.parse_args(argv)
    cfg, device, dtype = setup(p, a)
    smi = Smi() if device == "cuda" and shutil.which("nvidia-smi") else None
    out, loss, clocks = {}, {}, {}
    try:
        for k, (name, arm, change) in enumerate(VARIANTS):
            t0 = time.time()
            r = run(arm, change, SimpleNamespace(**cfg), device, dtype, timed=smi.window if smi else None)
            out[name] = round(r["ms"], 2)
            loss[name] = r["losses"][E.CHECK_STEP]
            clocks[name] = smi.mean() if smi else None
            c = clocks[name]
            print(f"[{k + 1}/{len(VARIANTS)}] {name}: {r['ms']:.4g} ms/step, step-2 loss {loss[name]:.6g}"
                  + (f", SM {c['sm_mhz']:.0f} MHz, {c['power_w']:.0f} W, reasons {','.join(c['reasons'])}" if c else "")
                  + f" ({time.time() - t0:.1f} s)", flush=True)
    finally:
        if smi:
            smi.close()
    base = out["offline_ref"]
    print(json.dumps({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "ms": out,
                      "x_offline_ref": {k: round(v / base, 4) for k, v in out.items()}, "smi": clocks}), flush=True)
    ref = ref_forward_by_weights(SimpleNamespace(**cfg), device, dtype)
    print(json.dumps({"reference forward ms by weights": ref}), flush=True)
    return {"ms": out, "loss": loss, "reference_forward_ms": ref, "smi": clocks}


if __name__ == "__main__":
    main()
