"""Logits-path benchmark: token log-probs and fused humanline losses, forward + backward, side by side.

``python -m bench logits [--quick] [--out DIR] [--n N] [--vocab V ...] [--only SUBSTR ...] [--baseline REF ...]``

Shapes: ``N`` tokens (default 8192) x ``V`` in {32000, 128256, 151936, 262144}, bf16 logits. Every row times one
forward + backward (``torch.autograd.grad``, so nothing accumulates into ``.grad``) and records the peak memory
allocated beyond the inputs. Floors come from the copy bandwidth measured in the same run (bytes read + written
per ms): the 3-pass floor reads the logits in the forward and reads + writes them in the backward
(``3 * N * V * 2`` bytes), the 2-pass floor is one read + one write (gradient formed in the forward).
On sm_90 also GRPO's gradient in the forward on the cluster kernel (``ops/cluster.py``), each configuration
``CTAs x threads`` forced. Baselines: eager fp32 ``log_softmax + gather``, its ``torch.compile`` version, Liger-Kernel
``CrossEntropyLoss(reduction="none")`` and ``triton_grpo_loss``, quack ``cross_entropy(reduction="none")``
(each when importable). ``--quick``: a tiny CPU smoke of the harness (eager paths, seconds).

``--baseline REF`` (a git commit, branch or tag; repeatable) also times the package as it was at ``REF``: a
``git worktree`` of it in a temporary folder beside this checkout's, its own ``python -m bench logits`` with the same
shapes run there (``PYTHONPATH`` at that worktree), its ``hk.*`` rows added to this run's as ``NAME @REF``; the
worktree is removed afterwards. An older version is compared by running it, not by a switch in the package.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

from . import common
from .bench_tune import CLUSTER
from .cli import Parser

VOCABS = (32000, 128256, 151936, 262144)


def _inputs(N, V, device, dtype, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(1, N, V, device=device, generator=g) * 2).to(dtype).requires_grad_()
    y = torch.randint(0, V, (1, N), device=device, generator=g)
    ref = torch.randn(1, N, device=device, generator=g) * 0.3 - 12.0
    return x, y, ref


def _impls(x, y, ref, quick):
    """name -> (callable doing forward + backward, passes over the logits it needs at best: 3 or 2)."""
    import humanline_kernels as hk
    from humanline_kernels.ops import tuning

    N, V = x.shape[1], x.shape[2]
    g = torch.randn(1, N, device=x.device)
    adv = torch.randn(1, device=x.device)
    half = ref.new_zeros(2, N // 2)
    des = torch.tensor([True, False], device=x.device)
    # the in-place variants overwrite their logits with the gradient: give them their own buffer so that x keeps
    # the same logits for every other impl (its values then drift, which does not change the work done)
    xi = x.detach().clone().requires_grad_()

    def grad(out, go=None, wrt=x):
        return torch.autograd.grad(out, wrt, go)[0]

    def triton(call):
        with tuning.forced_path("triton"):
            return call()

    def eager_lp(z):
        return torch.log_softmax(z.float(), -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)

    impls = {
        "hk.token_logprobs": (lambda: grad(hk.token_logprobs(x, y, validate=False), g), 3),
        "hk.token_logprobs(inplace)": (lambda: grad(hk.token_logprobs(xi, y, validate=False, inplace_backward=True),
                                                    g, xi), 3),
        "hk.fused.grpo": (lambda: grad(hk.fused.grpo(x, y, ref, adv, beta=0.04, validate=False)[0]), 3),
        # the grad_in_fwd rows time the kernel the option names (triton()), whatever the table chose for this card
        "hk.fused.grpo(grad_in_fwd)": (lambda: triton(lambda: grad(hk.fused.grpo(
            x, y, ref, adv, beta=0.04, validate=False, grad_in_forward=True)[0])), 2),
        # GRPO's other variants: per-row weights ("grpo": a weights launch first with the gradient in the forward)
        # and the clip off (a kernel variant of its own)
        "hk.fused.grpo(grpo,noclip)": (lambda: grad(hk.fused.grpo(x, y, ref, adv, beta=0.04, loss_type="grpo",
                                                                  clip=None, validate=False)[0]), 3),
        "hk.fused.grpo(grad_in_fwd,grpo)": (lambda: triton(lambda: grad(hk.fused.grpo(
            x, y, ref, adv, beta=0.04, loss_type="grpo", validate=False, grad_in_forward=True)[0])), 2),
        "hk.fused.grpo(grad_in_fwd,inplace)": (lambda: triton(lambda: grad(hk.fused.grpo(
            xi, y, ref, adv, beta=0.04, validate=False, grad_in_forward=True, inplace_backward=True)[0], None, xi)), 2),
        "hk.fused.dpo": (lambda: grad(hk.fused.dpo(x.view(2, N // 2, V), y.view(2, -1), half, validate=False)[0]),
                         3),
        # desirable made once: torch.tensor(list, device=cuda) inside the timed call is a blocking host-to-device
        # copy, which serialised host and GPU and doubled KTO's time at V = 128256 in the first H100 run
        "hk.fused.kto": (lambda: grad(hk.fused.kto(x.view(2, N // 2, V), y.view(2, -1), half, des,
                                                   validate=False)[0]), 3),
        "eager fp32 log_softmax+gather": (lambda: grad(eager_lp(x), g), 3),
    }
    if quick or not x.is_cuda:  # the peers below are GPU kernels (Liger's Triton kernels fail on CPU tensors)
        return impls
    # GRPO's gradient in the forward on the cluster kernel (sm_90; issue 91), each configuration forced
    from humanline_kernels.ops import cluster
    if cluster.arch_ok(x.device):
        def on_cluster(ctas, threads, wrt=x, **kw):
            with cluster.forced(ctas, threads):
                return grad(hk.fused.grpo(wrt, y, ref, adv, beta=0.04, validate=False, grad_in_forward=True,
                                          **kw)[0], None, wrt)
        for ctas, threads in CLUSTER:  # the configurations bench tune times (its --from-logits reads these rows)
            if cluster.fits(x, None, ctas):
                impls[f"hk.fused.grpo(grad_in_fwd,cluster {ctas}x{threads})"] = (
                    lambda c=ctas, t=threads: on_cluster(c, t), 2)
        if cluster.fits(x, None, 4):
            impls["hk.fused.grpo(grad_in_fwd,grpo,cluster 4x256)"] = (
                lambda: on_cluster(4, 256, loss_type="grpo"), 2)
            impls["hk.fused.grpo(grad_in_fwd,inplace,cluster 4x256)"] = (
                lambda: on_cluster(4, 256, wrt=xi, inplace_backward=True), 2)
    compiled = torch.compile(eager_lp)
    impls["torch.compile log_softmax+gather"] = (lambda: grad(compiled(x), g), 3)
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss
        ce = LigerCrossEntropyLoss(reduction="none")
        impls["liger CE(reduction=none)"] = (lambda: grad(ce(x.view(N, V), y.view(N)), g.view(N)), 3)
    except Exception:
        pass
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
        xl = torch.cat([x.detach(), x.detach()[:, -1:]], 1).requires_grad_()  # Liger wants [B, L + 1, V]

        def liger_grpo():
            out = triton_grpo_loss(xl, None, ref, y, adv, temperature=1.0, beta=0.04, loss_type="dapo",
                                   reduce=True)
            return torch.autograd.grad(out[0] if isinstance(out, tuple) else out, xl)[0]
        impls["liger triton_grpo_loss"] = (liger_grpo, 3)
    except Exception:
        pass
    try:
        from quack.cross_entropy import cross_entropy as quack_ce
        impls["quack cross_entropy(none)"] = (lambda: grad(quack_ce(x.view(N, V), y.view(N), reduction="none"),
                                                           g.view(N)), 3)
        # quack's one-pass form, the gradient written in the forward (dloss = 1 a row): target 2's bar
        from quack.cross_entropy import cross_entropy_fwd as quack_fwd
        impls["quack cross_entropy_fwd(return_dx)"] = (lambda: quack_fwd(x.view(N, V), y.view(N), return_dx=True),
                                                        2)
    except Exception:
        pass
    return impls


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class BaselineError(Exception):
    """A ``--baseline`` that cannot be timed: the message is the one line the CLI prints."""


def _git(*args, cwd=ROOT):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)


def baseline_rows(ref, N, vocabs, *, quick, only=None):
    """The ``hk.*`` rows of ``python -m bench logits`` run at git ``ref`` (``NAME @REF``): a worktree of ``ref`` in
    a temporary folder, the benchmark run there in a subprocess whose ``PYTHONPATH`` is that worktree, then the
    worktree removed (also when the run fails). ``BaselineError`` (one line) for a ref git does not know or a run
    that fails."""
    commit = _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    if commit.returncode != 0:
        raise BaselineError(f"--baseline {ref!r}: not a commit of this repository (git rev-parse finds none)")
    tmp = tempfile.mkdtemp(prefix="hk-baseline-")
    tree, out = os.path.join(tmp, "tree"), os.path.join(tmp, "out")
    try:
        made = _git("worktree", "add", "--detach", tree, commit.stdout.strip())
        if made.returncode != 0:
            raise BaselineError(f"--baseline {ref!r}: git worktree add failed: "
                                f"{(made.stderr.strip().splitlines() or ['?'])[-1]}")
        args = ["--out", out, "--n", str(N), "--vocab", *map(str, vocabs)] + (["--quick"] if quick else [])
        if only:
            args += ["--only", *only]
        env = dict(os.environ, PYTHONPATH=tree)
        res = subprocess.run([sys.executable, "-m", "bench", "logits", *args], cwd=tree, env=env,
                             capture_output=True, text=True)
        if res.returncode != 0:
            last = (res.stderr.strip().splitlines() or ["no output"])[-1]
            raise BaselineError(f"--baseline {ref!r}: its bench logits failed (exit {res.returncode}): {last}")
        with open(os.path.join(out, f"logits{'_quick' if quick else ''}.json")) as f:
            rows = json.load(f)["rows"]
    finally:
        _git("worktree", "remove", "--force", tree)
        _git("worktree", "prune")
        shutil.rmtree(tmp, ignore_errors=True)
    return [dict(r, impl=f"{r['impl']} @{ref}") for r in rows if r["impl"].startswith("hk.")]


def run(N, vocabs, *, quick, only=None, out_dir="bench/out", baselines=()):
    device = "cuda" if torch.cuda.is_available() and not quick else "cpu"
    dtype = torch.bfloat16
    bw = common.copy_bandwidth_bytes_per_ms(device=device)
    rows = []
    for V in vocabs:
        x, y, ref = _inputs(N, V, device, dtype)
        nbytes = N * V * x.element_size()
        floor = {3: 3 * nbytes / bw, 2: 2 * nbytes / bw}
        results = {}
        for name, (fn, passes) in _impls(x, y, ref, quick).items():
            if only and not any(s in name for s in only):
                continue
            row = {"impl": name, "N": N, "V": V, "floor3_ms": floor[3], "floor2_ms": floor[2]}
            try:
                row["ms"] = common.time_ms(fn, warmup=2 if quick else 25, rep=10 if quick else 100)
                peak = common.peak_extra_bytes(fn)
                row["peak_extra_MiB"] = None if peak is None else peak / 2**20
                row["beyond_grad_MiB"] = None if peak is None else (peak - nbytes) / 2**20
                row["ratio_3pass"] = row["ms"] / floor[3]
                row["ratio_2pass"] = row["ms"] / floor[2]
                row["floor_passes"] = passes
                results[name] = row["ms"]
                if not quick:  # progress: a run killed at its budget still shows the rows it timed
                    print(f"[logits V={V}] {name}: {row['ms']:.4g} ms, {row['ratio_3pass']:.3f}x 3-pass floor",
                          flush=True)
            except Exception as e:  # a peer that fails at this shape is reported, not fatal
                row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
            rows.append(row)
            x.grad = None
        for row in rows:
            if row["V"] == V and "ms" in row:
                for base in ("eager fp32 log_softmax+gather", "liger triton_grpo_loss"):
                    if base in results:
                        row["speedup_vs_" + base.split()[0] + ("_grpo" if "grpo" in base else "")] = \
                            results[base] / row["ms"]
        del x, y, ref
        if device == "cuda":
            torch.cuda.empty_cache()
    for ref in baselines:  # after this version's rows, with their memory freed
        rows += baseline_rows(ref, N, vocabs, quick=quick, only=only)
    meta = {"N": N, "vocabs": list(vocabs), "dtype": "bfloat16", "copy_bandwidth_TBps": bw * 1e3 / 1e12,
            "quick": quick, "baselines": list(baselines),
            "what": "forward + backward (autograd.grad) per impl; floors from the measured copy"}
    return common.save("logits" + ("_quick" if quick else ""), rows, meta, out_dir, x="V", y="ratio_3pass")


def main(argv=None):
    p = Parser(prog="python -m bench logits", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny CPU smoke of the harness (seconds)")
    p.add_argument("--out", default="bench/out", help="output directory for JSON and PNG")
    p.add_argument("--n", type=int, default=None, help="tokens (default 8192; 64 with --quick)")
    p.add_argument("--vocab", type=int, nargs="+", default=None, help="vocabulary sizes")
    p.add_argument("--only", nargs="+", default=None, help="run only impls whose name contains one of these")
    p.add_argument("--baseline", action="append", default=[], metavar="REF",
                   help="also time the package at this git commit, branch or tag (a worktree of it, removed after)")
    a = p.parse_args(argv)
    N = a.n or (64 if a.quick else 8192)
    vocabs = a.vocab or ((1000, 3000) if a.quick else VOCABS)
    for ref in a.baseline:  # before anything is timed: a bad ref is one line, at once
        if _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}").returncode != 0:
            p.error(f"--baseline {ref!r}: not a commit of this repository (git rev-parse finds none)")
    try:
        run(N, vocabs, quick=a.quick, only=a.only, out_dir=a.out, baselines=a.baseline)
    except BaselineError as e:
        p.error(str(e))
    return 0
