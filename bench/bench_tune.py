"""Tune the launch configurations on this GPU (issue 53, target 4): ``(BLOCK_V, num_warps)`` per kernel family and
vocabulary size, written as the table the launchers read (humanline_kernels/ops/tuning.py).

``python -m bench tune [--vocab V ...] [--n N] [--family F ...] [--out DIR] [--write] [--quick]``
``python -m bench tune --from-logits RECORD ... [--arm NAME] [--out DIR] [--write]``

For each family (``fwd``: ``token_logprobs``' forward; ``terms``: GRPO's fused forward, the token-terms and folded
kernels; ``bwd``: ``token_logprobs``' backward; ``gif``: GRPO with the gradient in the forward on the persistent
grid, folded) and vocabulary size, every candidate of ``tuning.CANDIDATES`` is forced on that family alone and the
call timed (bf16 logits ``[1, N, V]``, median of CUDA-event timings); a candidate whose kernels spill registers on
this card's compiler is dropped. The fastest candidate is the table's entry when it beats the default (the first
candidate) by at least 2 %; otherwise the default stays (no entry). Writes ``DIR/tune.json`` (every time, the
environment) and ``DIR/tuned.json`` (the table: copy it to humanline_kernels/ops/tuned.json, or ``--write`` does,
and run the compile gate before committing: a tuned configuration must compile spill-free for sm_80 and sm_90 on
both version pairs). Made to take under 2 minutes on one H100 at the default three vocabulary sizes (estimated:
20 configurations compiled once each, V is a runtime argument). ``--quick``: a tiny CPU run of the harness through
the interpreter (nothing is written to the package).

``grad_in_forward`` (issue 91, target 3: the option is never slower than not using it): per vocabulary size, GRPO
with ``grad_in_forward=True`` forced onto the default path, the Triton kernel and, on sm_90, each cluster
configuration; the table's ``"grad_in_forward"`` section gets the fastest when it beats the default path by 2 %,
else ``"default"`` (written: the package then runs the default path for the option there). ``--from-logits``
derives those entries from committed ``bench logits`` records instead (the rows ``hk.fused.grpo``,
``hk.fused.grpo(grad_in_fwd)`` and its cluster rows; a candidate counts at its worst ratio over the records).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import torch

from . import common
from .cli import Parser

VOCABS = (32000, 128256, 151936)
GAIN = 0.02  # a candidate must beat the default by this much to become an entry
PATH = "grad_in_forward"  # the table section that chooses what forms GRPO's gradient for grad_in_forward=True
CLUSTER = ((1, 512), (2, 256), (4, 256), (4, 512), (8, 256))  # the cluster configurations timed on sm_90


def family_call(family, N, V, device):
    """``(call, leaf)``: what a family's configuration changes, as the benchmarks call it (``call()`` runs it)."""
    import humanline_kernels as hk
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, N, V, device=device, generator=g).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, V, (1, N), device=device, generator=g)
    ref = torch.randn(1, N, device=device, generator=g) - 4
    adv = torch.randn(1, device=device, generator=g)
    go = torch.randn(1, N, device=device, generator=g)

    if family == "fwd":
        def call():
            with torch.no_grad():
                hk.token_logprobs(x, y, validate=False)
    elif family == "terms":
        def call():
            with torch.no_grad():
                hk.fused.grpo(x, y, ref, adv, beta=0.04, validate=False)
    elif family == "bwd":
        def call():
            torch.autograd.grad(hk.token_logprobs(x, y, validate=False), x, go)
    elif family in ("gif", PATH):  # gif: the persistent grid of the one-launch forward; PATH: as forced around it
        from humanline_kernels.ops import tuning

        def call():
            with tuning.forced_path("triton") if family == "gif" else contextlib.nullcontext():
                torch.autograd.grad(hk.fused.grpo(x, y, ref, adv, beta=0.04, validate=False,
                                                  grad_in_forward=True)[0], x)
    else:
        raise ValueError(f"unknown family {family!r}")
    return call


