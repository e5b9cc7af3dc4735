"""``python -m humanline_kernels.demo`` (also the ``humanline-demo`` console script): the flags, their checks (a
bad flag is a one-line error) and what a run prints, saves (``--save``) and adds (``--add-canary``)."""
from __future__ import annotations

import argparse
import inspect
import os
import sys

import torch

import humanline_kernels as hk

from . import arms, experiment, record

# the flags' defaults are experiment.run's and HumanlineClip's (one place to change them)
RUN_DEFAULTS = {k: v.default for k, v in inspect.signature(experiment.run).parameters.items()}
DESCRIPTION = ("Humanline in miniature: offline vs offline+humanline vs online DPO / KTO / GRPO on a tiny Llama, "
               "tuned fairly.")


def _int_at_least(low):
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        return v
    return parse


def _positive_float(text):
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0 or v != v or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return v


def _lr_grid(text):
    values = [_positive_float(x) for x in text.split(",") if x.strip()]
    if not values:
        raise argparse.ArgumentTypeError("expected a comma-separated list of learning rates, e.g. 3e-4,1e-3")
    return tuple(sorted(set(values)))


class _Parser(argparse.ArgumentParser):
    """A bad flag is one line on stderr (exit 2), as in the bench programs (bench/cli.py), not argparse's usage block
    above the error."""

    def error(self, message):
        print(f"{self.prog}: error: {message} ({self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def parser():
    p = _Parser(prog="python -m humanline_kernels.demo", description=DESCRIPTION,
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--objective", choices=[*arms.OBJECTIVES, "all"], default=RUN_DEFAULTS["objective"],
                   help="the loss to train; all: each in turn")
    p.add_argument("--steps", type=_int_at_least(1), default=RUN_DEFAULTS["steps"],
                   help="optimizer steps per run")
    p.add_argument("--seeds", type=_int_at_least(2), default=RUN_DEFAULTS["seeds"],
                   help="seeds per arm and learning rate (how the default was chosen: docs/benchmarks.md)")
    p.add_argument("--lrs", type=_lr_grid, default=RUN_DEFAULTS["lrs"], help="learning-rate grid, "
                   "comma-separated, the same for every arm")
    p.add_argument("--seed", type=_int_at_least(0), default=RUN_DEFAULTS["seed"],
                   help="base seed (behaviour model, starting policy, offline data)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=RUN_DEFAULTS["device"],
                   help="auto: cuda when available, else cpu")
    p.add_argument("--batch", type=_int_at_least(arms.GROUP), default=RUN_DEFAULTS["batch"],
                   help="sequences per step (dpo/kto: pairs x 2; grpo: groups of 4)")
    p.add_argument("--sync-every", type=_int_at_least(1), default=None,
                   help="humanline sync interval (default: 1 for dpo/kto, 12 for grpo)")
    p.add_argument("--resample-every", type=_int_at_least(1), default=RUN_DEFAULTS["resample_every"],
                   help="grpo: the offline arms draw the policy's samples this many times less often than online")
    p.add_argument("--sft-steps", type=_int_at_least(0), default=RUN_DEFAULTS["sft_steps"],
                   help="SFT steps that fit the behaviour model and the starting policy")
    p.add_argument("--eval-n", type=_int_at_least(16), default=RUN_DEFAULTS["eval_n"],
                   help="samples per rule-rate evaluation")
    p.add_argument("--log-eps-p", type=float, default=hk.HumanlineClip.log_eps_p,
                   help="lower end of the clip band")
    p.add_argument("--log-eps-r", type=float, default=hk.HumanlineClip.log_eps_r,
                   help="upper end of the clip band")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="where the plot of rule rate over steps is written ({objective} is substituted; default: "
                   "humanline-demo-{objective}.png, with --save demo-{objective}.png beside the record)")
    p.add_argument("--no-plot", action="store_true", help="write no plot")
    p.add_argument("--workers", type=_int_at_least(1), default=None,
                   help="processes for the runs of the grid (default: one per core up to 4 on CPU, 1 on CUDA)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--markdown", action="store_true",
                   help="after the run, print its rows as README's markdown table")
    p.add_argument("--save", metavar="PATH", default=None,
                   help="merge this run into the JSON record at PATH (README's demo table is written from it by "
                   "python -m bench report --readme), with a canary run (seconds) that CI repeats")
    p.add_argument("--add-canary", metavar="PATH", default=None,
                   help="run only the canary and keep this CPU's bits in the record at PATH, if they are within "
                   "round-off of the record's (another CPU, the same code); CI then checks them exactly here")
    return p


