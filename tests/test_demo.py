"""The main job: the three-arm experiment runs end to end (reduced sizes) for every objective, tunes on the held-out
prompts only, reports what it measured, and its CLI answers bad flags with one line."""
import io
import json
import os
import re
import resource
import subprocess
import sys

import pytest
import torch

import humanline_kernels as hk
from humanline_kernels.demo import arms, canary, cli, experiment, record, stats, task

pytestmark = pytest.mark.slow  # the demo's training runs


def test_rule_checker():
    prompts = torch.tensor([[task.BOS, 4, 5, 6, 4 + task.K - 1, task.SEP]])
    want = task.rule_completion(prompts)
    assert want.tolist() == [[4, 5, 6, 7, 8]]  # wraps around after the last symbol
    good = torch.cat([want, torch.tensor([[task.EOS]])], 1)
    assert task.token_scores(prompts, good).min().item() == 1.0
    bad = good.clone()
    bad[0, 2] = 4
    assert task.token_scores(prompts, bad).sum().item() == 5.0


def test_prompt_splits_are_disjoint():
    gen = torch.Generator().manual_seed(0)
    seen = {s: {tuple(p) for p in task.sample_prompts(2000, gen, "cpu", s).tolist()} for s in task.SPLITS}
    for s, prompts in seen.items():
        firsts = {(p[1] - 4) % 4 for p in prompts}
        assert firsts == set(task.SPLITS[s]), s  # every class of the split is drawn, no other
    assert not seen["train"] & seen["heldout"] and not seen["train"] & seen["report"]
    assert not seen["heldout"] & seen["report"]


def test_label_groups_best_worst_and_ties():
    gen = torch.Generator().manual_seed(0)
    prompts = task.sample_prompts(2, gen, "cpu").repeat_interleave(arms.GROUP, 0)
    good = task.noisy_sequences(prompts, 1.0, gen)
    seqs = good.clone()
    seqs[1, task.PROMPT + 2] = 4 + (seqs[1, task.PROMPT + 2] - 4 + 1) % task.K  # prompt 0: row 1 one token off
    seqs[2, task.PROMPT + 2:task.PROMPT + 4] = 4 + (seqs[2, task.PROMPT + 2:task.PROMPT + 4] - 4 + 1) % task.K
    ex = arms.label_groups(prompts, seqs)  # prompt 1: four perfect samples, a tie
    assert ex["informative"].tolist() == [True, False]
    assert torch.equal(ex["chosen"][0], good[0]) and torch.equal(ex["rejected"][0], seqs[2])
    assert ex["adv"][:4].argmin() == 2 and torch.all(ex["adv"][4:] == 0)
    b = arms.dpo_batch(ex["chosen"], ex["rejected"], ex["informative"])
    assert torch.all(b["labels"][[1, 3]] == -100) and torch.any(b["labels"][[0, 2]] != -100)


@pytest.mark.parametrize("arm,calls", [("online", 6), ("offline", 2), ("offline+humanline", 2)])
def test_grpo_offline_arms_sample_less_often(arm, calls, monkeypatch):
    seen = []
    real = task.generate
    monkeypatch.setattr(task, "generate", lambda model, prompts, gen: seen.append(len(prompts)) or
                        real(model, prompts, gen))
    model = task.make_model(0, "cpu")
    src = arms.Source(arm, "grpo", None, 8, torch.Generator().manual_seed(0), "cpu", resample_every=3)
    rows = [src.next(step, model) for step in range(6)]
    assert len(seen) == calls and all(r["seqs"].shape[0] == 8 for r in rows)
    if arm != "online":  # one draw of three steps' examples, consumed in order
        assert seen == [24, 24] and not torch.equal(rows[0]["seqs"], rows[1]["seqs"])


