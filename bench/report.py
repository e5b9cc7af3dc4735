"""``python -m bench report RUN [RUN ...] [--readme [PATH]] [--check [PATH]]``: README's generated sections.

README's numbers come from committed runs, never from a hand: two blocks of README are generated, each between
markers that name its source:

* ``<!-- benchmarks: RUN ... -->`` ... ``<!-- /benchmarks -->``: the Benchmarks section, from committed GPU runs
  (``bench/results/<run>``): logits path, fused linear, supervised tokens, reference sync, end to end and host, each
  a table of ours against every peer measured in the same run, with the card, the versions and the shapes, and the
  run's plot. Each section comes from the first RUN, in the order given (newest first), that holds its JSON; one
  that no RUN holds says so.
* ``<!-- demo-table: PATH -->`` ... ``<!-- /demo-table -->``: the demo's table, from the record that
  ``python -m humanline_kernels.demo --save PATH`` writes (:func:`demo_block`).

``python -m bench report RUN ...`` prints the Benchmarks section for those runs; ``--readme`` rewrites README's
blocks (the Benchmarks block from the RUNs given, or from the runs its marker names when none is given);
``--check`` exits 1 with a diff when README's blocks are not what the script writes (tests/test_readme.py checks
the same in CI). Paths are relative to the project's root.
"""
from __future__ import annotations

import difflib
import glob
import json
import os
import re
import sys

from .cli import Parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
BLOCK = re.compile(r"<!-- (benchmarks|demo-table): ([^>]*?) -->\n(.*?)<!-- /\1 -->", re.S)


# ------------------------------------------------------------------------------------------------- formatting
def _x(v, digits=2):
    return "" if v is None else f"{v:.{digits}f}x"


def _ms(v):
    return "" if v is None else (f"{v:#.3g} ms" if v < 10 else f"{v:.1f} ms")


def _table(head, rows):
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _where(env, run):
    """The card, the versions of torch, triton, CUDA and of every peer, and the run's folder."""
    peers = []
    for key, name in (("liger_kernel", "Liger-Kernel"), ("trl", "TRL"), ("cut_cross_entropy", "cut-cross-entropy"),
                      ("quack", "quack")):
        v = env.get(key)
        v = "not installed" if v is None else "(version not recorded)" if v == "installed" else v
        peers.append(f"{name} {v}")
    driver = f", driver {env['driver']}" if env.get("driver") else ""
    return (f"{env['device']}, torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}{driver}; "
            f"{', '.join(peers)}; `{run}`")


SPREAD = "each row's spread the range of its per-round medians over its median"


def _add_spread(head, body, rows, at):
    """A spread column at index ``at`` when ``rows`` were timed in interleaved rounds (``common.interleaved``: bench
    sync from run 11, bench linear from run 12); True if added."""
    if not any(r.get("spread_pct") is not None for r in rows):
        return False
    head.insert(at, "spread")
    for cells, r in zip(body, rows):
        cells.insert(at, "" if r.get("spread_pct") is None else f"{r['spread_pct']:.1f} %")
    return True


def _plot(run, name, alt):
    return f"\n\n![{alt}]({run}/{name}.png)" if os.path.exists(os.path.join(ROOT, run, f"{name}.png")) else ""


# --------------------------------------------------------------------------------------------------- sections
def _logits_table(d):
    rows = d["rows"]
    vocabs = sorted({r["V"] for r in rows})
    top = vocabs[-1]
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    at = {(r["impl"], r["V"]): r for r in rows}
    floor = [_ms(at[(impls[0], v)]["floor3_ms"]) for v in vocabs]
    body = [["3-pass floor", *floor, ""]]
    for impl in impls:
        cells = []
        for v in vocabs:
            r = at.get((impl, v))
            if r is None or r.get("ms") is None:
                cells.append("")
                continue
            ratio = r["ratio_2pass"] if r["floor_passes"] == 2 else r["ratio_3pass"]
            cells.append(f"{_ms(r['ms'])} ({_x(ratio)})")
        peak = at.get((impl, top), {}).get("peak_extra_MiB")
        name = f"`{impl}`" + (" (2-pass floor)" if at[(impl, vocabs[0])]["floor_passes"] == 2 else "")
        body.append([name, *cells, "" if peak is None else f"{peak:.0f}"])
    head = ["impl", *[f"V = {v}" for v in vocabs], f"peak extra MiB (V = {top})"]
    return _table(head, body)


