"""``python -m bench report RUN [RUN ...] [--readme [PATH]] [--check [PATH]]``: the generated pages' numbers.

The numbers of README.md and docs/benchmarks.md come from committed runs, never from a hand: their blocks between
markers that name the sources are written here.

* ``<!-- benchmarks: RUN ... -->`` (docs/benchmarks.md): from committed GPU runs (``bench/results/<run>``), the
  logits path, fused linear, supervised tokens, reference sync, end to end and host, each a table of ours against
  every peer measured in the same run, with the card, the versions and the shapes, and the run's plot. Each section
  comes from the first RUN, in the order given (newest first), that holds its JSON; one that no RUN holds says so.
  Rows of a path a measurement retired stay in the JSON.
* ``<!-- headline: RUN ... -->`` (README): one table, per measure our best against the best peer, from the calls
  the benchmarks section shows for the same runs (:func:`headline`).
* ``<!-- demo-table: PATH -->`` (README) and ``<!-- demo-runs: PATH -->`` (docs/benchmarks.md): the demo's default
  runs, and every run of the record, from the record that ``python -m humanline_kernels.demo --save PATH`` writes
  (:func:`demo_block`, :func:`demo_runs`).

``python -m bench report RUN ...`` prints the benchmarks section for those runs; ``--readme`` rewrites the pages'
blocks (the benchmark blocks from the RUNs given, or from the runs their markers name when none is given);
``--check`` exits 1 with a diff when a page's blocks are not what the script writes (tests/test_readme.py checks
the same in CI). Paths are relative to the project's root.
"""
from __future__ import annotations

import difflib
import glob
import importlib
import json
import os
import re
import sys

from .cli import Parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ("README.md", "docs/benchmarks.md")  # the pages with generated blocks, from the project's root
BLOCK = re.compile(r"<!-- (benchmarks|headline|demo-table|demo-runs): ([^>]*?) -->\n(.*?)<!-- /\1 -->", re.S)


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
# the rows of a path a measurement retired (bench logits' ``hk.fused[previous]``) stay in the JSON, out of the tables
RETIRED = "[previous]"


def _current(rows, key="impl"):
    return [r for r in rows if RETIRED not in r[key]]


def _logits_table(d):
    rows = _current(d["rows"])
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
            f"gradient of the logits included"
            + (" (the rows of retired paths, `hk.fused[previous]`, are in the run's JSON only)"
               if len(_current(d["rows"])) < len(d["rows"]) else "")
            + f".\n\n{_logits_table(d)}")
    text += f"\n\n{quack}" if quack else ""
    return text + _plot(run, "logits", "logits path: ratio to the floor by vocabulary")


def _quack_call(runs):
    """quack's rows (a call of their own, its wheels' carry: ``quack/logits.json``) from the newest run that has
    them, so that a newer logits run without quack keeps the peer in view: ``(run, data)`` or None."""
    for run in runs:
        q = _load(run, os.path.join("quack", "logits.json"))
        if q is not None:
            return run, q
    return None


def _quack(run, q, logits_run):
    when = ("in a second call on the same machine" if run == logits_run else
            "in an earlier run, with ours beside it in the same call")
    where = _where(q["env"], run + "/quack")
    bw = q["meta"]["copy_bandwidth_TBps"]
    return (f"quack beside ours and Liger, measured {when}, with its own floors ({where}; copy bandwidth "
            f"{bw:.2f} TB/s):\n\n{_logits_table(q)}")


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
    """``found``: file name -> (its run, JSON) or None."""
    out = []
    run, copy = found.get("sync_copy.json") or (None, None)
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
        where, d = found.get(name) or (None, None)
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


# words of a recorded run that name a switch since made an argument, as README says them today
_RENAMED = (("HK_SYNC_COPY_ENGINE=0", "copy_engine=False"),)


def _today(text):
    for old, new in _RENAMED:
        text = text.replace(old, new)
    return text