class _Spills:
    """Compiled kernels launched inside: ``spilled`` lists those whose registers spill on this card's compiler
    (Triton's ``n_spills`` of the kernels ``JITFunction.run`` returns; none in the interpreter)."""

    def __enter__(self):
        from triton.runtime.jit import JITFunction
        self.run, self.spilled = JITFunction.run, []
        outer = self

        def run(jf, *args, **kwargs):
            k = outer.run(jf, *args, **kwargs)
            n = getattr(k, "n_spills", None)
            if n:
                outer.spilled.append(f"{jf.fn.__name__}: {n} spills")
            return k
        JITFunction.run = run
        return self

    def __exit__(self, *exc):
        from triton.runtime.jit import JITFunction
        JITFunction.run = self.run


def candidates(family, V, device):
    """``[(label, context, entry)]`` of a family at ``V``, the default first: ``context()`` forces the candidate,
    ``entry`` is what the table would hold. A launch family's are ``tuning.CANDIDATES``; :data:`PATH`'s the default
    path, the Triton kernel and, on an sm_90 device, the cluster configurations whose rows fit."""
    from humanline_kernels.ops import cluster, tuning
    if family != PATH:
        return [(f"{b}x{w}", lambda b=b, w=w: tuning.forced(family, b, w), [b, w])
                for b, w in tuning.CANDIDATES[family]]
    out = [(p, lambda p=p: tuning.forced_path(p), p) for p in tuning.PATHS]
    probe = torch.empty((1, 1, V), dtype=torch.bfloat16, device="meta")
    if device == "cuda" and cluster.arch_ok(torch.device("cuda", torch.cuda.current_device())):
        out += [(f"cluster {c}x{t}", lambda c=c, t=t: cluster.forced(c, t), [c, t])
                for c, t in CLUSTER if cluster.fits(probe, None, c)]
    return out


def choose(times: dict, default: str, family: str):
    """The table's entry from ``{label: ms}``: the fastest when it beats the default by :data:`GAIN` (every
    candidate's when the default was not timed), else None for a launch family (the defaults stay) and the default
    path for :data:`PATH` (written: the measurement that the option does not pay there)."""
    best = min(times, key=times.get)
    base = times.get(default)
    if base is None or times[best] <= (1 - GAIN) * base:
        return best
    return default if family == PATH else None


def run(N, vocabs, families, *, quick, out_dir, write):
    from humanline_kernels.ops import tuning
    device = "cuda" if torch.cuda.is_available() and not quick else "cpu"
    # the table's key is the launchers' own name for the card
    card = (tuning.device_name(torch.device("cuda", torch.cuda.current_device())) if device == "cuda"
            else f"cpu ({common.env_info()['device']})")
    rows, table, paths, started = [], {}, {}, time.perf_counter()
    for family in families:
        for V in vocabs:
            call = family_call(family, N, V, device)
            times, entries = {}, {}
            cands = candidates(family, V, device)
            for label, context, entry in cands:
                row = {"family": family, "V": V, "candidate": label, "entry": entry}
                try:
                    with context(), _Spills() as sp:
                        call()  # compiles (once a configuration: V is a runtime argument)
                        if sp.spilled:
                            row["dropped"] = "; ".join(sp.spilled)
                        else:
                            row["ms"] = common.time_ms(call, warmup=2 if quick else 10, rep=5 if quick else 50)
                            times[label], entries[label] = row["ms"], entry
                except Exception as e:  # a candidate that fails is reported, not fatal
                    row["dropped"] = f"{type(e).__name__}: {str(e)[:160]}"
                rows.append(row)
                print(f"  tune {family} V={V} {label}: "
                      f"{row.get('ms', float('nan')):.4g} ms {row.get('dropped', '')}", file=sys.stderr, flush=True)
            if times:
                default = cands[0][0]
                chosen = choose(times, default, family)
                for r in rows:
                    if r["family"] == family and r["V"] == V and "ms" in r:
                        r["vs_default"] = None if default not in times else r["ms"] / times[default]
                        r["chosen"] = r["candidate"] == chosen
                if chosen is not None:
                    (paths if family == PATH else table.setdefault(family, {}))[str(V)] = entries[chosen]
            del call
            if device == "cuda":
                torch.cuda.empty_cache()
    seconds = time.perf_counter() - started
    tuned = tuning.table()
    if device == "cuda":
        tuned = with_entries(tuned, card, "bf16", table if any(f != PATH for f in families) else None,
                             paths if PATH in families else None)
    meta = {"N": N, "vocabs": list(vocabs), "families": list(families), "dtype": "bfloat16", "card": card,
            "gain": GAIN, "seconds": seconds, "quick": quick, "table": {card: {"bf16": table}},
            PATH: {card: {"bf16": paths}},
            "what": "each candidate forced on its family alone; ms: median of the family's call"}
    path = common.save("tune" + ("_quick" if quick else ""), rows, meta, out_dir, bar="ms", series="family",
                       label=("V", "candidate"))
    write_table(tuned, out_dir, write and device == "cuda")
    print(f"({len(table)} families with an entry, {len(paths)} grad_in_forward entries; {seconds:.0f} s)")
    return path


