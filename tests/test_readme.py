"""The generated pages' numbers are generated, never kept by hand: README's demo table and docs/benchmarks.md's
demo section from the demo's committed record, docs/benchmarks.md's tables and README's headline table from the
committed GPU runs their markers name (``python -m bench report --readme`` writes them all). The record is the
default run's, and it still describes the code: its canary, a tiny run of every objective under pinned rounding, is
repeated here and must give the bits recorded for this CPU (or, on a CPU the record has none for, the record's
within round-off)."""
import json
import os
import warnings

import pytest

from bench import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REGENERATE = "python -m bench report --readme"
DOCS = "docs/benchmarks.md"


def _page(page="README.md"):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def _block(kind, page="README.md"):
    found = [(arg, content) for k, arg, content, _ in report.blocks(_page(page)) if k == kind]
    assert len(found) == 1, f"{page} must hold one <!-- {kind}: ... --> block, found {len(found)}"
    return found[0]


def _record():
    path, _ = _block("demo-table")
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return json.load(f)


def test_the_test_command_leaves_out_the_slow_tests_and_ci_runs_them():
    """README's command is the suite less the tests marked slow; .ci/run runs it verbatim, then the slow tests but the
    compile gate, then the compile gate on both version pairs: every test, as before the command was cut."""
    command = _page().split("<!-- test-command -->")[1].split("<!-- /test-command -->")[0]
    assert command.rstrip("`\n ").endswith('-m "not slow"'), command
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read()
    assert "<!-- test-command -->" in ci and 'eval "$cmd"' in ci
    assert "-m slow \\\n    --ignore tests/ops/test_compile_gate.py" in ci
    gate = "-m pytest -q -p no:cacheprovider tests/ops/test_compile_gate.py"
    assert ci.count(f"python {gate}") == 1 and ci.count(f'"$venv/bin/python" {gate}') == 1


def test_pages_hold_their_blocks():
    """README holds the demo's default runs and the headline table; docs/benchmarks.md every run of the same record
    and every table, from the same GPU runs as README's headline."""
    assert {k for k, *_ in report.blocks(_page())} == {"demo-table", "headline"}
    assert {k for k, *_ in report.blocks(_page(DOCS))} == {"demo-runs", "benchmarks"}
    assert _block("demo-table")[0] == _block("demo-runs", DOCS)[0]
    assert _block("headline")[0] == _block("benchmarks", DOCS)[0]


def test_benchmarks_page_is_the_reports_output_for_the_runs_it_names():
    runs, content = _block("benchmarks", DOCS)
    assert runs.split(), "the benchmarks marker names no run"
    for run in runs.split():
        assert os.path.isdir(os.path.join(ROOT, run)), f"{DOCS}'s benchmarks marker names {run}, which is not here"
    assert content == report.expected("benchmarks", runs, DOCS) + "\n", (
        f"{DOCS}'s tables are not what `python -m bench report {runs}` writes: run `{REGENERATE}`")
    assert "](../bench/results/" in content and "](bench/" not in content  # links from docs/


def test_headline_is_the_reports_output_for_the_runs_it_names():
    runs, content = _block("headline")
    assert content == report.headline(runs.split()) + "\n", f"README's headline table is stale: run `{REGENERATE}`"


def test_headline_takes_the_best_peer_of_the_calls_shown():
    """Per measure, the best peer of every call the tables show (quack's own call on the logits path, judged by its
    ratio to the floor measured with it), against our best in the same call; retired paths are no one's row."""
    runs = _block("headline")[0].split()
    rows = {r.split(" | ")[0].lstrip("| "): r for r in report.headline(runs).splitlines()[2:]}
    logprobs = next(r for m, r in rows.items() if m.startswith("token log-probs from logits"))
    assert "`quack cross_entropy(none)`" in logprobs and "`hk.token_logprobs`" in logprobs
    assert "2026-11-28-h200-run9`" in logprobs  # quack ran in run 9's call of its own, ours beside it
    grpo = next(r for m, r in rows.items() if m.startswith("GRPO loss from logits"))
    assert "| `hk.fused.grpo` " in grpo and "`liger triton_grpo_loss`" in grpo
    tables = [line for line in (report.render(runs) + report.headline(runs)).splitlines() if line.startswith("|")]
    assert not [line for line in tables if "[previous]" in line]
    assert "hk.fused[previous]" in _page("bench/results/2026-11-28-h200-run11/logits.json")  # kept in the JSON