def _e2e(d, run):
    m = d["meta"]
    c = m["config"]
    keys = [k for k in d["rows"][0] if k.startswith("<=") or k.startswith("x_")]
    body = []
    for r in d["rows"]:
        body.append([f"`{r['arm']}`", _today(r["what"]), _ms(r["ms"]), *[_x(r.get(k)) if k.startswith("x_") else
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


def shown(runs):
    """The calls the Benchmarks section shows for ``runs`` (newest first), by section title: a list of ``(run,
    data)``, the section's own call first (logits path: then quack's call; end to end: then the older runs with
    arms the newer ones lack); reference sync: ``{file: (run, data) or None}``, each file from the newest run that
    has it (a run may skip some)."""
    out = {}
    for title, files, _ in SECTIONS:
        if title == "reference sync":
            out[title] = {f: next(((r, d) for r in runs if (d := _load(r, f)) is not None), None) for f in files}
            continue
        out[title] = []
        for k, run in enumerate(runs):
            d = _find(run, files)
            if d is not None:
                out[title].append((run, d))
                if title == "logits path" and (q := _quack_call(runs[k:])):
                    out[title].append(q)
                if title == "end to end":
                    out[title] += _older_e2e(d, runs[k + 1:], files)
                break
    return out


def render(runs):
    """The Benchmarks section for ``runs`` (paths relative to the project's root, newest first)."""
    parts, calls = [], shown(runs)
    for title, _, fmt in SECTIONS:
        found = calls[title]
        if title == "reference sync" and any(found.values()):
            parts.append(fmt(found, None))
        elif title == "logits path" and found:
            (run, d), quack = found[0], found[1:]
            parts.append(_logits(d, run, _quack(*quack[0], run) if quack else ""))
        elif title == "end to end" and found:
            parts.append(_e2e(found[0][1], found[0][0]))
            parts += ["An earlier run with arms the one above lacks (its whole table, its own baselines):\n\n"
                      + _e2e(d, run) for run, d in found[1:]]
        elif found and title != "reference sync":
            parts.append(fmt(found[0][1], found[0][0]))
        else:
            parts.append(f"**{title[0].upper() + title[1:]}**: not measured in {', '.join(f'`{r}`' for r in runs)}.")
    return "\n\n".join(_wrap(p) for p in parts if p)


def _older_e2e(newest, older, files):
    """The e2e calls of older runs, newest first, each with arms that no newer run shown has measured."""
    seen, out = {r["arm"] for r in newest["rows"]}, []
    for run in older:
        d = _find(run, files)
        if d is not None and {r["arm"] for r in d["rows"]} - seen:
            out.append((run, d))
            seen |= {r["arm"] for r in d["rows"]}
    return out


# ---------------------------------------------------------------------------------------------------- headline
def _at(rows, key, value):
    return [r for r in rows if r.get(key) == value]


def _dtype(d):
    dtype = d["meta"].get("dtype", "").replace("torch.", "")
    return {"dtype": {"bf16": "bfloat16"}.get(dtype, dtype)}


def _logits_rows(d):
    vocab = 128256 if any(r["V"] == 128256 for r in d["rows"]) else max(r["V"] for r in d["rows"])
    # across calls (quack's has its own floors) a row is judged by its ratio to the floor measured with it
    return [(r["impl"], r["ms"], None, r["ratio_2pass"] if r["floor_passes"] == 2 else r["ratio_3pass"])
            for r in _at(_current(d["rows"]), "V", vocab) if r.get("ms")], {"V": vocab, **_dtype(d)}


def _linear_rows(d):
    return [(r["impl"], r["ms"], r.get("peak_extra_GiB"), r["ms"]) for r in d["rows"] if r.get("ms")], _dtype(d)


def _masks_rows(d):
    pct = max(r["ignored_pct"] for r in d["rows"])
    rows = [(r["impl"], r["ms"], None, r["ms"]) for r in _at(d["rows"], "ignored_pct", pct) if r.get("ms")]
    return rows, {"pct": pct, **_dtype(d)}


def _copy_rows(d):
    src, dst = d["rows"][0]["src"], d["rows"][0]["dst"]
    rows = [r for r in d["rows"] if (r["src"], r["dst"]) == (src, dst)]
    return [(r["impl"], r["TB/s"], None, r["TB/s"]) for r in rows], {"src": src, "dst": dst,
                                                                      "params": rows[0]["params"] / 1e9}


def _added_rows(d):
    return [(r["impl"], r["added_pct"], None, r["added_pct"]) for r in d["rows"] if r.get("added_pct") is not None], {}


def _e2e_rows(d):
    rows = [(r["arm"], r["ms"], r.get("peak_GiB"), r["ms"]) for r in d["rows"] if r.get("ms")]
    return rows, {"params": d["meta"]["params"] / 1e9, **_dtype(d)}


def _ours(impl):
    return impl.startswith(("hk.", "hk ", "ours_", "ReferenceSyncer"))


def _grpo_as_called(impl):
    """``hk.fused.grpo`` with no option beyond how it runs (the gradient in the forward, in place): the default
    loss, not another loss type or no clip."""
    name, _, options = impl.partition("(")
    return name == "hk.fused.grpo" and set(filter(None, options.rstrip(")").split(","))) <= {"grad_in_fwd",
                                                                                              "inplace"}


def _named(*names):
    return lambda impl: impl in names


def _prefixed(*prefixes):
    return lambda impl: impl.startswith(prefixes)


# Per measure: what it says (formatted with the call's meta and what its rows function adds), the section and file
# it reads, its rows, which rows are ours and which are the peers', and which way is better: "time" (lower),
# "bandwidth" (higher) or "added" (lower, a percentage of a step).
HEADLINE = (
    ("token log-probs from logits, fwd + bwd, N = {N}, V = {V}, {dtype}", "logits path", _logits_rows,
     _prefixed("hk.token_logprobs"),
     _prefixed("liger CE", "quack cross_entropy(none)", "torch.compile log_softmax", "eager fp32 log_softmax"), "time"),
    ("GRPO loss from logits, fwd + bwd, N = {N}, V = {V}, {dtype}", "logits path", _logits_rows,
     _grpo_as_called, _prefixed("liger triton_grpo_loss"), "time"),
    ("DPO loss from hidden states and the lm_head weight, fwd + bwd, N = {N}, D = {D}, V = {V}, {dtype}",
     "fused linear",
     _linear_rows, _named("ours_dpo"), lambda i: i.endswith("_dpo") and not _ours(i), "time"),
    ("KTO loss, the same", "fused linear", _linear_rows, _named("ours_kto"),
     lambda i: i.endswith("_kto") and not _ours(i), "time"),
    ("GRPO loss, the same", "fused linear", _linear_rows, _prefixed("ours_grpo"),
     lambda i: "grpo" in i and not _ours(i), "time"),
    ("DPO loss from hidden states, the first {pct} % of each row a prompt", "supervised tokens", _masks_rows,
     _prefixed("ours_dpo"), lambda i: i.endswith("_dpo") and not _ours(i), "time"),
    ("reference sync, {params:.2f} B parameters, {src} -> {dst}", ("reference sync", "sync_copy.json"), _copy_rows,
     _ours, lambda i: not _ours(i), "bandwidth"),
    ("the sync in an FSDP2 training step: time added to the step", ("reference sync", "sync_fsdp2.json"),
     _added_rows, _named("step + overlapped sync"), _named("step + state_dict way"), "added"),
    ("humanline DPO step end to end, a {params:.2f} B Llama, {dtype}", "end to end", _e2e_rows,
     _named("sync", "sync_ce", "sync_paced", "lookahead", "trl_sync", "trl_lookahead"), _named("authors"), "time"),
)


def _value(v, extra, better):
    if better == "bandwidth":
        return f"{v:.2f} TB/s"
    if better == "added":
        return f"{v:+.1f} %"
    return _ms(v) + ("" if extra is None else f", {extra:.2f} GiB peak")


def _lead(ours, peer, better):
    """Ours against the peer: how many times faster (or slower), the bandwidth, or how much less time added."""
    if better == "bandwidth":
        return f"{ours / peer:.2f}x the bandwidth"
    if better == "added":
        return f"{peer / ours:.0f}x less added" if ours > 0 else "none added"
    return f"{peer / ours:.2f}x faster" if ours <= peer else f"{ours / peer:.2f}x slower"


def headline(runs):
    """README's headline table: per measure, the best peer's row against our best in the same call, from the calls
    the Benchmarks section shows for ``runs``, with the card and the run. Where several calls hold both, the peer is
    the best of all of them (on the logits path by its ratio to the floor measured with it)."""
    calls = shown(runs)
    body = []
    for what, section, rows_of, is_ours, is_peer, better in HEADLINE:
        if isinstance(section, tuple):
            found = calls[section[0]].get(section[1])
            candidates = [found] if found else []
        else:
            candidates = calls[section]
        picked = []
        for run, d in candidates:
            rows, extra = rows_of(d)
            ours = [r for r in rows if is_ours(r[0])]
            peers = [r for r in rows if is_peer(r[0])]
            if ours and peers:
                sign = -1 if better == "bandwidth" else 1
                o, q = min(ours, key=lambda r: sign * r[3]), min(peers, key=lambda r: sign * r[3])
                picked.append((sign * q[3], run, d, extra, o, q))
        if not picked:
            continue
        _, run, d, extra, o, q = min(picked, key=lambda p: p[0])
        meta = {**{k: v for k, v in d.get("meta", {}).items() if not isinstance(v, (dict, list))}, **extra}
        body.append([what.format(**meta), d["env"]["device"], f"`{o[0]}` {_value(o[1], o[2], better)}",
                     f"`{q[0]}` {_value(q[1], q[2], better)}", _lead(o[1], q[1], better), f"`{run}`"])
    return _table(["measure", "card", "ours", "best peer", "ours against it", "run"], body)


def _wrap(text):
    """Prose paragraphs at README's width (tables and images as they are)."""
    import textwrap
    return "\n\n".join(par if par.startswith(("|", "![")) else
                         textwrap.fill(par, 116, break_long_words=False, break_on_hyphens=False)
                         for par in text.split("\n\n"))


def blocks(text):
    """A page's generated blocks: ``[(kind, argument string, content, match)]``."""
    return [(m.group(1), m.group(2).strip(), m.group(3), m) for m in BLOCK.finditer(text)]


# ------------------------------------------------------------------------------------------------------- demo
def _demo(name):
    if sys.path[:1] != [ROOT]:
        sys.path.insert(0, ROOT)  # the demo of this checkout, installed or not
    return importlib.import_module(f"humanline_kernels.demo.{name}")


def _default_runs(rec):
    return [e for e in rec["runs"] if not e["flags"] and not e["env"]]


def _demo_header(rec, record_path):
    """The default runs' command, machine (the CPU model among it), commit, settings and wall times."""
    main = _default_runs(rec)
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
    took = ", ".join(f"{e['objective'].upper()} {e['total_s']:.0f} s"
                     + (f" ({e['cpu_s']:.0f} s)" if "cpu_s" in e else "") for e in main)
    cpu = " (in parentheses the CPU time of all its processes)" if any("cpu_s" in e for e in main) else ""
    return (f"What the default run measured (`python -m humanline_kernels.demo --objective all --save "
            f"{record_path}`; {where}; {commit}{'' if same else ' (some rows elsewhere: see the record)'}; "
            f"{s['steps']} steps x {s['batch']} sequences, learning rates {lrs}, {s['seeds']} seeds; rule rate of "
            f"the policy's own samples on the reported prompts, mean +- s.e.; the starting policy is at "
            f"{first['start']:.3f}, the behaviour model that wrote the offline data at {first['behaviour']:.3f}; "
            f"wall time of each run, setup included{cpu}: {took}):")


def _rounded_otherwise(rec):
    """The record's default runs with ``ATEN_CPU_CAPABILITY`` alone set: ATen's other instruction sets on the same
    CPU, standing in for another CPU's rounding."""
    return [e for e in rec["runs"] if not e["flags"] and set(e["env"]) == {"ATEN_CPU_CAPABILITY"}]


def demo_agreement(rec):
    """How the default runs' table calls a comparison (:func:`humanline_kernels.demo.record.table` with
    ``across``): above or below only when the runs rounded otherwise say so too. Empty when the record has none."""
    alt = _rounded_otherwise(rec)
    main = [e for e in _default_runs(rec) if any(a["objective"] == e["objective"] for a in alt)]
    if not main:
        return ""
    caps = " and ".join(dict.fromkeys(a["machine"]["cpu_capability"] for a in alt))
    envs = ", ".join(dict.fromkeys(f"`ATEN_CPU_CAPABILITY={a['env']['ATEN_CPU_CAPABILITY']}`" for a in alt))
    only = ("" if len(main) == len(_default_runs(rec)) else
            f" (the record repeats {' and '.join(e['objective'].upper() for e in main)} only)")
    return (f"A comparison is called above or below only when the same default runs with ATen's {caps} kernels "
            f"({envs}, on the same CPU: stand-ins for another CPU's rounding) find it too, at "
            f"{_demo('stats').SIGNIFICANT:g} s.e. or more; otherwise it is not significant, and the cell gives each "
            f"run's number{only}.")


def demo_block(rec, record_path):
    """README's demo section between its markers: the default runs' header (the CPU model among it), their table,
    whether their conclusions hold under other rounding (:func:`demo_agreement`), and where the rest is."""
    main = _default_runs(rec)
    if not main:
        return f"`{record_path}` holds no default run: rerun `python -m humanline_kernels.demo --objective all --save`."
    agreement = demo_agreement(rec)
    rest = (agreement + " " if agreement else "") + (
        "Every run of the record, with flags or another environment, and the plots: "
        "[docs/benchmarks.md](docs/benchmarks.md).")
    return _wrap("\n\n".join([_demo_header(rec, record_path), _demo("record").table(main, _rounded_otherwise(rec)),
                               rest]))


def demo_runs(rec, record_path):
    """docs/benchmarks.md's demo section: the default runs' header and table, whether their conclusions hold under
    other rounding, every other run of the record, and the plots beside the record."""
    table = _demo("record").table
    main, other = _default_runs(rec), [e for e in rec["runs"] if e["flags"] or e["env"]]
    out = []
    if main:
        out += [_demo_header(rec, record_path), table(main, _rounded_otherwise(rec))]
        agreement = demo_agreement(rec)
        if agreement:
            out.append(agreement)
    if other:
        out += ["Other runs in the same record (the flags or environment shown, everything else the default):",
                table(other)]
    for objective in _demo("arms").OBJECTIVES:
        png = os.path.join(os.path.dirname(record_path), f"demo-{objective}.png")
        if os.path.exists(os.path.join(ROOT, png)):
            out.append(f"![{objective.upper()}: rule rate over training, each arm at its best learning rate]({png})")
    return _wrap("\n\n".join(out))


# ------------------------------------------------------------------------------------------------------ pages
def expected(kind, arg, page="README.md"):
    """What a block of ``kind`` with marker argument ``arg`` holds on ``page`` (links to the project's files made
    relative to the page)."""
    if kind == "benchmarks":
        text = render(arg.split())
    elif kind == "headline":
        text = headline(arg.split())
    else:
        with open(os.path.join(ROOT, arg), encoding="utf-8") as f:
            text = (demo_block if kind == "demo-table" else demo_runs)(json.load(f), arg)
    up = "../" * os.path.normpath(page).count(os.sep)  # a page in docs/ links one level up
    return re.sub(r"\]\((?=bench/|docs/)", f"]({up}", text) if up else text


def regenerate(text, runs=None, page="README.md"):
    """``text`` (the page ``page``) with every generated block rewritten; the benchmark blocks (``benchmarks``,
    ``headline``) from ``runs`` when given."""
    out, last = [], 0
    for kind, arg, _, m in blocks(text):
        if kind in ("benchmarks", "headline") and runs:
            arg = " ".join(runs)
        out += [text[last:m.start()], f"<!-- {kind}: {arg} -->\n{expected(kind, arg, page)}\n<!-- /{kind} -->"]
        last = m.end()
    return "".join(out) + text[last:]


def main(argv=None):
    p = Parser(prog="python -m bench report", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="*", metavar="RUN",
                   help="committed GPU runs, newest first (e.g. bench/results/2026-11-26-h200)")
    p.add_argument("--readme", nargs="?", const="", default=None, metavar="PATH",
                   help=f"rewrite the generated blocks of PATH in place (default: {' and '.join(PAGES)})")
    p.add_argument("--check", nargs="?", const="", default=None, metavar="PATH",
                   help=f"exit 1 with a diff when the generated blocks of PATH (default: {' and '.join(PAGES)}) "
                   "differ from what this script writes")
    a = p.parse_args(argv)
    for run in a.runs:
        if not os.path.isdir(os.path.join(ROOT, run)):
            p.error(f"no run folder {run!r} (give a path relative to the project's root, e.g. bench/results/...)")
    if a.readme is None and a.check is None:
        if not a.runs:
            p.error("give at least one run folder (or --readme / --check)")
        print(render(a.runs))
        return 0
    given = a.readme if a.readme is not None else a.check
    paths = [given] if given else [os.path.join(ROOT, page) for page in PAGES]
    texts = {}
    for path in paths:
        if not os.path.exists(path):
            p.error(f"no page at {path!r}")
        with open(path, encoding="utf-8") as f:
            texts[path] = f.read()
        if not blocks(texts[path]):
            p.error(f"{path} has no generated block (<!-- benchmarks|headline: RUN ... --> or "
                    "<!-- demo-table|demo-runs: PATH -->)")
    status = 0
    for path, text in texts.items():
        page = os.path.relpath(os.path.abspath(path), ROOT)
        new = regenerate(text, a.runs if a.readme is not None else None, page)
        if a.check is not None:
            if new != text:
                sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True), path,
                                                           "generated"))
                print(f"{path}: generated blocks differ (python -m bench report --readme rewrites them)",
                      file=sys.stderr)
                status = 1
            else:
                print(f"{path}: generated blocks match their sources")
            continue
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
        print(f"wrote {path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
