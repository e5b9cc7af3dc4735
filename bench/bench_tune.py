"""Tune the launch configurations on this GPU (issue 53, target 4): ``(BLOCK_V, num_warps)`` per kernel family and
vocabulary size, written as the table the launchers read (humanline_kernels/ops/tuning.py).

``python -m bench tune [--vocab V ...] [--n N] [--family F ...] [--out DIR] [--write] [--quick]``

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
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

from . import common
from .cli import Parser

VOCABS = (32000, 128256, 151936)
GAIN = 0.02  # a candidate must beat the default by this much to become an entry


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
    elif family == "gif":  # the persistent grid of the one-launch forward
        def call():
            torch.autograd.grad(hk.fused.grpo(x, y, ref, adv, beta=0.04, validate=False, grad_in_forward=True)[0], x)
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


def run(N, vocabs, families, *, quick, out_dir, write):
    from humanline_kernels.ops import tuning
    device = "cuda" if torch.cuda.is_available() and not quick else "cpu"
    # the table's key is the launchers' own name for the card
    card = (tuning.device_name(torch.device("cuda", torch.cuda.current_device())) if device == "cuda"
            else f"cpu ({common.env_info()['device']})")
    rows, table, started = [], {}, time.perf_counter()
    for family in families:
        for V in vocabs:
            call = family_call(family, N, V, device)
            times = {}
            for block, warps in tuning.CANDIDATES[family]:
                row = {"family": family, "V": V, "candidate": f"{block}x{warps}", "BLOCK_V": block, "warps": warps}
                try:
                    with tuning.forced(family, block, warps), _Spills() as sp:
                        call()  # compiles (once a configuration: V is a runtime argument)
                        if sp.spilled:
                            row["dropped"] = "; ".join(sp.spilled)
                        else:
                            row["ms"] = common.time_ms(call, warmup=2 if quick else 10, rep=5 if quick else 50)
                            times[(block, warps)] = row["ms"]
                except Exception as e:  # a candidate that fails is reported, not fatal
                    row["dropped"] = f"{type(e).__name__}: {str(e)[:160]}"
                rows.append(row)
                print(f"  tune {family} V={V} {block}x{warps}: "
                      f"{row.get('ms', float('nan')):.4g} ms {row.get('dropped', '')}", file=sys.stderr, flush=True)
            default = tuning.CANDIDATES[family][0]
            if times:
                best = min(times, key=times.get)
                base = times.get(default)
                wins = base is None or times[best] <= (1 - GAIN) * base  # (no default timed: the best is taken)
                for r in rows:
                    if r["family"] == family and r["V"] == V and "ms" in r:
                        r["vs_default"] = None if base is None else r["ms"] / base
                        r["chosen"] = wins and (r["BLOCK_V"], r["warps"]) == best
                if wins:
                    table.setdefault(family, {})[str(V)] = list(best)
            del call
            if device == "cuda":
                torch.cuda.empty_cache()
    seconds = time.perf_counter() - started
    tuned = {"format": 1, "what": tuning.table().get("what", ""), "devices": {}}
    if device == "cuda":
        tuned["devices"] = {**tuning.table().get("devices", {}), card: {"bf16": table}}
    meta = {"N": N, "vocabs": list(vocabs), "families": list(families), "dtype": "bfloat16", "card": card,
            "gain": GAIN, "seconds": seconds, "quick": quick, "table": {card: {"bf16": table}},
            "what": "each candidate forced on its family alone; ms: median of the family's call"}
    path = common.save("tune" + ("_quick" if quick else ""), rows, meta, out_dir, bar="ms", series="family",
                       label=("V", "candidate"))
    with open(os.path.join(out_dir, "tuned.json"), "w") as f:
        json.dump(tuned, f, indent=2)
    print(f"wrote {os.path.join(out_dir, 'tuned.json')} ({len(table)} families with an entry; {seconds:.0f} s)")
    if write and device == "cuda":
        with open(tuning.TABLE_PATH, "w") as f:
            json.dump(tuned, f, indent=2)
        tuning.set_table(None)
        print(f"wrote {tuning.TABLE_PATH}: run the compile gate (tests/test_compile_gate.py) before committing it")
    return path


def main(argv=None):
    from humanline_kernels.ops import tuning
    p = Parser(prog="python -m bench tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny CPU run of the harness through the interpreter")
    p.add_argument("--out", default="bench/out", help="output directory for tune.json, tuned.json and the PNG")
    p.add_argument("--n", type=int, default=None, help="tokens (default 8192; 16 with --quick)")
    p.add_argument("--vocab", type=int, nargs="+", default=None, help=f"vocabulary sizes (default {VOCABS})")
    p.add_argument("--family", nargs="+", default=None, choices=tuning.FAMILIES, help="families (default: all)")
    p.add_argument("--write", action="store_true", help="also write the table into the package (GPU only)")
    a = p.parse_args(argv)
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
    run(N, vocabs, a.family or tuning.FAMILIES, quick=a.quick, out_dir=a.out, write=a.write)
    return 0