@pytest.mark.parametrize("objective", arms.OBJECTIVES)
def test_humanline_arm_differs_from_offline_by_the_sync_and_the_clamp_only(objective, monkeypatch):
    """With a band that clamps nothing and no sync after the first step (which copies the starting policy onto
    itself), the offline+humanline arm is the offline arm bit for bit: the same data, reference, KL rows and
    learning rate (GRPO: drawn once, so the sampler is the starting policy, as the reference is). Syncing every
    step makes it differ: what separates the arms in the record is the sync and the clamp, nothing else."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the eager CPU path the demo runs
    gen = torch.Generator().manual_seed(0)
    start, behaviour = task.make_model(0, "cpu"), task.make_model(1, "cpu")
    pool = arms.offline_pool(behaviour, 32, gen, "cpu") if objective != "grpo" else None
    common = dict(start=start, pool=pool, lr=3e-3, seed=0, steps=4, batch=8, resample_every=4, device="cpu",
                  eval_every=2, eval_n=16, curve_n=16)
    off = arms.train_arm("offline", objective, clip=None, sync_every=1, **common)
    wide = hk.HumanlineClip(-100.0, 100.0)
    never = arms.train_arm("offline+humanline", objective, clip=wide, sync_every=1000, **common)
    assert never["syncs"] == 1 and never["clip_frac"] == 0.0
    assert never["losses"] == off["losses"] and never["curve"] == off["curve"]
    assert (never["heldout"], never["report"]) == (off["heldout"], off["report"])
    synced = arms.train_arm("offline+humanline", objective, clip=wide, sync_every=1, **common)
    assert synced["syncs"] == 4 and synced["losses"][0] == off["losses"][0] and synced["losses"] != off["losses"]


def _run(**kw):
    r = {"arm": "offline", "lr": 1e-3, "seed": 0, "heldout": 0.5, "report": 0.5, "clip_frac": None, "syncs": 0,
         "wall_s": 1.0, "sample_s": 0.0, "curve": [(0, 0.1), (2, 0.5)]}
    return {**r, **kw}


def test_tuning_picks_by_heldout_only():
    runs = [_run(arm=a, lr=lr, seed=s, heldout=0.1 + lr, report=0.9 - lr * 100)
            for a in arms.ARMS for lr in (1e-3, 3e-3) for s in range(3)]
    best = stats.select_best(runs)
    assert all(best[a]["lr"] == 3e-3 for a in arms.ARMS)
    assert best["online"]["rule_rate"] == pytest.approx(0.9 - 0.3)
    # change only the held-out scores: the pick follows, the reported numbers are those of the new pick
    for r in runs:
        if r["arm"] == "online":
            r["heldout"] = 0.9 - r["heldout"]
    best = stats.select_best(runs)
    assert best["online"]["lr"] == 1e-3 and best["offline"]["lr"] == 3e-3
    assert best["online"]["rule_rate"] == pytest.approx(0.9 - 0.1)


def test_verdict_follows_the_numbers():
    def best(hl, on, off, se=0.01, hl_wall=1.0, on_wall=2.5):
        def mk(a, v, w):
            return {"arm": a, "rule_rate": v, "se": se, "wall_s": w}
        return {"offline+humanline": mk("offline+humanline", hl, hl_wall), "online": mk("online", on, on_wall),
                "offline": mk("offline", off, hl_wall)}
    v = stats.verdict(best(0.50, 0.505, 0.2), "dpo")
    assert v.startswith("verdict:") and "not significantly different from online" in v and "2.5x faster" in v
    assert "above plain offline" in v and "= 21.2 s.e." in v
    v = stats.verdict(best(0.1, 0.5, 0.1, on_wall=0.5), "kto")
    assert "below online" in v and "2.0x slower" in v and "not significantly different from plain offline" in v


def test_two_standard_errors_make_a_difference_significant():
    """A comparison is above or below at 2 s.e. of the difference or more, else not significant, in the table and
    the verdict alike."""
    def arm(v, se=0.03):
        return {"rule_rate": v, "se": se}
    se_diff = 0.03 * 2 ** 0.5
    for gap, said, words in ((1.99, "not significant", "not significant (2.0 s.e. above)"),
                             (2.01, "above", "2.0 s.e. above"), (-2.5, "below", "2.5 s.e. below"),
                             (-0.4, "not significant", "not significant (0.4 s.e. below)")):
        a, b = arm(0.5 + gap * se_diff), arm(0.5)
        assert stats.conclusion(a, b) == said and stats.versus(a, b) == words, gap
    assert stats.conclusion(arm(0.5, 0.0), arm(0.5, 0.0)) == "not significant"
    assert stats.conclusion(arm(0.6, 0.0), arm(0.5, 0.0)) == "above"


@pytest.mark.parametrize("objective,workers", [("dpo", 1), ("kto", 2), ("grpo", 1)])
def test_demo_runs(monkeypatch, tmp_path, objective, workers):
    # the eager CPU path that users run (the kernels' interpreter runs are in the kernel tests; on CUDA the demo
    # runs in `python -m bench gpu`); KTO in the worker processes that the CLI uses on CPU
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    out = io.StringIO()
    png = tmp_path / "curve.png"
    lrs = (1e-3, 3e-3)
    children_s = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
    res = experiment.run(objective, steps=4, seeds=2, lrs=lrs, sft_steps=2, eval_n=16, batch=8, quiet=True,
                   out=out, sync_every=2, resample_every=2, plot_path=str(png), workers=workers)
    text = out.getvalue()
    for arm in arms.ARMS:
        assert f"\n{arm} " in text
    assert len(res["runs"]) == 3 * 2 * len(lrs) and f"with {workers} process(es)" in text
    # the CPU time of every process of the run, the workers' included (they end before it is read)
    workers_s = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - children_s
    assert (workers_s > 1.0) == (workers > 1) and res["info"]["cpu_s"] > workers_s
    assert text.count("verdict:") == 1 and res["verdict"] in text and f"plot: {png}" in text
    assert png.exists() and png.stat().st_size > 0
    best = res["best"]
    assert best["offline"]["clip_frac"] is None and best["online"]["clip_frac"] is None
    assert 0.0 <= best["offline+humanline"]["clip_frac"] <= 1.0
    assert best["offline+humanline"]["syncs"] == 2 and best["offline"]["syncs"] == 0
    assert best["online"]["sample_s"] > 0
    for r in res["runs"]:
        assert 0.0 <= r["report"] <= 1.0 and 0.0 <= r["heldout"] <= 1.0 and r["curve"][-1][0] == 4


def test_demo_cli(tmp_path):
    cmd = [sys.executable, "-m", "humanline_kernels.demo", "--steps", "2", "--sft-steps", "1", "--batch", "8",
           "--seeds", "2", "--lrs", "1e-3", "--eval-n", "16", "--objective", "dpo", "--quiet", "--no-plot",
           "--workers", "1"]
    root = canary.ROOT  # found from tmp_path, installed or not
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    p = subprocess.run([*cmd, "--markdown"], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "offline+humanline" in p.stdout and "verdict:" in p.stdout and "plot:" not in p.stdout
    assert not list(tmp_path.iterdir())  # --no-plot writes nothing
    # --markdown: README's table format (README's own table: its header, and a row of the same cells, here with the
    # run's flags in a run column, since they are not the defaults)
    table = [ln for ln in p.stdout.splitlines() if ln.startswith("|")]
    head = "| " + " | ".join(record.HEADER) + " |"
    assert table[0] == head.replace("| objective |", "| objective | run |") and table[1] == "|" + "---|" * 7
    row = table[2].split(" | ")
    assert row[0] == "| DPO" and row[1].startswith("`--steps 2 --seeds 2 --lrs 0.001 --batch 8 --sft-steps 1")
    assert all(re.fullmatch(r"\d\.\d{3} \+- \d\.\d{3}", c) for c in row[2:5]), row
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        assert "\n" + head + "\n|" + "---|" * 6 + "\n| DPO | " in f.read()


@pytest.mark.parametrize("flags", [["--steps", "0"], ["--device", "gpu"], ["--device", "cuda"],
                                   ["--log-eps-p", "2", "--log-eps-r", "1"], ["--log-eps-p", "0.5", "--log-eps-r", "1"],
                                   ["--log-eps-r", "inf"], ["--log-eps-p", "nan"], ["--sync-every", "0"],
                                   ["--lrs", "-1"],
                                   ["--lrs", "nan"], ["--lrs", "1e-3,0"], ["--lrs", ","], ["--batch", "3"],
                                   ["--batch", "x"], ["--seeds", "1"], ["--resample-every", "0"],
                                   ["--objective", "grpo", "--batch", "6"], ["--plot", "a{b}.png"],
                                   ["--eval-n", "4"], ["--seed", "-1"], ["--objective", "all", "--batch", "6"],
                                   ["--objective", "all", "--batch", "5"], ["--save", "."], ["--markdown", "x"]])
def test_bad_flags_are_one_line_errors(flags, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # "--device cuda" without CUDA
    monkeypatch.setattr(experiment, "run", lambda *a, **k: pytest.fail("ran with a bad flag"))
    with pytest.raises(SystemExit) as e:
        cli.main(flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err and "usage:" not in err
    assert len(err.strip().splitlines()) == 1 and "error:" in err, err  # README: "A bad flag is a one-line error"
    assert err.rstrip().endswith("(python -m humanline_kernels.demo --help)"), err


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "(default: 60)" in out and "(default: dpo)" in out and "(default: 8)" in out


def test_save_merges_runs_by_objective_flags_and_environment(tmp_path, monkeypatch):
    """``--save``: a rerun of the same objective, flags and environment replaces its entry, others are kept;
    the default runs come first, in objective order; the canary is taken (stubbed here: tests/test_readme.py runs
    the real one against README's record)."""
    monkeypatch.setattr(canary, "run_subprocess", lambda: {"dpo": {}})
    measured = {arm: {"rule_rate": 0.5, "se": 0.1, "heldout": 0.5, "clip_frac": None, "syncs": 0, "wall_s": 1.0,
                      "sample_s": 0.0, "lr": 1e-3} for arm in arms.ARMS}

    def entry(objective, flags=(), env=None, rate=0.5):
        return {"objective": objective, "flags": list(flags), "env": env or {}, "settings": {"resample_every": 10},
                "machine": {"cpu_capability": "AVX2"},
                "arms": {**measured, "online": {**measured["online"], "rule_rate": rate}}}
    path = str(tmp_path / "r" / "demo.json")
    record.save(path, [entry("kto"), entry("dpo", ["--steps", "2"])])
    record.save(path, [entry("dpo"), entry("kto", rate=0.9), entry("dpo", env={"ATEN_CPU_CAPABILITY": "avx2"})])
    with open(path, encoding="utf-8") as f:
        rec = json.load(f)
    assert [(e["objective"], e["flags"], e["env"]) for e in rec["runs"]] == [
        ("dpo", [], {}), ("kto", [], {}), ("dpo", ["--steps", "2"], {}), ("dpo", [], {"ATEN_CPU_CAPABILITY": "avx2"})]
    assert rec["runs"][1]["arms"]["online"]["rule_rate"] == 0.9 and rec["canary"] == {"dpo": {}}
    assert rec["canary_cpu"] == canary.cpu_key() and "canary_other_cpus" not in rec
    table = record.table(rec["runs"][2:])
    assert "| DPO | `--steps 2` (AVX2) |" in table and "| DPO | `ATEN_CPU_CAPABILITY=avx2` (AVX2) |" in table
    assert "not significant (equal), 1.0x faster" in record.table(rec["runs"][:1])


def _canary(loss=0.5, heldout=0.25):
    return {"dpo": {"offline lr 0.003 seed 0": {"losses": [0.75, loss], "heldout": heldout, "report": 0.5,
                                                 "clip_frac": None}},
            "grpo": {"online lr 0.003 seed 0": {"losses": [1e-8, 0.125], "heldout": 0.0, "report": 0.0,
                                                "clip_frac": 0.5}}}


def test_canary_is_exact_on_a_recorded_cpu_and_round_off_close_elsewhere():
    """The bits recorded for a CPU must repeat there; a CPU with none is held to the record's canary within
    CANARY_RTOL (losses), and every other value (rule rates, the runs themselves) must still be equal."""
    ulp = _canary(loss=0.5 * (1 + 1e-7))
    rec = {"canary_cpu": "A", "canary": _canary(), "canary_other_cpus": {"B": ulp}}
    assert canary.check(rec, _canary(), "Z")[0] == "same"
    assert canary.check(rec, ulp, "A")[0] == "same"  # the bits of a recorded computation, wherever
    off = _canary(loss=0.5 * (1 - 1e-7))
    assert canary.check(rec, off, "A")[0] == "differ" and canary.check(rec, off, "B")[0] == "differ"
    verdict, msg = canary.check(rec, off, "Z")
    assert verdict == "close" and "(Z)" in msg
    far = _canary(loss=0.5 * (1 + 3 * canary.RTOL))
    verdict, msg = canary.check(rec, far, "Z")
    assert verdict == "differ" and "1 canary runs" in msg and "dpo offline lr 0.003 seed 0" in msg
    assert canary.check(rec, _canary(heldout=0.3125), "Z")[0] == "differ"
    short = _canary()
    short["grpo"]["online lr 0.003 seed 0"]["losses"].pop()
    fewer = {"dpo": _canary()["dpo"]}
    more = {**_canary(), "kto": {"online lr 0.003 seed 0": {"losses": []}}}
    no_rate = _canary()
    no_rate["grpo"]["online lr 0.003 seed 0"]["clip_frac"] = None
    for bad in (short, fewer, more, no_rate):
        assert canary.check(rec, bad, "Z")[0] == "differ"
    # near zero, round-off is absolute: 1e-8 against 1e-8 + 1e-14 is close, + 1e-12 is not
    tiny = _canary()
    tiny["grpo"]["online lr 0.003 seed 0"]["losses"][0] = 1e-8 + 1e-14
    assert canary.check(rec, tiny, "Z")[0] == "close"
    tiny["grpo"]["online lr 0.003 seed 0"]["losses"][0] = 1e-8 + 1e-12
    assert canary.check(rec, tiny, "Z")[0] == "differ"


def test_cpu_key_names_the_cpu():
    key = canary.cpu_key()
    assert isinstance(key, str) and key.strip()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            linux = "vendor_id" in f.read()
    except OSError:
        linux = False
    if linux:
        assert re.fullmatch(r"\S+ family \d+ model \d+", key), key


def test_add_canary_keeps_another_cpus_bits_only_within_round_off(tmp_path, monkeypatch, capsys):
    """``--add-canary PATH``: this CPU's canary bits join the record when they are the record's computation
    rounded otherwise (and repeat); otherwise a one-line error, and the record is left as it was."""
    path = tmp_path / "demo.json"
    rec = {"canary_cpu": "A", "canary": _canary(), "runs": []}
    path.write_text(json.dumps(rec))
    monkeypatch.setattr(canary, "cpu_key", lambda: "B")
    outs = []
    monkeypatch.setattr(canary, "run_subprocess", lambda: outs.pop(0))

    def add(*given, args=("--add-canary", str(path), "--quiet")):
        outs[:] = list(given)
        return cli.main(list(args))
    for given in ([_canary(loss=0.6)] * 2, [_canary(loss=0.5 + 1e-7), _canary(loss=0.5 + 2e-7)]):
        with pytest.raises(SystemExit) as e:
            add(*given)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and "demo: error: --add-canary: " in err[-1]
        assert json.loads(path.read_text()) == rec
    close = _canary(loss=0.5 + 1e-7)
    assert add(close, close) == 0 and "kept its bits" in capsys.readouterr().out
    kept = json.loads(path.read_text())
    assert kept == {**rec, "canary_other_cpus": {"B": close}}
    assert canary.check(kept, close, "B")[0] == "same"
    assert canary.check(kept, _canary(loss=0.5 + 2e-7), "B")[0] == "differ"
    for args, words in (([str(path), "--save", str(tmp_path / "x.json")], "drop --save"),
                        ([str(tmp_path / "none.json")], "no record at")):
        with pytest.raises(SystemExit):
            add(args=["--add-canary", *args])
        assert words in capsys.readouterr().err
