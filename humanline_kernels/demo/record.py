"""The record (``--save PATH``): a JSON file of runs, each with what was run (the flags that change numbers, the
environment that changes rounding), where (the CPU model, its instruction set, the versions, the commit) and what
it measured per arm, with a canary (:mod:`.canary`) that lets CI check that the code still computes what the record
says. README's demo table is written from it (``python -m bench report --readme``); :func:`table` is its rows as
the markdown table that ``--markdown`` prints and the report lays out."""
from __future__ import annotations

import json
import os
import platform
import subprocess

import torch

from . import arms, canary, experiment, stats

# settings whose values change what a run measures (flags such as --workers, --plot or --quiet do not)
SETTINGS = ("steps", "seeds", "lrs", "seed", "batch", "sync_every", "resample_every", "sft_steps", "eval_n",
            "log_eps_p", "log_eps_r")
# environment variables that change the rounding of a CPU run, and so its numbers: the 60-step runs amplify
# round-off, so a run under ATEN_CPU_CAPABILITY=avx2 on an AVX512 CPU ends elsewhere than the native one
NUMERIC_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "TRITON_INTERPRET")
HEADER = ("objective", "offline", "offline+humanline", "online", "humanline vs online (wall time)",
          "humanline vs offline")


def _git_commit():
    """(commit, dirty) of the checkout this package runs from, or (None, None) outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                              cwd=canary.ROOT, timeout=30)
        if head.returncode:
            return None, None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, cwd=canary.ROOT, timeout=30)
        return head.stdout.strip(), bool(status.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, None


def entry(result, flags):
    """One run of one objective as the record keeps it: what was run (the flags that change numbers, the
    environment that changes rounding), where, and what it measured per arm."""
    import transformers

    info = result["info"]
    commit, dirty = _git_commit()
    measured = {arm: {k: b[k] for k in ("rule_rate", "se", "heldout", "clip_frac", "syncs", "wall_s", "sample_s",
                                        "lr")}
                for arm, b in result["best"].items()}
    return {"objective": info["objective"], "flags": list(flags),
            "env": {k: os.environ[k] for k in NUMERIC_ENV if k in os.environ},
            "settings": {**{k: info[k] for k in SETTINGS if k in info},  # (the band's ends: "clip")
                         "clip": [info["clip"].log_eps_p, info["clip"].log_eps_r]},
            "machine": {"device": info["device"], "cpu": canary.cpu_key() if info["device"] == "cpu" else None,
                        "cpu_capability": info["cpu"], "processes": info["workers"],
                        "cores": experiment.cores(), "torch": torch.__version__,
                        "transformers": transformers.__version__, "python": platform.python_version()},
            "commit": commit, "dirty": dirty, "behaviour": info["behaviour"], "start": info["start"],
            "setup_s": info["setup_s"], "total_s": info["total_s"], "cpu_s": info["cpu_s"], "arms": measured,
            "verdict": result["verdict"]}


def _key(e):
    return e["objective"], tuple(e["flags"]), tuple(sorted(e["env"].items()))


def save(path, entries):
    """Merge ``entries`` into the JSON record at ``path`` (an entry of the same objective, flags and environment
    is replaced), with a fresh canary (:func:`canary.run_subprocess`); returns the record."""
    record = {"runs": []}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    new = {_key(e) for e in entries}
    runs = [e for e in record["runs"] if _key(e) not in new] + list(entries)
    order = {o: i for i, o in enumerate(arms.OBJECTIVES)}
    # the default runs first, then the other runs of each objective, those with flags before those with an
    # environment of their own
    runs.sort(key=lambda e: (bool(e["flags"] or e["env"]), order[e["objective"]], bool(e["env"]), e["flags"],
                             sorted(e["env"].items())))
    record = {"what": "python -m humanline_kernels.demo --save: README's demo table is written from this file "
                      "(python -m bench report --readme)",
              "canary_env": canary.ENV, "canary_settings": {**canary.SETTINGS, "lrs": list(canary.SETTINGS["lrs"])},
              "canary_cpu": canary.cpu_key(), "canary": canary.run_subprocess(), "runs": runs}
    _write(path, record)
    return record


def _write(path, record):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


def add_canary(path):
    """Keep this CPU's canary bits in the record at ``path`` beside the record's own, after checking that they are
    within round-off of it (:func:`canary.check`): the same code, rounded by another CPU. Returns ``(verdict,
    message)``; the record is written only on ``"close"``."""
    with open(path, encoding="utf-8") as f:
        record = json.load(f)
    cpu, now = canary.cpu_key(), canary.run_subprocess()
    verdict, msg = canary.check(record, now, cpu)
    if verdict == "close":
        if canary.run_subprocess() != now:  # bits kept for exact checks must be ones this CPU repeats
            return "differ", f"this CPU ({cpu}) does not repeat its own canary's bits; nothing kept"
        record["canary_other_cpus"] = {**record.get("canary_other_cpus", {}), cpu: now}
        _write(path, record)
        msg += f"; kept its bits in {path}"
    return verdict, msg


def label(e):
    """The objective's name in a table (GRPO's with how often its offline arms resample)."""
    name = e["objective"].upper()
    if e["objective"] == "grpo":
        name += f" (offline: resampled every {e['settings']['resample_every']} steps)"
    return name


def run_label(e):
    """What makes a run other than the default: its flags, its environment, and the instruction set it ran on."""
    parts = [f"`{' '.join(e['flags'])}`"] if e["flags"] else []
    parts += [f"`{k}={v}`" for k, v in sorted(e["env"].items())]
    return ", ".join(parts) + (f" ({e['machine']['cpu_capability']})" if e["machine"]["cpu_capability"] else "")


def _versus(e, other, across):
    """offline+humanline against ``other`` in run ``e``; with ``across`` (the same runs rounded otherwise) above or
    below only when every one of them says so too, else not significant with each run's number."""
    hl, b = e["arms"]["offline+humanline"], e["arms"][other]
    said = {stats.conclusion(x["arms"]["offline+humanline"], x["arms"][other]) for x in [e, *across]}
    if len(said) == 1:
        return stats.versus(hl, b)
    sizes = [f"{x['machine']['cpu_capability'] or x['machine']['device']} "
             f"{stats.size(x['arms']['offline+humanline'], x['arms'][other])}" for x in [e, *across]]
    return f"not significant: {', '.join(sizes)}"


def table(entries, across=()):
    """The runs as a markdown table: a row per run, the rule rates (mean +- s.e.) of the three arms and humanline
    against online (and its wall-time ratio) and against plain offline; a ``run`` column when any run has flags or
    an environment of its own. ``across``: other runs of the same objectives (the default runs rounded otherwise)
    whose conclusions a comparison must share to be called above or below."""
    with_run = any(e["flags"] or e["env"] for e in entries)
    head = list(HEADER)
    if with_run:
        head.insert(1, "run")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in entries:
        a = e["arms"]
        same = [x for x in across if x["objective"] == e["objective"]]
        cells = [label(e)] + ([run_label(e)] if with_run else [])
        cells += [f"{a[arm]['rule_rate']:.3f} +- {a[arm]['se']:.3f}" for arm in arms.ARMS]
        cells += [f"{_versus(e, 'online', same)}, {stats.pace(a['offline+humanline'], a['online'])}",
                  _versus(e, "offline", same)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