def _logits(d, run, quack=""):
    m = d["meta"]
    text = (f"**Logits path** ({_where(d['env'], run)}): N = {m['N']} tokens, {m['dtype']}, forward + backward; "
            f"median time and its ratio to the 3-pass floor (the logits read in the forward, read and written in the "
            f"backward, at the copy bandwidth measured in the same run, {m['copy_bandwidth_TBps']:.2f} TB/s; rows "
            f"that form the gradient in the forward against the 2-pass floor); peak memory beyond the inputs, the "
            f"gradient of the logits included.\n\n{_logits_table(d)}")
    text += f"\n\n{quack}" if quack else ""
    return text + _plot(run, "logits", "logits path: ratio to the floor by vocabulary")


def _quack(runs, logits_run):
    """quack's rows (a call of their own, its wheels' carry: ``quack/logits.json``) from the newest run that has
    them, so that a newer logits run without quack keeps the peer in view, labelled with its own run."""
    for run in runs:
        q = _load(run, os.path.join("quack", "logits.json"))
        if q is not None:
            when = ("in a second call on the same machine" if run == logits_run else
                    "in an earlier run, with ours beside it in the same call")
            where = _where(q["env"], run + "/quack")
            bw = q["meta"]["copy_bandwidth_TBps"]
            return (f"quack beside ours and Liger, measured {when}, with its own floors ({where}; copy bandwidth "
                    f"{bw:.2f} TB/s):\n\n{_logits_table(q)}")
    return ""


def _linear(d, run):
    m = d["meta"]
    body = [[f"`{r['impl']}`", _ms(r["ms"]), _x(r["ratio_to_gemm"]),
             "" if r["peak_extra_GiB"] is None else f"{r['peak_extra_GiB']:.2f}", r.get("note") or ""]
            for r in d["rows"]]
    head = ["impl", "time", "x GEMM floor", "peak extra GiB", "note"]
    timing = (f"; the rows timed interleaved in {m['timing']['rounds']} rounds of {m['timing']['calls_a_round']} "
              f"calls, {SPREAD}" if _add_spread(head, body, d["rows"], 3) else "")
    budgets = ", ".join(f"{b / 2**20:.0f} MiB" for b in m.get("chunk_bytes", []))
    return (f"**Fused linear** ({_where(d['env'], run)}): N = {m['N']} tokens ({m['B']} x {m['T']}), D = {m['D']}, "
            f"V = {m['V']}, {m['dtype'].replace('torch.', '')}, forward + backward from the hidden states and the "
            f"lm_head weight; ratio to the bare lm_head GEMM forward + backward measured in the same run (the floor, "
            f"6 N D V flops); peak memory beyond the inputs, the returned gradients included; our chunk budget "
            f"{budgets}{timing}.\n\n{_table(head, body)}"
            + _plot(run, "linear", "fused linear: ratio to the GEMM floor"))