def test_report_adds_quack_and_the_arms_the_newest_e2e_lacks():
    """Run 9 (H200) ran quack in a call of its own (``quack/logits.json``) and no TRL arm: its logits section holds
    quack's table beside the main one, vocabularies in ascending order, and its e2e section is followed by run 6's
    (H100), which has the TRL arms; run 6 alone shows one e2e table and no quack table."""
    nine, six = "bench/results/2026-11-28-h200-run9", "bench/results/2026-11-27-h100-run6"
    both = report.render([nine, six])
    assert "`quack cross_entropy_fwd(return_dx)`" in both and f"`{nine}/quack`" in both
    head = next(line for line in both.splitlines() if line.startswith("| impl | V = 32000"))
    assert head.index("128256") < head.index("151936")
    assert both.count("**End to end**") == 2 and "`trl_dpo`" in both and "`sync_paced`" in both
    assert both.index(f"`{nine}`): one DPO") < both.index(f"`{six}`): one DPO")
    alone = report.render([six])
    assert alone.count("**End to end**") == 1 and "quack beside" not in alone


def test_report_keeps_an_earlier_quack_table_and_shows_what_a_newer_run_measured():
    """Run 11 (H200) ran no quack call: its logits section keeps run 9's quack table, labelled with run 9's folder
    as an earlier run; its supervised-tokens prose names the two ignored fractions it measured (0 and 50 %, not
    75 %); its sync rows were timed interleaved, so each shows its spread, which run 10's sequential rows lack."""
    eleven, ten, nine = ("bench/results/2026-11-28-h200-run11", "bench/results/2026-11-28-h200-run10",
                         "bench/results/2026-11-28-h200-run9")
    text = report.render([eleven, nine])
    assert f"`{eleven}`): N = 8192 tokens" in text and f"`{nine}/quack`" in text
    assert "measured in an earlier run" in text
    assert text.index("quack beside") < text.index(f"]({eleven}/logits.png)")
    assert "the first 0 / 50 % of every row ignored" in report._wrap(text).replace("\n", " ")
    assert "| what | time | added to the step | spread |" in text
    assert "| what | time | added to the step |\n" in report.render([ten])
    assert "measured in a second call on the same machine" in report.render([nine])
    # bench linear's rows timed in rounds (run 12 on): the spread after the ratio, the rounds in the prose
    with open(os.path.join(ROOT, eleven, "linear.json"), encoding="utf-8") as f:
        d = json.load(f)
    assert "| impl | time | x GEMM floor | peak extra GiB | note |" in report._linear(d, eleven)
    for r in d["rows"]:
        r["spread_pct"] = 1.0 if r["ms"] else None
    d["meta"]["timing"] = {"rounds": 5, "calls_a_round": 3}
    text = report._linear(d, eleven)
    assert "| impl | time | x GEMM floor | spread | peak extra GiB | note |" in text
    assert "| `ours_dpo` | 37.6 ms | 1.03x | 1.0 % | 0.51 |  |" in text and "in 5 rounds of 3 calls" in text


def test_demo_table_is_written_from_its_record():
    path, content = _block("demo-table")
    assert content == report.demo_block(_record(), path) + "\n", (
        f"README's demo table is not what {path} says: run `{REGENERATE}`")
    assert _block("demo-runs", DOCS)[1] == report.expected("demo-runs", path, DOCS) + "\n", (
        f"{DOCS}'s demo section is not what {path} says: run `{REGENERATE}`")


def test_demo_record_is_the_default_run_of_every_objective():
    """The table's rows are the default run: every setting as `python -m humanline_kernels.demo` has it now, on
    the CPU (a changed default makes the record stale: rerun the demo)."""
    from humanline_kernels.demo import arms, cli
    defaults = cli.parser().parse_args([])
    main = [e for e in _record()["runs"] if not e["flags"] and not e["env"]]
    assert [e["objective"] for e in main] == list(arms.OBJECTIVES)
    for e in main:
        s = e["settings"]
        want = {k: getattr(defaults, k) for k in ("steps", "seeds", "seed", "batch", "resample_every", "sft_steps",
                                                  "eval_n")}
        want.update(lrs=list(defaults.lrs), clip=[defaults.log_eps_p, defaults.log_eps_r],
                    sync_every=12 if e["objective"] == "grpo" else 1)
        assert {k: s[k] for k in want} == want, (e["objective"], "rerun: python -m humanline_kernels.demo "
                                                                  "--objective all --save " + _block("demo-table")[0])
        assert e["machine"]["device"] == "cpu" and e["commit"] and not e["dirty"]