def main(argv=None):
    p = parser()
    a = p.parse_args(argv)
    if a.add_canary:
        given = [f for f in ("save", "markdown") if getattr(a, f)]
        if given:
            p.error(f"--add-canary runs only the canary; drop --{given[0]}")
        if not os.path.isfile(a.add_canary):
            p.error(f"--add-canary: no record at {a.add_canary!r} (write one with --save)")
        if not a.quiet:
            print("canary run, twice (a tiny run of every objective) ...", flush=True)
        verdict, msg = record.add_canary(a.add_canary)
        if verdict == "differ":
            p.error(f"--add-canary: {msg}")
        print(msg)
        return 0
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this machine has no CUDA device (use --device cpu or auto)")
    if any(abs(v) == float("inf") for v in (a.log_eps_p, a.log_eps_r)):  # (the library takes an open end)
        p.error(f"the clip band must be finite, got [{a.log_eps_p}, {a.log_eps_r}]")
    try:  # the library's rules (not NaN, ordered, around 0), as one line
        clip = hk.HumanlineClip(a.log_eps_p, a.log_eps_r)
    except ValueError as e:
        p.error(f"--log-eps-p / --log-eps-r: {e}")
    objectives = arms.OBJECTIVES if a.objective == "all" else (a.objective,)
    if a.batch % 2 and set(objectives) & {"dpo", "kto"}:
        p.error(f"--batch must be even for {'dpo and kto' if a.objective == 'all' else a.objective} "
                f"(chosen/desirable and rejected/undesirable rows), got {a.batch}")
    if "grpo" in objectives and a.batch % arms.GROUP:
        p.error(f"--batch must be a multiple of the group size {arms.GROUP} for grpo, got {a.batch}")
    plot = a.plot or (os.path.join(os.path.dirname(a.save), "demo-{objective}.png") if a.save
                      else "humanline-demo-{objective}.png")
    try:
        plot.format(objective="dpo")
    except (KeyError, IndexError, ValueError):
        p.error(f"--plot: only {{objective}} may be substituted in the path, got {a.plot!r}")
    if a.save and os.path.isdir(a.save):
        p.error(f"--save: {a.save!r} is a directory; give the record's file name (e.g. {a.save}/demo.json)")
    flags = []
    for k in record.SETTINGS:  # the flags that change what is measured, as the record and README's table show them
        v, d = getattr(a, k), p.get_default(k)
        if v != d:
            flags += ["--" + k.replace("_", "-"), ",".join(f"{x:g}" for x in v) if k == "lrs" else f"{v:g}"]
    entries = []
    for objective in objectives:
        res = experiment.run(objective, a.steps, a.seeds, a.lrs, a.seed, a.device, a.batch, a.sft_steps, a.eval_n,
                             clip=clip, sync_every=a.sync_every,
                             resample_every=a.resample_every,
                             plot_path=None if a.no_plot else plot.format(objective=objective), workers=a.workers,
                             quiet=a.quiet)
        entries.append(record.entry(res, flags))
    if a.save:
        if not a.quiet:
            print("canary run for the record (a tiny run of every objective) ...", flush=True)
        record.save(a.save, entries)
        print(f"record: {a.save}")
    if a.markdown:
        print("\n" + record.table(entries))
    return 0