def with_entries(t: dict, card: str, dtype_key: str, launches, paths) -> dict:
    """The table ``t`` with ``card``'s entries for ``dtype_key`` replaced: its launch families' (``launches``) and
    its :data:`PATH` section's (``paths``); None keeps what ``t`` has. Other cards and sections are kept."""
    out = {**t, "format": 1, "what": t.get("what", ""), "devices": dict(t.get("devices") or {})}
    if launches is not None:
        out["devices"][card] = {**out["devices"].get(card, {}), dtype_key: launches}
    if paths is not None:  # merged by V: a run that timed some sizes keeps the others' entries
        section = dict(out.get(PATH) or {})
        section[card] = {**section.get(card, {}), dtype_key: {**section.get(card, {}).get(dtype_key, {}), **paths}}
        out[PATH] = section
    return out


def write_table(tuned: dict, out_dir: str, into_package: bool):
    from humanline_kernels.ops import tuning
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tuned.json"), "w") as f:
        json.dump(tuned, f, indent=2)
        f.write("\n")
    print(f"wrote {os.path.join(out_dir, 'tuned.json')}")
    if into_package:
        with open(tuning.TABLE_PATH, "w") as f:
            json.dump(tuned, f, indent=2)
            f.write("\n")
        tuning.set_table(None)
        print(f"wrote {tuning.TABLE_PATH}: run the compile gate (tests/ops/test_compile_gate.py) before committing it")


def from_logits(records, *, out_dir, write, arm="hk.fused"):
    """:data:`PATH`'s entries from ``bench logits`` records (no GPU): per card and vocabulary, the row
    ``{arm}.grpo`` (the default path) against ``{arm}.grpo(grad_in_fwd)`` (the Triton kernel) and any
    ``{arm}.grpo(grad_in_fwd,cluster CxT)``, each candidate at its worst ratio to the default over the records
    of that card; the best candidate is the entry when that ratio is at most ``1 - GAIN``, else ``"default"``.
    ``arm``: the name the records give the package's present kernels (``hk.fused``; an older record that timed them
    beside a retired default names them otherwise, e.g. ``hk.fused[fold]``)."""
    from humanline_kernels.ops import tuning
    ratios, seen = {}, {}  # (card, dtype key, V) -> {label: [ratio to the default in each record]}, records
    for rec in records:
        with open(rec) as f:
            d = json.load(f)
        card = d["env"]["device"]
        dtype_key = tuning.DTYPES[getattr(torch, d["meta"]["dtype"])]
        ms = {(r["impl"], r["V"]): r["ms"] for r in d["rows"] if r.get("ms")}
        for (impl, V), t in ms.items():
            base = ms.get((arm + ".grpo", V))
            if impl == arm + ".grpo" and base:
                seen[(card, dtype_key, V)] = seen.get((card, dtype_key, V), 0) + 1
            label = _path_label(impl, arm)
            if label is not None and base:
                ratios.setdefault((card, dtype_key, V), {}).setdefault(label, []).append(t / base)
    if not ratios:
        raise ValueError(f"no {arm}.grpo and {arm}.grpo(grad_in_fwd) rows in these records")
    tuned, rows = tuning.table(), []
    for (card, dtype_key, V), per in sorted(ratios.items()):
        worst = {label: max(r) for label, r in per.items()}
        best = min(worst, key=worst.get)
        entry = _path_entry(best) if worst[best] <= 1 - GAIN else "default"
        rows.append({"card": card, "dtype": dtype_key, "V": V, "entry": entry, "records": seen[(card, dtype_key, V)],
                     **{f"worst {label}": round(w, 4) for label, w in worst.items()}})
        print(f"  {card} {dtype_key} V={V}: {entry} (" + ", ".join(f"{k} {v:.3f}x" for k, v in worst.items())
              + " the default, at worst)", file=sys.stderr)
        tuned = with_entries(tuned, card, dtype_key, None, {str(V): entry})
    common.save("tune_paths", rows, {"records": list(records), "arm": arm, "gain": GAIN,
                                     "what": "grad_in_forward entries from bench logits records"}, out_dir,
                bar="worst triton", series="card", label=("V", "entry"))
    write_table(tuned, out_dir, write)
    return rows