@pytest.mark.slow
def test_demo_record_still_describes_the_code():
    """The canary recorded with the table, run again: any change to what the demo computes (data, training, the
    package's losses or syncer, evaluation) or to torch's numerics changes the bits recorded for this CPU, or, on
    a CPU the record has no bits for, moves a loss beyond round-off, and the table no longer says what the code
    does."""
    import platform

    import torch

    from humanline_kernels.demo import canary
    record = _record()
    measured = {e["machine"]["torch"] for e in record["runs"]}
    if torch.__version__ not in measured or platform.machine() not in ("x86_64", "AMD64"):
        # the canary's bits are this torch's and x86 MKL's numerics (CI runs README's torch, the record's); the GPU
        # image's older torch rounds otherwise and says nothing about the record
        pytest.skip(f"the record was measured with torch {', '.join(sorted(measured))} on x86; this is torch "
                    f"{torch.__version__} on {platform.machine()}")
    assert record["canary_env"] == canary.ENV
    assert record["canary_settings"] == {**canary.SETTINGS, "lrs": list(canary.SETTINGS["lrs"])}
    verdict, msg = canary.check(record, canary.run_subprocess(), canary.cpu_key())
    path = _block("demo-table")[0]
    if verdict == "differ":
        pytest.fail(f"the demo no longer computes what its record measured: {msg}. Rerun `python -m "
                    f"humanline_kernels.demo --objective all --save {path}` (and the other runs of the record, with "
                    f"their flags), then `{REGENERATE}`")
    if verdict == "close":
        # the same code, rounded by a CPU the record has no bits for: checked to round-off only, so say so
        warnings.warn(f"{msg}; `python -m humanline_kernels.demo --add-canary {path}` keeps its bits for exact "
                      "checks on this CPU", stacklevel=1)


def test_demo_header_names_the_cpu_model_when_the_record_has_it():
    """README's header line says which CPU model measured the table when the record's runs carry it (runs saved
    since the canary became per CPU model); older records read as before."""
    path = os.path.join("bench", "results", "2026-11-27-cpu-demo", "demo.json")
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        record = json.load(f)
    assert "family" not in report.demo_block(record, path)
    for e in record["runs"]:
        e["machine"]["cpu"] = "GenuineIntel family 6 model 106"
    after = report.demo_block(record, path)
    assert "CPU AVX512 (GenuineIntel family 6 model 106), 2 cores" in after.replace("\n", " ")


def test_demo_calls_a_comparison_only_when_other_rounding_agrees():
    """The record's runs with ATEN_CPU_CAPABILITY alone set are the default runs rounded otherwise: the demo's table
    calls a comparison above or below only when they say so too (at 2 s.e.), else not significant with each run's
    number, and the section says so; a record without such runs says nothing and calls each run alone."""
    def arms(hl, on=0.5, off=0.1, se=0.01):
        return {a: {"rule_rate": v, "se": se, "wall_s": 1.0} for a, v in (("offline", off), ("offline+humanline", hl),
                                                                           ("online", on))}

    def run(objective, measured, capability, env=None):
        return {"objective": objective, "flags": [], "env": env or {}, "arms": measured, "settings": {},
                "machine": {"cpu_capability": capability, "device": "cpu", "cores": 2, "processes": 2,
                            "torch": "2.13.0", "transformers": "5.24.0"},
                "commit": "abc", "dirty": False, "start": 0.07, "behaviour": 0.3, "total_s": 60.0}
    rec = {"runs": [run("dpo", arms(0.3), "AVX512"), run("kto", arms(0.3), "AVX512"),
                    run("dpo", arms(0.29), "AVX2", {"ATEN_CPU_CAPABILITY": "avx2"}),
                    run("dpo", arms(0.12), "DEFAULT", {"ATEN_CPU_CAPABILITY": "default"})]}
    for e in rec["runs"]:
        e["settings"] = {"steps": 60, "batch": 16, "lrs": [1e-3], "seeds": 8}
    said = report.demo_agreement(rec)
    assert "ATen's AVX2 and DEFAULT kernels" in said and "`ATEN_CPU_CAPABILITY=default`" in said
    assert "(the record repeats DPO only)" in said
    rows = report.demo_block(rec, "x/demo.json").split("\n")
    dpo = next(r for r in rows if r.startswith("| DPO |"))
    kto = next(r for r in rows if r.startswith("| KTO |"))
    # DEFAULT's humanline is 1.4 s.e. above offline: not significant there, so not called above
    assert dpo.endswith("| not significant: AVX512 14.1 s.e. above, AVX2 13.4 s.e. above, DEFAULT 1.4 s.e. above |")
    assert "| 14.1 s.e. below, 1.0x faster |" in dpo  # below online in every run
    assert kto.endswith("| 14.1 s.e. above |")  # no other rounding of KTO: its own run's call
    assert report.demo_agreement({"runs": rec["runs"][:2]}) == ""


def test_readme_is_short():
    """README: what it is, the two set-up commands, the API tour, the trainers, the headline table and links; the
    full tables are docs/benchmarks.md's."""
    assert len(_page().splitlines()) <= 250
    for marker in ("<!-- demo-command -->", "<!-- test-command -->"):
        assert _page().count(marker) == 1, marker