def _masks(d, run):
    m, rows = d["meta"], d["rows"]
    pcts = list(dict.fromkeys(r["ignored_pct"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    at = {(r["impl"], r["ignored_pct"]): r for r in rows}
    body = []
    for impl in impls:
        cells = []
        for p in pcts:
            r = at.get((impl, p))
            cells.append("" if r is None or r["ms"] is None else f"{_ms(r['ms'])} ({_x(r['ratio_to_gemm'])})")
        notes = {at[(impl, p)].get("note") for p in pcts if (impl, p) in at} - {"", None}
        body.append([f"`{impl}`", *cells, "; ".join(sorted(notes))])
    t = m.get("target") or {}
    target = (f" Target: `{t['impl']}` at most {t['ratio_to_gemm']}x at {t['ignored_pct']} % ignored: "
              f"{'met' if m.get('target_met') else 'missed'}." if t else "")
    return (f"**Supervised tokens only** ({_where(d['env'], run)}): N = {m['N']} ({m['B']} x {m['T']}), "
            f"D = {m['D']}, V = {m['V']}, {m['dtype'].replace('torch.', '')}, the first "
            f"{' / '.join(map(str, pcts))} % of every row ignored; time and its ratio to the dense lm_head GEMM "
            f"forward + backward over all N positions, measured in the same run; `(supervised)` rows run the lm_head "
            f"on the supervised positions only.{target}"
            f"\n\n{_table(['impl', *[f'{p} % ignored' for p in pcts], 'note'], body)}"
            + _plot(run, "linear_masks", "supervised tokens: ratio to the dense GEMM floor"))


def _sync(found, _run):
    """``found``: file name -> (JSON, its run) or None."""
    out = []
    copy, run = found.get("sync_copy.json") or (None, None)
    if copy:
        m = copy["meta"]
        pairs = list(dict.fromkeys((r["src"], r["dst"]) for r in copy["rows"]))
        impls = list(dict.fromkeys(r["impl"] for r in copy["rows"]))
        at = {(r["impl"], r["src"], r["dst"]): r for r in copy["rows"]}
        body = [[f"`{i}`", *[f"{at[(i, *p)]['TB/s']:.2f} TB/s ({_x(at[(i, *p)]['ratio_to_copy_bw'])})"
                             if (i, *p) in at else "" for p in pairs]] for i in impls]
        r0 = copy["rows"][0]
        out.append(f"**Reference sync** ({_where(copy['env'], run)}): {r0['params'] / 1e9:.2f} B parameters in "
                   f"{r0['tensors']} tensors, policy to reference; bandwidth and its ratio to a plain copy measured "
                   f"in the same run ({m['copy_bw_TBps']:.2f} TB/s).\n\n"
                   + _table(["impl", *[f"{s} -> {t}" for s, t in pairs]], body))
    for name, what in (("sync_overlap.json", "the sync beside {gemms} GEMMs of {gemm_n}^2 (a training step's "
                        "compute stand-in)"),
                       ("sync_fsdp2.json", "an FSDP2 training step ({layers} layers, hidden {hidden}, {tokens} "
                        "tokens)")):
        d, where = found.get(name) or (None, None)
        if d:
            body = [[f"`{r['impl']}`", _ms(r["ms"]), "" if r.get("added_pct") is None else f"{r['added_pct']:+.1f} %"]
                    for r in d["rows"]]
            head = ["what", "time", "added to the step"]
            other = "" if where == run else f" ({_where(d['env'], where)})"
            rounds = (f"; the rows timed interleaved in {d['meta']['rounds']} rounds, {SPREAD} (an added time under "
                      f"the spread is not told apart from none)" if _add_spread(head, body, d["rows"], 3) else "")
            out.append(f"Sync overlapped with compute{other}: {what.format(**d['meta'])}{rounds}.\n\n"
                       + _table(head, body))
    return "\n\n".join(out)


def _host(d, run):
    m = d["meta"]
    body = [[f"`{r['impl']}`" + (f" (D = {r['D']})" if r.get("D") else ""), f"{r['launches']} ({r['launch_budget']})",
             _ms(r["cpu_ms"]), _ms(r.get("cpu_cold_ms")), _ms(r["gpu_ms"]), f"{r['cpu_over_gpu']:.2f}",
             "yes" if r.get("syncs") else "no"] for r in d["rows"]]
    return (f"**Host** ({_where(d['env'], run)}): one forward + backward at N = {m['N']}, V = {m['V']}, "
            f"{m['dtype']}: device launches (our budget), CPU time per call in a burst of calls (and a single call "
            f"after a sync), GPU time, and whether the call waits for the device.\n\n"
            + _table(["call", "launches (budget)", "CPU", "CPU, cold", "GPU", "CPU / GPU", "host sync"], body)
            + _plot(run, "host", "host: CPU and GPU time per call"))


def _e2e(d, run):
    m = d["meta"]
    c = m["config"]
    keys = [k for k in d["rows"][0] if k.startswith("<=") or k.startswith("x_")]
    body = []
    for r in d["rows"]:
        body.append([f"`{r['arm']}`", r["what"], _ms(r["ms"]), *[_x(r.get(k)) if k.startswith("x_") else
                                                                  {True: "yes", False: "no", None: ""}[r.get(k)]
                                                                  for k in keys],
                     "" if r.get("peak_GiB") is None else f"{r['peak_GiB']:.1f}", f"{r['held_GiB']:.1f}"])
    checks = [f"{k}: {'ok' if v['ok'] else 'FAIL'}" for k, v in m.get("checks", {}).items() if isinstance(v, dict)]
    return (f"**End to end** ({_where(d['env'], run)}): one DPO optimizer step of a {m['params'] / 1e9:.2f} B "
            f"random-init Llama ({c['layers']} layers, hidden {c['hidden']}, V = {c['vocab']}), {m['dtype']}, "
            f"B = {c['batch']} x T = {c['seq']}, median of {c['steps']} steps after {c['warmup']}; peak memory over "
            f"the timed steps and the bytes held between steps (parameters, optimizer state, reference). Step-2 "
            f"losses of the arms that compute the same: {', '.join(checks) or 'not checked'}.\n\n"
            + _table(["arm", "what", "step", *keys, "peak GiB", "held GiB"], body)
            + _plot(run, "e2e", "end to end: step time and memory by arm"))


def _parity(d, run):
    p = d["stages"].get("parity")
    if not p:
        return ""
    return (f"**Parity** ({_where(d['env'], run)}): every fused path against `hk.reference` at N = 8192, "
            f"V = 128256, bf16: {p['summary']}.")


# (title, files, formatter): a section comes from the first run that holds its first file
SECTIONS = (("parity", ("gpu.json", "run*_gpu.json"), _parity),
            ("logits path", ("logits.json",), _logits),
            ("fused linear", ("linear.json",), _linear),
            ("supervised tokens", ("linear_masks.json",), _masks),
            ("reference sync", ("sync_copy.json", "sync_overlap.json", "sync_fsdp2.json"), _sync),
            ("end to end", ("e2e.json",), _e2e),
            ("host", ("host.json",), _host))


def _load(run, pattern):
    for path in sorted(glob.glob(os.path.join(ROOT, run, pattern))):
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    return None


def _find(run, files):
    """The section's JSON in ``run``, or None."""
    for pattern in files:
        d = _load(run, pattern)
        if d is not None:
            return d
    return None


def render(runs):
    """The Benchmarks section for ``runs`` (paths relative to the project's root, newest first)."""
    parts = []
    for title, files, fmt in SECTIONS:
        if title == "reference sync":  # each of its files from the newest run that has it (a run may skip some)
            found = {f: next(((d, r) for r in runs if (d := _load(r, f)) is not None), None) for f in files}
            if any(found.values()):
                parts.append(fmt(found, None))
                continue
        for k, run in enumerate(runs):
            d = _find(run, files)
            if d is not None:
                parts.append(_logits(d, run, _quack(runs[k:], run)) if fmt is _logits else fmt(d, run))
                if title == "end to end":  # arms the newest run left out (the TRL arms) from the newest that has them
                    parts += _older_e2e(d, runs[k + 1:], files)
                break
        else:
            parts.append(f"**{title[0].upper() + title[1:]}**: not measured in {', '.join(f'`{r}`' for r in runs)}.")
    return "\n\n".join(_wrap(p) for p in parts if p)


def _older_e2e(newest, older, files):
    """The e2e tables of older runs, newest first, each for the arms that no newer run shown has measured."""
    seen, out = {r["arm"] for r in newest["rows"]}, []
    for run in older:
        d = _find(run, files)
        if d is not None and {r["arm"] for r in d["rows"]} - seen:
            out.append("An earlier run with arms the one above lacks (its whole table, its own baselines):\n\n"
                       + _e2e(d, run))
            seen |= {r["arm"] for r in d["rows"]}
    return out


def _wrap(text):
    """Prose paragraphs at README's width (tables and images as they are)."""
    import textwrap
    return "\n\n".join(par if par.startswith(("|", "![")) else
                         textwrap.fill(par, 116, break_long_words=False, break_on_hyphens=False)
                         for par in text.split("\n\n"))


def blocks(text):
    """README's generated blocks: ``[(kind, argument string, content, match)]``."""
    return [(m.group(1), m.group(2).strip(), m.group(3), m) for m in BLOCK.finditer(text)]


def _demo_record():
    sys.path.insert(0, ROOT)  # the demo of this checkout, installed or not
    from humanline_kernels.demo import record
    return record


def demo_block(rec, record_path):
    """README's demo section between its markers: the run's settings and machine, the table of the default runs,
    the table of the other runs, the DPO plot when it is beside the record (``record_path`` as README names it,
    relative to the project's root)."""
    import textwrap
    table = _demo_record().table
    main = [e for e in rec["runs"] if not e["flags"] and not e["env"]]
    other = [e for e in rec["runs"] if e["flags"] or e["env"]]
    out = []
    if main:
        first = main[0]
        s, m = first["settings"], first["machine"]
        where = (f"{m['device'].upper()}" + (f" {m['cpu_capability']}" if m["cpu_capability"] else "")
                 + (f" ({m['cpu']})" if m.get("cpu") else "")
                 + f", {m['cores']} cores, {m['processes']} processes, torch {m['torch']}, transformers "
                 f"{m['transformers']}")
        commit = f"at commit {first['commit']}" + (" with local changes" if first["dirty"] else "") \
            if first["commit"] else "outside a git checkout"
        same = all(e["machine"] == m and e["commit"] == first["commit"] for e in main)
        lrs = ", ".join(f"{x:g}" for x in s["lrs"])
        took = ", ".join(f"{e['objective'].upper()} {e['total_s']:.0f} s" for e in main)
        out.append(
            f"What the default run measured (`python -m humanline_kernels.demo --objective all --save "
            f"{record_path}`; {where}; {commit}{'' if same else ' (some rows elsewhere: see the record)'}; "
            f"{s['steps']} steps x {s['batch']} sequences, learning rates {lrs}, {s['seeds']} seeds; rule rate of "
            f"the policy's own samples on the reported prompts, mean +- s.e.; the starting policy is at "
            f"{first['start']:.3f}, the behaviour model that wrote the offline data at {first['behaviour']:.3f}; "
            f"wall time of each run, setup included: {took}):")
        out[-1] = textwrap.fill(out[-1], 116, break_long_words=False, break_on_hyphens=False)
        out += ["", table(main)]
    if other:
        out += ["", "Other runs in the same record (the flags or environment shown, everything else the default):",
                "", table(other)]
    png = os.path.join(os.path.dirname(record_path), "demo-dpo.png")
    if os.path.exists(os.path.join(ROOT, png)):
        out += ["", f"![DPO: rule rate over training, each arm at its best learning rate]({png})"]
    return "\n".join(out)


def expected(kind, arg):
    """What a block of ``kind`` with marker argument ``arg`` holds."""
    if kind == "benchmarks":
        return render(arg.split())
    with open(os.path.join(ROOT, arg), encoding="utf-8") as f:
        return demo_block(json.load(f), arg)


def regenerate(text, runs=None):
    """``text`` (README) with every generated block rewritten; the Benchmarks block from ``runs`` when given."""
    out, last = [], 0
    for kind, arg, _, m in blocks(text):
        if kind == "benchmarks" and runs:
            arg = " ".join(runs)
        out += [text[last:m.start()], f"<!-- {kind}: {arg} -->\n{expected(kind, arg)}\n<!-- /{kind} -->"]
        last = m.end()
    return "".join(out) + text[last:]


def main(argv=None):
    p = Parser(prog="python -m bench report", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="*", metavar="RUN",
                   help="committed GPU runs, newest first (e.g. bench/results/2026-11-26-h200)")
    p.add_argument("--readme", nargs="?", const=README, default=None, metavar="PATH",
                   help="rewrite README's generated blocks in place (default README.md)")
    p.add_argument("--check", nargs="?", const=README, default=None, metavar="PATH",
                   help="exit 1 with a diff when README's generated blocks differ from what this script writes")
    a = p.parse_args(argv)
    for run in a.runs:
        if not os.path.isdir(os.path.join(ROOT, run)):
            p.error(f"no run folder {run!r} (give a path relative to the project's root, e.g. bench/results/...)")
    if a.readme or a.check:
        path = a.readme or a.check
        if not os.path.exists(path):
            p.error(f"no README at {path!r}")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if not blocks(text):
            p.error(f"{path} has no generated block (<!-- benchmarks: RUN ... --> or <!-- demo-table: PATH -->)")
        new = regenerate(text, a.runs if a.readme else None)
        if a.check:
            if new != text:
                sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True), path,
                                                           "generated"))
                print(f"{path}: generated blocks differ (python -m bench report --readme rewrites them)",
                      file=sys.stderr)
                return 1
            print(f"{path}: generated blocks match their sources")
            return 0
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
        print(f"wrote {path}")
        return 0
    if not a.runs:
        p.error("give at least one run folder (or --readme / --check)")
    print(render(a.runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