def _path_label(impl: str, arm: str):
    """The candidate a ``bench logits`` row times (the default path's own row is the base), or None."""
    if impl == arm + ".grpo(grad_in_fwd)":
        return "triton"
    prefix = arm + ".grpo(grad_in_fwd,cluster "
    if impl.startswith(prefix) and impl.endswith(")"):
        return "cluster " + impl[len(prefix):-1]
    return None


def _path_entry(label: str):
    if label.startswith("cluster "):
        return [int(v) for v in label.split()[1].split("x")]
    return label


def main(argv=None):
    from humanline_kernels.ops import tuning
    p = Parser(prog="python -m bench tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny CPU run of the harness through the interpreter")
    p.add_argument("--out", default="bench/out", help="output directory for tune.json, tuned.json and the PNG")
    p.add_argument("--n", type=int, default=None, help="tokens (default 8192; 16 with --quick)")
    p.add_argument("--vocab", type=int, nargs="+", default=None, help=f"vocabulary sizes (default {VOCABS})")
    p.add_argument("--family", nargs="+", default=None, choices=tuning.FAMILIES + (PATH,),
                   help=f"families (default: all); {PATH}: what forms GRPO's gradient for grad_in_forward=True")
    p.add_argument("--write", action="store_true", help="also write the table into the package (GPU or "
                   "--from-logits)")
    p.add_argument("--from-logits", nargs="+", default=None, metavar="RECORD",
                   help=f"no timing: the {PATH} entries from these `bench logits` records (logits.json)")
    p.add_argument("--arm", default=None, help="with --from-logits: the records' name of the package's present "
                   "kernels (default hk.fused; e.g. hk.fused[fold] in a record that timed them beside a retired "
                   "default)")
    a = p.parse_args(argv)
    if a.arm is not None and not a.from_logits:
        p.error("--arm names rows of the records --from-logits reads")
    if a.from_logits:
        if a.quick or a.family or a.vocab or a.n is not None:
            p.error("--from-logits reads records: not with --quick, --family, --vocab or --n")
        missing = [r for r in a.from_logits if not os.path.isfile(r)]
        if missing:
            p.error(f"no such record: {missing[0]}")
        try:
            from_logits(a.from_logits, out_dir=a.out, write=a.write, arm=a.arm or "hk.fused")
        except (ValueError, KeyError, AttributeError, TypeError) as e:
            p.error(f"not a bench logits record with GRPO rows: {type(e).__name__}: {e}")
        return 0
    if a.n is not None and a.n < 1:
        p.error(f"--n must be at least 1, got {a.n}")
    if a.vocab and min(a.vocab) < 2:
        p.error(f"--vocab sizes must be at least 2, got {min(a.vocab)}")
    if not a.quick and not torch.cuda.is_available():
        p.error("needs a CUDA device (or --quick for the CPU run of the harness)")
    if a.write and a.quick:
        p.error("--write writes the package's table from a GPU run; not with --quick")
    if a.quick:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    N = a.n or (16 if a.quick else 8192)
    vocabs = a.vocab or ((100, 300) if a.quick else VOCABS)
    run(N, vocabs, a.family or tuning.FAMILIES + (PATH,), quick=a.quick, out_dir=a.out, write=a.write)
    return 0
