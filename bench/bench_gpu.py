"""One command for a GPU machine: check everything, then benchmark it.

``python -m bench gpu --out DIR [--skip STAGE ...] [--n N] [--vocab V] [--d D]``

Stages, in order (each one's output goes to ``DIR/gpu.log``; a failing stage is reported and the next one runs):

1. ``tests``: the GPU tests (``pytest -m gpu``: compiled kernels, asserted to be the path that ran);
2. ``parity``: every fused path against ``hk.reference`` at N = 8192, V = 128256, bf16 -- ``token_logprobs``, GRPO
   (clip on and off, each ``loss_type``, gradient in the forward, in place; on sm_90 also on the cluster kernel),
   DPO, KTO, packed batches (host and device boundaries), fused linear at D = 4096 (dense and on the supervised
   tokens only) --
   with docs/design.md's tolerances (log-probs 2e-3 absolute, loss 2e-3, gradients 1e-2 relative norm);
3. ``demo``: ``python -m humanline_kernels.demo --device cuda`` (2 seeds, one learning rate, 30 steps);
4. ``host``, ``logits``, ``tune`` (the launch table, ``DIR/tuned.json``), ``linear``, ``masks`` (``bench linear
   --ignored 0 50 75``: the supervised tokens only), ``sync``: the benchmarks (``python -m bench NAME``), JSON and
   PNG into DIR;
5. ``e2e``: one DPO step of a 1.5 B Llama, offline (with and without a reference forward) vs humanline sync /
   lookahead / the authors' way, and stock ``trl.DPOTrainer`` vs ``HumanlineDPOTrainer`` in TRL's loop.

Writes ``DIR/gpu.json`` (environment, every stage's status and numbers) and prints a short table last, with the
peers that ran. Every stage but ``parity`` is killed at its time budget (``budgets`` in :func:`main`); where a
command's time limit is below their sum, run the long stages in a second command (``--skip`` the others;
bench/NOTES.md, "How the runs were made").
"""
from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time

import torch

from . import common
from .cli import Parser

STAGES = ("tests", "parity", "demo", "host", "logits", "tune", "linear", "masks", "sync", "e2e")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, s):
        for st in self.streams:
            st.write(s)
            st.flush()
        return len(s)


def _sub(cmd, log, timeout):
    """Run ``cmd`` (list) from the repository root, streaming its output into the log; returns (rc, tail).

    A timer kills the whole process group at ``timeout`` (pytest-xdist workers and spawned ranks too), also while
    the command prints nothing: run 3 saw a suite outlive its stage budget, checked only when a line arrived."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         start_new_session=True)
    killed = []

    def kill():
        killed.append(True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    timer = threading.Timer(timeout, kill)
    timer.start()
    tail = []
    try:
        for line in p.stdout:
            log.write(line)
            tail = (tail + [line.rstrip()])[-15:]
        p.wait()
    finally:
        timer.cancel()
    if killed:
        tail.append(f"killed after {timeout} s")
    return p.returncode, tail


# ------------------------------------------------------------------------------------------------------ parity
def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


def parity(N, V, D, device="cuda", only=None):
    """Every fused path against hk.reference at one big shape; returns rows with errors and a pass flag
    (``device="cpu"``: a small shape through the interpreter or the eager twins, as tests/bench/test_bench_cli.py runs
    it; ``only``: the rows whose name contains one of these strings, e.g. ``["cluster"]`` in a device call's
    script)."""
    from humanline_kernels.ops import tuning

    # a grad_in_forward row checks the Triton kernel the option names, whatever the table chose for this card; the
    # cluster rows force the cluster kernel inside this (the innermost forcing wins)
    with tuning.forced_path("triton"):
        return _parity(N, V, D, device, only)


def _parity(N, V, D, device, only):
    import humanline_kernels as hk
    dev, bf = device, torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    B = 8
    T = N // B
    x = (torch.randn(B, T, V, device=dev, generator=g) * 2).to(bf)
    y = torch.randint(0, V, (B, T), device=dev, generator=g)
    y[:, : T // 8] = -100
    y[-1] = -100  # an all-ignored row
    with torch.no_grad():
        lp_true = hk.reference.token_logprobs(x.float(), y)
    ref = torch.where(y != -100, lp_true + 0.8 * torch.randn(B, T, device=dev, generator=g), 0.0)
    adv = torch.randn(B, device=dev, generator=g)
    des = torch.arange(B, device=dev) % 2 == 0
    mask = y != -100
    rows = []

    def check(name, loss_fn, ref_fn, wrt_bf, *, logp=False, logp_tol=2e-3):
        """loss_fn(leaf) -> (loss or logp); ref_fn(leaf_f32) -> same from the reference; gradients compared."""
        if only and not any(s in name for s in only):
            return
        leaf = wrt_bf.detach().clone().requires_grad_()
        out = loss_fn(leaf)
        leaf_r = wrt_bf.detach().float().requires_grad_()
        out_r = ref_fn(leaf_r)
        if logp:
            w = torch.randn(out.shape, device=dev, generator=g)
            gk, = torch.autograd.grad((out * w).sum(), leaf)
            gr, = torch.autograd.grad((out_r * w).sum(), leaf_r)
            err = (out - out_r).abs().max().item()
            tol = logp_tol
        else:
            gk, = torch.autograd.grad(out, leaf)
            gr, = torch.autograd.grad(out_r, leaf_r)
            err = abs(out.item() - out_r.item())
            tol = 2e-3 + 1e-3 * abs(out_r.item())
        gerr = _rel(gk, gr)
        ok = err <= tol and gerr <= 1e-2
        rows.append({"case": name, "value_err": err, "value_tol": tol, "grad_rel_err": gerr, "ok": ok})
        print(f"  {'ok  ' if ok else 'FAIL'} {name}: value err {err:.3g} (tol {tol:.3g}), grad rel err {gerr:.3g}",
              flush=True)
        del leaf, leaf_r, gk, gr
        torch.cuda.empty_cache()

    from humanline_kernels.ops import _jit, cluster
    # GRPO's gradient in the forward on the cluster kernel, forced (its table has no entry until measured): sm_90 only
    on_cluster = cluster.arch_ok(torch.device(dev))  # (on CPU only where a test stands in for the launch)
    if dev == "cuda" and not on_cluster:
        print("  (the cluster kernel's rows: not on this card, sm_90 only)", flush=True)

    def on_the_cluster(name, loss_fn, ref_fn, wrt_bf):
        """A row with the cluster kernel forced (4 CTAs of 256 threads a row); it fails if that kernel did not run."""
        if only and not any(s in name for s in only):
            return
        before = _jit.LAUNCHES[("compiled", "gif_cluster")]
        with cluster.forced(4, 256):
            check(name, loss_fn, ref_fn, wrt_bf)
        if _jit.LAUNCHES[("compiled", "gif_cluster")] == before:
            rows[-1].update(ok=False, error="the cluster kernel did not run")
            print(f"  FAIL {name}: the cluster kernel did not run", flush=True)

    clip = hk.HumanlineClip()
    check("token_logprobs", lambda z: hk.token_logprobs(z, y), lambda z: hk.reference.token_logprobs(z, y), x,
          logp=True)
    # the dense losses: one launch forward (the finalize folded into the row kernel)
    for c in (clip, None):
        tag = "clip" if c else "noclip"
        for lt in ("dapo", "bnpo", "grpo", "dr_grpo"):
            kw = dict(clip=c, loss_type=lt, beta=0.04)
            check(f"fused.grpo {lt} {tag}", lambda z, kw=kw: hk.fused.grpo(z, y, ref, adv, **kw)[0],
                  lambda z, kw=kw: hk.reference.grpo(hk.reference.token_logprobs(z, y), ref, adv, mask,
                                                     **kw)[0], x)
        kw = dict(clip=c, beta=0.04)
        check(f"fused.grpo grad_in_forward {tag}",
              lambda z, kw=kw: hk.fused.grpo(z, y, ref, adv, grad_in_forward=True, **kw)[0],
              lambda z, kw=kw: hk.reference.grpo(hk.reference.token_logprobs(z, y), ref, adv, mask, **kw)[0], x)
        check(f"fused.grpo grad_in_forward inplace {tag}",
              lambda z, kw=kw: hk.fused.grpo(z * 1, y, ref, adv, grad_in_forward=True, inplace_backward=True,
                                             **kw)[0],
              lambda z, kw=kw: hk.reference.grpo(hk.reference.token_logprobs(z, y), ref, adv, mask, **kw)[0], x)
        # the cluster kernel (sm_90; issue 91): every loss type, and in place
        for lt in ("dapo", "bnpo", "grpo", "dr_grpo") if on_cluster else ():
            kw = dict(clip=c, loss_type=lt, beta=0.04)
            on_the_cluster(f"fused.grpo grad_in_forward cluster {lt} {tag}",
                           lambda z, kw=kw: hk.fused.grpo(z, y, ref, adv, grad_in_forward=True, **kw)[0],
                           lambda z, kw=kw: hk.reference.grpo(hk.reference.token_logprobs(z, y), ref, adv, mask,
                                                              **kw)[0], x)
        if on_cluster:
            kw = dict(clip=c, beta=0.04)  # (the temperature is the log-probs' argument in the reference)
            on_the_cluster(f"fused.grpo grad_in_forward cluster inplace T=0.7 {tag}",
                           lambda z, kw=kw: hk.fused.grpo(z * 1, y, ref, adv, grad_in_forward=True,
                                                          inplace_backward=True, temperature=0.7, **kw)[0],
                           lambda z, kw=kw: hk.reference.grpo(hk.reference.token_logprobs(z, y, temperature=0.7),
                                                              ref, adv, mask, **kw)[0], x)
        check(f"fused.dpo {tag}", lambda z, c=c: hk.fused.dpo(z, y, ref, clip=c)[0],
              lambda z, c=c: hk.reference.dpo(hk.reference.token_logprobs(z, y), ref, mask, clip=c)[0], x)
        check(f"fused.dpo inplace {tag}",
              lambda z, c=c: hk.fused.dpo(z * 1, y, ref, clip=c, inplace_backward=True)[0],
              lambda z, c=c: hk.reference.dpo(hk.reference.token_logprobs(z, y), ref, mask, clip=c)[0], x)
        kl = (ref[:2] - 0.1, ref[:2], mask[:2])
        check(f"fused.kto {tag}", lambda z, c=c: hk.fused.kto(z, y, ref, des, *kl, clip=c)[0],
              lambda z, c=c: hk.reference.kto(hk.reference.token_logprobs(z, y), ref, mask, des, *kl,
                                              clip=c)[0], x)
    # a packed batch (issue 33): the same rows end to end, the row kernels through the token map; boundaries on the
    # host (as TRL's collator makes them) and on the device with max_seqlen
    lens = [T - (i * T) // (2 * B) for i in range(B)]  # from T down to about T / 2
    cu = list(itertools.accumulate(lens, initial=0))
    xp = torch.cat([x[i, :n] for i, n in enumerate(lens)])
    yp, rp = (torch.cat([t[i, :n] for i, n in enumerate(lens)]) for t in (y, ref))
    yl = torch.full_like(y, -100)
    for i, n in enumerate(lens):
        yl[i, :n] = y[i, :n]
    ml = yl != -100
    for pk, tag in ((hk.Packed(cu), "host cu"), (hk.Packed(torch.tensor(cu, device=dev), max(lens)), "device cu")):
        check(f"fused.dpo packed ({tag})", lambda z, pk=pk: hk.fused.dpo(z, yp, rp, clip=clip, packed=pk)[0],
              lambda z: hk.reference.dpo(hk.reference.token_logprobs(_unpack(z, lens, T), yl), ref, ml,
                                         clip=clip)[0], xp)
        check(f"fused.grpo packed grad_in_forward ({tag})",
              lambda z, pk=pk: hk.fused.grpo(z, yp, rp, adv, clip=clip, beta=0.04, grad_in_forward=True,
                                             packed=pk)[0],
              lambda z: hk.reference.grpo(hk.reference.token_logprobs(_unpack(z, lens, T), yl), ref, adv, ml,
                                          clip=clip, beta=0.04)[0], xp)
        if on_cluster:
            on_the_cluster(f"fused.grpo packed grad_in_forward cluster ({tag})",
                           lambda z, pk=pk: hk.fused.grpo(z, yp, rp, adv, clip=clip, beta=0.04, grad_in_forward=True,
                                                          packed=pk)[0],
                           lambda z: hk.reference.grpo(hk.reference.token_logprobs(_unpack(z, lens, T), yl), ref, adv,
                                                       ml, clip=clip, beta=0.04)[0], xp)
    del x, xp
    torch.cuda.empty_cache()
    h = torch.randn(B, T, D, device=dev, generator=g).to(bf)
    w = (torch.randn(V, D, device=dev, generator=g) * D ** -0.5).to(bf)
    # fused linear: hidden [B, T, D], weight [V, D]. The reference's logits are those of a bf16 lm_head (F.linear
    # in bf16, then fp32). Unrounded fp32 logits differ from any bf16 model's by up to half a bf16 ulp (the first
    # H100 run: log-prob error 7.8e-3), and even a bf16 GEMM over other tiles rounds a few logits the other way,
    # so the log-prob tolerance here is one bf16 ulp of the largest logit (the gradients keep 1e-2).
    def logits(ww):
        return torch.nn.functional.linear(h, ww.to(bf)).float()

    with torch.no_grad():
        z0 = logits(w)
        lp_lin = hk.reference.token_logprobs(z0, y)
        ulp = 2.0 ** (int(torch.floor(torch.log2(z0.abs().max())).item()) - 7)
    del z0
    ref_l = torch.where(mask, lp_lin + 0.8 * torch.randn(B, T, device=dev, generator=g), 0.0)

    def lin_ref(name, ww, **kw):
        lp = hk.reference.token_logprobs(logits(ww), y)
        if name == "grpo":
            return hk.reference.grpo(lp, ref_l, adv, mask, **kw)[0]
        if name == "dpo":
            return hk.reference.dpo(lp, ref_l, mask, **kw)[0]
        return hk.reference.kto(lp, ref_l, mask, des, **kw)[0]

    args = {"grpo": (ref_l, adv), "dpo": (ref_l,), "kto": (ref_l, des)}
    sup = [[T // 8, T]] * B  # the supervised positions (issue 33): the rows' completions
    for name in ("grpo", "dpo", "kto"):
        check(f"fused_linear.{name} D={D} (grad wrt weight)",
              lambda ww, n=name: getattr(hk.fused_linear, n)(h, ww, y, *args[n])[0],
              lambda ww, n=name: lin_ref(n, ww), w)
        check(f"fused_linear.{name} supervised D={D} (grad wrt weight)",
              lambda ww, n=name: getattr(hk.fused_linear, n)(h, ww, y, *args[n], supervised=sup)[0],
              lambda ww, n=name: lin_ref(n, ww), w)
    check(f"fused_linear.token_logprobs D={D} (grad wrt weight)", lambda ww: hk.fused_linear.token_logprobs(h, ww, y),
          lambda ww: hk.reference.token_logprobs(logits(ww), y), w, logp=True, logp_tol=max(2e-3, ulp))
    return rows


def _unpack(xp, lens, T):
    """Packed rows ``[N, ...]`` as padded ``[B, T, ...]`` (zeros after each row's length), differentiably."""
    rows = torch.split(xp, lens)
    return torch.stack([torch.nn.functional.pad(r, (0, 0) * (r.dim() - 1) + (0, T - r.shape[0])) for r in rows])


# -------------------------------------------------------------------------------------------------------- main
def _env():
    info = common.env_info()
    info["driver"] = common.driver_version()
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(sm_count=p.multi_processor_count, capability=f"{p.major}.{p.minor}",
                    memory_GiB=round(p.total_memory / 2**30, 1))
    return info


def main(argv=None):
    p = Parser(prog="python -m bench gpu", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join("bench", "out"),
                   help="directory for gpu.log, gpu.json and the benchmarks' JSON/PNG (default bench/out)")
    p.add_argument("--skip", nargs="*", default=[], choices=STAGES, help="stages to leave out")
    p.add_argument("--with-suite", action="store_true",
                   help="the tests stage runs the whole suite (CPU interpreter tests too; pytest-xdist when "
                        "installed), as the README's test command would, instead of the GPU tests only")
    p.add_argument("--n", type=int, default=8192, help="tokens of the parity checks (default 8192)")
    p.add_argument("--vocab", type=int, default=128256, help="vocabulary of the parity checks (default 128256)")
    p.add_argument("--d", type=int, default=4096, help="hidden size of the fused-linear parity check (default 4096)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device (this machine has none); the CPU smoke runs are `python -m bench NAME --quick`")
    if a.n % 16:
        p.error("--n must be a multiple of 16")
    os.makedirs(a.out, exist_ok=True)
    logf = open(os.path.join(a.out, "gpu.log"), "w")
    log = _Tee(sys.stdout, logf)
    report = {"env": _env(), "stages": {}}
    log.write(json.dumps(report["env"]) + "\n")
    py = sys.executable
    # e2e: 9 arms x (build + 13 steps of ~0.2 s), 3 of them TRL trainers (their imports and dataset tokenization):
    # ~2-3 min expected (estimated), margin for Triton compiles; tune: 20 compiles and 60 timings (estimated < 2 min)
    # linear / masks: each row 18 calls since its rows are timed in rounds (run 11's masks stage, 2 masks, took 63 s
    # at 8 calls a row; 3 masks now ~150-200 s, estimated)
    budgets = {"tests": 240, "demo": 120, "host": 90, "logits": 150, "tune": 150, "linear": 150, "masks": 240,
               "sync": 120, "e2e": 300}
    # -v -rfE: every failure is named in the log as it happens, and HK_FAILURE_LOG (tests/conftest.py) gets its
    # traceback then too, so a stage killed at its budget still says what failed and why
    suite = [py, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", "tests"]
    os.environ["HK_FAILURE_LOG"] = os.path.join(os.path.abspath(a.out), "test_failures.log")
    if a.with_suite:
        budgets["tests"] = 420  # run 3: the whole suite on 12 workers passed 94 % at ~400 s
        try:
            import xdist  # noqa: F401
            suite += ["-n", str(min(12, os.cpu_count() or 1))]
        except ImportError:
            pass
    cmds = {
        "tests": suite if a.with_suite else suite[:4] + ["-m", "gpu"] + suite[4:],
        # every arm through the CUDA kernels, cut to fit the stage's budget (the full grid is the CPU demo's job)
        "demo": [py, "-m", "humanline_kernels.demo", "--device", "cuda", "--quiet", "--seeds", "2", "--lrs", "1e-3",
                 "--steps", "30", "--plot", os.path.join(a.out, "demo-dpo.png")],
        "host": [py, "-m", "bench", "host", "--out", a.out],
        "logits": [py, "-m", "bench", "logits", "--out", a.out, "--vocab", "32000", "128256", "151936"],
        # issue 53, target 4: the table the launchers read, into DIR/tuned.json (commit it as
        # humanline_kernels/ops/tuned.json after the compile gate passes with it)
        "tune": [py, "-m", "bench", "tune", "--out", a.out],
        "linear": [py, "-m", "bench", "linear", "--out", a.out, "--chunk-mib", "512", "1024"],
        # issue 33: the supervised tokens only against the dense GEMM floor at prompt-like masks, and the peers
        "masks": [py, "-m", "bench", "linear", "--out", a.out, "--chunk-mib", "512", "--ignored", "0", "50", "75"],
        "sync": [py, "-m", "bench", "sync", "--out", a.out, "--gemms", "40"],
        "e2e": [py, "-m", "bench", "e2e", "--out", a.out],
    }
    t_all = time.time()
    for i, stage in enumerate(STAGES):
        if stage in a.skip:
            continue
        log.write(f"\n=== [{i + 1}/{len(STAGES)}] {stage} ({time.time() - t_all:.0f} s so far)\n")
        t0 = time.time()
        if stage == "parity":
            try:
                with contextlib.redirect_stdout(log):
                    rows = parity(a.n, a.vocab, a.d)
                ok = all(r["ok"] for r in rows)
                res = {"ok": ok, "rows": rows, "summary": f"{sum(r['ok'] for r in rows)}/{len(rows)} within tolerance"}
            except Exception as e:  # report and go on to the benchmarks
                res = {"ok": False, "summary": f"{type(e).__name__}: {str(e)[:300]}"}
        else:
            rc, tail = _sub(cmds[stage], log, budgets[stage])
            res = {"ok": rc == 0, "rc": rc, "summary": tail[-1] if tail else ""}
        res["seconds"] = round(time.time() - t0, 1)
        report["stages"][stage] = res
        torch.cuda.empty_cache()
    report["seconds"] = round(time.time() - t_all, 1)
    report["peers"] = {k: report["env"].get(k) for k in ("liger_kernel", "trl", "quack", "cut_cross_entropy")}
    with open(os.path.join(a.out, "gpu.json"), "w") as f:
        json.dump(report, f, indent=2)
    log.write(f"\n=== bench gpu on {report['env']['device']} (torch {report['env']['torch']}, triton "
              f"{report['env']['triton']}, driver {report['env'].get('driver')}), {report['seconds']:.0f} s\n")
    for stage, res in report["stages"].items():
        log.write(f"{stage:8s} {'ok  ' if res['ok'] else 'FAIL'} {res['seconds']:6.1f} s  {res['summary']}\n")
    ran = [k for k, v in report["peers"].items() if v]
    log.write(f"peers: ran {', '.join(ran) or 'none'}; not installed: "
              f"{', '.join(k for k, v in report['peers'].items() if not v) or 'none'}\n")
    log.write(f"wrote {os.path.join(a.out, 'gpu.json')}, gpu.log and the benchmarks' JSON/PNG\n")
    logf.close()
    return 0 if all(r["ok"] for r in report["stages"].values()) else 1
