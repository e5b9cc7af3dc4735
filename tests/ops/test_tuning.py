"""The tuning table (humanline_kernels/ops/tuning.py; issue 53, target 4): what an entry applies to, that the launchers
read it per family, that a forced configuration computes the reference's numbers, that the committed table is valid
and compiled by the gate, and ``python -m bench tune``'s flags and CPU run."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import humanline_kernels as hk
from humanline_kernels import reference as R
from humanline_kernels.ops import common, dpo, grpo, kto, logprobs, sequence, token_terms, tuning

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CARD = "Test card"
TABLE = {"format": 1, "devices": {CARD: {"bf16": {
    "fwd": {"32000": [2048, 4], "128256": [8192, 8]},
    "terms": {"128256": [2048, 8]},
    "bwd": {"128256": [8192, 16], "151936": [3000, 4]},  # a block that is not a power of 2: ignored
    "gif": {"128256": [4096, 16], "32000": [4096, 3]},  # 3 warps: ignored
    "nope": {"128256": [4096, 4]},  # not a family
}}}}


@pytest.fixture
def table():
    tuning.set_table(json.loads(json.dumps(TABLE)))
    yield
    tuning.set_table(None)


def test_lookup_nearest_size_within_a_factor_of_two(table):
    assert tuning.lookup("fwd", CARD, "bf16", 32000) == (2048, 4)
    assert tuning.lookup("fwd", CARD, "bf16", 50000) == (2048, 4)  # nearer 32000 than 128256 in ratio
    assert tuning.lookup("fwd", CARD, "bf16", 100000) == (8192, 8)
    assert tuning.lookup("fwd", CARD, "bf16", 15000) is None  # more than a factor of 2 from every entry
    assert tuning.lookup("fwd", CARD, "bf16", 300000) is None
    assert tuning.lookup("terms", CARD, "bf16", 151936) == (2048, 8)


@pytest.mark.parametrize("args", [("fwd", "Other card", "bf16", 32000), ("fwd", CARD, "fp32", 32000),
                                  ("fwd", None, "bf16", 32000), ("bwd", CARD, "bf16", 151936),
                                  ("gif", CARD, "bf16", 32000), ("nope", CARD, "bf16", 128256)])
def test_lookup_misses_and_malformed_entries_give_the_defaults(table, args):
    assert tuning.lookup(*args) is None


@pytest.mark.parametrize("broken", [None, [], {"devices": []}, {"devices": ["x"]}, {"devices": {CARD: ["bf16"]}},
                                    {"devices": {CARD: {"bf16": {"fwd": []}}}},
                                    {"devices": {CARD: {"bf16": {"fwd": {"x": [2048, 4]}}}}},
                                    {"devices": {CARD: {"bf16": {"fwd": {"32000": "2048x4"}}}}}])
def test_a_broken_table_is_no_table(broken):
    tuning.set_table(broken if broken is not None else {})
    try:
        assert tuning.lookup("fwd", CARD, "bf16", 32000) is None
        assert tuning.entries(broken if isinstance(broken, dict) else {}) == []
    finally:
        tuning.set_table(None)


def test_launchers_configurations_read_the_table_by_family(table):
    bf16 = torch.bfloat16
    assert common._sweep_config(128256, True, True, CARD, bf16, "fwd") == (8192, 8)
    assert common._sweep_config(128256, True, True, CARD, bf16, "terms") == (2048, 8)
    assert common._block_config(128256, 2, True, CARD, bf16) == (8192, 16)
    assert grpo._gif_config(128256, 2, True, 90, CARD, bf16, 32, 16) == (4096, 16)
    # an entry is clamped to the row: V = 40000 under the 32000 entry keeps 2048; a tiny row gets its own width
    assert common._sweep_config(40000, True, True, CARD, bf16, "fwd") == (2048, 4)
    # another card, dtype or an unaligned row (card None): the defaults
    for args in ((128256, True, True, "Other", bf16, "fwd"), (128256, True, True, CARD, torch.float32, "fwd"),
                 (128256, True, False, None, bf16, "fwd")):
        assert common._sweep_config(*args) == common._sweep_config.__wrapped__(*args[:3], None, args[4], args[5])
    tuning.set_table(None)  # the caches are cleared with the table
    assert common._sweep_config(128256, True, True, CARD, bf16, "fwd") == (4096, 4)


def _captured(monkeypatch):
    """BLOCK_V and num_warps of every interpreted launch, by kernel name."""
    from humanline_kernels.ops import _jit
    seen = []

    def launcher(kernel, x):
        twin = _jit.launcher(kernel, x)

        class Grid:
            def __getitem__(self, grid):
                def run(**kwargs):
                    seen.append((kernel.fn.__name__, kwargs.get("BLOCK_V"), kwargs.get("num_warps")))
                    return twin[grid](**kwargs)
                return run
        return Grid()
    for mod in (logprobs, token_terms, dpo, kto, grpo, sequence):
        monkeypatch.setattr(mod, "launcher", launcher)
    return seen


def _data(B=2, T=5, V=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, V, generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    y[0, :2] = -100
    ref = torch.randn(B, T, generator=g) - 4
    return x, y, ref


@pytest.mark.parametrize("family", tuning.FAMILIES)
def test_a_forced_configuration_reaches_its_kernels_and_computes_the_reference(family, monkeypatch):
    """Each family's kernels launch with the forced block (64 elements, 2 warps here: not a default) and give the
    reference's values and gradients; the other families keep their own."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if family == "terms":  # the token-terms kernel: the row kernel of a forward that is not one launch
        monkeypatch.setattr(hk.fused, "_one_launch", lambda tokens, labels: False)
    seen = _captured(monkeypatch)
    x, y, ref = _data()
    adv = torch.tensor([0.5, -1.0])
    with tuning.forced(family, 64, 2):
        leaf = x.clone().requires_grad_()
        if family in ("fwd", "bwd"):
            go = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
            got = hk.token_logprobs(leaf, y)
            want_leaf = x.clone().requires_grad_()
            want = R.token_logprobs(want_leaf, y)
        else:
            go = None
            got = hk.fused.grpo(leaf, y, ref, adv, beta=0.04, grad_in_forward=family == "gif")[0]
            want_leaf = x.clone().requires_grad_()
            want = R.grpo(R.token_logprobs(want_leaf, y), ref, adv, y != -100, beta=0.04)[0]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        g, = torch.autograd.grad(got, leaf, go)
        gw, = torch.autograd.grad(want, want_leaf, go)
        torch.testing.assert_close(g, gw, atol=1e-5, rtol=1e-5)
    kernels = {"fwd": "_logprobs_fwd_kernel", "terms": "_token_terms_kernel", "bwd": "_logprobs_bwd_kernel",
               "gif": "_grpo_loss_kernel"}
    ours = [(b, w) for k, b, w in seen if k == kernels[family]]
    assert ours and all(c == (64, 2) for c in ours), seen
    others = [(k, b, w) for k, b, w in seen if k != kernels[family] and b is not None]
    assert all((b, w) != (64, 2) for _, b, w in others), seen


def test_the_committed_table_is_valid():
    """humanline_kernels/ops/tuned.json (written by bench tune, shipped with the package): JSON with a format, every
    entry a launch the kernels accept under a known family and dtype."""
    tuning.set_table(None)
    t = tuning.table()
    assert t.get("format") == 1 and isinstance(t.get("devices"), dict)
    raw = [(card, dn, fam, v, e) for card, per in t["devices"].items() for dn, fams in per.items()
           for fam, vs in fams.items() for v, e in vs.items()]
    assert all(dn in tuning.DTYPES.values() and fam in tuning.FAMILIES and int(v) > 1 and tuning._valid(e)
               for _, dn, fam, v, e in raw), raw
    assert len({(f, d, *tuning._valid(e)) for _, d, f, _, e in raw}) == len(tuning.entries())


def test_the_compile_gate_compiles_every_table_entry(table):
    saved = {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "TRITON_DUMP_PTXAS_LOG")}
    try:
        # (it sets both for its own process at import: put back for the tests after this one)
        from tools import compile_gate
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    names = [name for name, _, _ in compile_gate._cases() if name.startswith("tuned ")]
    for family, dn, block, warps in tuning.entries():
        assert any(n.startswith(f"tuned {family} {dn} BLOCK_V={block} warps={warps} #") for n in names), family
    assert len(tuning.entries()) == 5 and len(names) == 2 * 2 + 5 + 4 + 3  # fwd (two entries), terms, bwd, gif


def _tune(*args):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "bench", "tune", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("args", [(), ("--quick", "--family", "nope"), ("--quick", "--n", "0"),
                                  ("--quick", "--vocab", "1"), ("--quick", "--write"), ("--bogus",),
                                  ("--from-logits", "no/such/logits.json"),
                                  ("--from-logits", "pyproject.toml"),
                                  ("--from-logits", "bench/results/2026-11-28-h200-run11/logits.json", "--quick"),
                                  ("--quick", "--arm", "hk.fused")])
def test_bench_tune_bad_flags_are_one_line(args):
    r = _tune(*args)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "python -m bench tune --help" in r.stderr


@pytest.mark.slow
def test_bench_tune_quick_times_every_candidate(tmp_path):
    r = _tune("--quick", "--family", "fwd", "gif", "grad_in_forward", "--vocab", "60", "--n", "4", "--out",
              str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.load(open(tmp_path / "tune_quick.json"))["rows"]
    assert {(row["family"], row["candidate"]) for row in rows} == {
        (f, f"{b}x{w}") for f in ("fwd", "gif") for b, w in tuning.CANDIDATES[f]} | {
        ("grad_in_forward", p) for p in tuning.PATHS}  # (no cluster candidates off sm_90)
    assert all("ms" in row for row in rows)
    assert sum(row["chosen"] for row in rows if row["family"] == "grad_in_forward") == 1
    tuning.set_table(None)
    assert json.load(open(tmp_path / "tuned.json")) == tuning.table()  # a CPU run tunes no card
    assert "tune " in r.stderr  # progress


# ------------------------------------------------------------------ grad_in_forward: never slower than not using it
PATHS = {"format": 1, "devices": {}, "grad_in_forward": {CARD: {"bf16": {
    "128256": "default", "32000": "triton", "151936": [4, 256]}}}}


@pytest.fixture
def paths(monkeypatch):
    """The table ``PATHS``, and every device named ``CARD`` (restored after)."""
    monkeypatch.setattr(tuning, "device_name", lambda d: CARD)
    tuning.set_table(json.loads(json.dumps(PATHS)))
    yield
    tuning.set_table(None)


def _meta(V, dtype=torch.bfloat16):
    return torch.empty((2, 3, V), dtype=dtype, device="meta")


def test_grad_in_forward_entry_by_card_dtype_and_vocabulary(paths, monkeypatch):
    assert tuning.grad_in_forward_entry(_meta(128256)) == "default"
    assert tuning.grad_in_forward_entry(_meta(100000)) == "default"  # the nearest tabled size within a factor of 2
    assert tuning.grad_in_forward_entry(_meta(32000)) == "triton"
    assert tuning.grad_in_forward_entry(_meta(200000)) == (4, 256)  # a cluster configuration, for ops/cluster.py
    assert tuning.grad_in_forward_entry(_meta(700000)) is None  # beyond a factor of 2 of every entry
    assert tuning.grad_in_forward_entry(_meta(128256, torch.float16)) is None  # no fp16 entry
    monkeypatch.setattr(tuning, "device_name", lambda d: "another card")
    assert tuning.grad_in_forward_entry(_meta(128256)) is None


def test_grad_in_forward_entry_without_a_card_is_none():
    """CPU tensors (the interpreter) have no card: the Triton kernel, as the option asks."""
    tuning.set_table(json.loads(json.dumps(PATHS)))
    try:
        assert tuning.grad_in_forward_entry(torch.zeros(2, 3, 128256, dtype=torch.bfloat16)) is None
    finally:
        tuning.set_table(None)


@pytest.mark.parametrize("entry", ["fast", "Default", [4], [True, 256], [4.0, 256], {"4": 256}, None, 1])
def test_malformed_grad_in_forward_entries_are_none(paths, entry):
    tuning.set_table({"grad_in_forward": {CARD: {"bf16": {"128256": entry}}}})
    assert tuning.grad_in_forward_entry(_meta(128256)) is None


@pytest.mark.parametrize("broken", [{"grad_in_forward": []}, {"grad_in_forward": {CARD: "default"}},
                                    {"grad_in_forward": {CARD: {"bf16": ["default"]}}}])
def test_a_broken_grad_in_forward_section_is_none(paths, broken):
    tuning.set_table(broken)
    assert tuning.grad_in_forward_entry(_meta(128256)) is None


def test_forced_path_overrides_the_table_and_nests(paths):
    with tuning.forced_path("triton"):
        assert tuning.grad_in_forward_entry(_meta(128256)) == "triton"
        with tuning.forced_path("default"):
            assert tuning.grad_in_forward_entry(_meta(32000)) == "default"
        assert tuning.grad_in_forward_entry(_meta(32000)) == "triton"
    assert tuning.grad_in_forward_entry(_meta(128256)) == "default"
    with pytest.raises(ValueError, match="path must be one of"):
        with tuning.forced_path("cluster"):
            pass


def test_a_changed_table_is_read_again(paths):
    assert tuning.grad_in_forward_entry(_meta(128256)) == "default"
    tuning.set_table({"grad_in_forward": {CARD: {"bf16": {"128256": "triton"}}}})
    assert tuning.grad_in_forward_entry(_meta(128256)) == "triton"


@pytest.mark.parametrize("V,expected", [(130, "_FusedLoss"), (70, "_GrpoGradInForward"), (300, "_GrpoGradInForward")])
@pytest.mark.parametrize("inplace", [False, True])
def test_fused_grpo_runs_the_default_path_where_the_table_says_so(monkeypatch, V, expected, inplace):
    """``grad_in_forward=True`` where the table says "default" (here V = 130; V = 70 is tabled "triton", 300 has
    no entry): the default path's autograd function runs, and loss, metrics and gradient are the reference's."""
    from test_fused_losses import _data, _run
    monkeypatch.setattr(tuning, "device_name", lambda d: CARD)
    tuning.set_table({"grad_in_forward": {CARD: {"fp32": {"130": "default", "70": "triton"}}}})
    try:
        x, y, ref = _data(3, 6, V)
        adv = torch.tensor([1.0, -0.5, 0.7])
        loss, _ = hk.fused.grpo(x.clone().requires_grad_()[:, :-1], y, ref, adv, beta=0.05, grad_in_forward=True)
        assert type(loss.grad_fn).__name__ == expected + "Backward"
        _run("grpo", x, y, ref, (adv,), dict(beta=0.05, grad_in_forward=True, inplace_backward=inplace))
        # the benchmarks' and GPU tests' forcing reaches past a "default" entry (the cluster's: here, off sm_90, the
        # Triton kernel runs under it), the innermost forcing deciding
        from humanline_kernels.ops import cluster
        for force, name in ((tuning.forced_path("triton"), "_GrpoGradInForward"),
                            (cluster.forced(4, 256), "_GrpoGradInForward"),
                            (tuning.forced_path("default"), "_FusedLoss")):
            with force:
                loss, _ = hk.fused.grpo(x.clone().requires_grad_()[:, :-1], y, ref, adv, grad_in_forward=True)
            assert type(loss.grad_fn).__name__ == name + "Backward"
    finally:
        tuning.set_table(None)


def test_the_committed_grad_in_forward_section_is_valid():
    """Every committed entry is "default", "triton" or a cluster configuration ops/cluster.py accepts."""
    from humanline_kernels.ops import cluster
    tuning.set_table(None)
    section = tuning.table().get("grad_in_forward", {})
    entries = [e for per in section.values() for per_v in per.values() for e in per_v.values()]
    assert all(e in tuning.PATHS or (isinstance(e, list) and len(e) == 2 and e[0] in cluster.CTAS
                                     and e[1] in cluster.THREADS) for e in entries), entries


def _record(tmp_path, name, card, rows):
    """A ``bench logits`` record: ``rows`` of ``(impl, V, ms)``."""
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"env": {"device": card}, "meta": {"dtype": "bfloat16"},
                                "rows": [{"impl": i, "V": v, "ms": ms} for i, v, ms in rows]}))
    return str(path)


def test_from_logits_takes_a_candidate_only_where_it_wins_in_every_record(tmp_path, monkeypatch):
    """Per card and V: the Triton kernel or a cluster configuration at its worst ratio to the default path over the
    records; an entry only where that is at most 1 - GAIN, else "default"; other cards' entries kept."""
    from bench import bench_tune
    monkeypatch.setattr(tuning, "TABLE_PATH", str(tmp_path / "package.json"))
    tuning.set_table({"format": 1, "devices": {}, "grad_in_forward": {"other": {"bf16": {"1000": "triton"}}}})
    g, t, c = "hk.fused.grpo", "hk.fused.grpo(grad_in_fwd)", "hk.fused.grpo(grad_in_fwd,cluster 4x256)"
    a = _record(tmp_path, "a", CARD, [(g, 1000, 1.0), (t, 1000, 0.9), (g, 2000, 1.0), (t, 2000, 0.9),
                                      (c, 2000, 0.8), (g, 4000, 1.0), (t, 4000, 0.99), (g, 8000, 1.0),
                                      (t, 8000, 0.97), ("liger triton_grpo_loss", 8000, 0.5)])
    b = _record(tmp_path, "b", CARD, [(g, 1000, 2.0), (t, 1000, 1.99), (g, 2000, 1.0), (t, 2000, 0.9),
                                      (c, 2000, 0.95), (g, 8000, 1.0), (t, 8000, 1.2)])
    try:
        rows = bench_tune.from_logits([a, b], out_dir=str(tmp_path / "out"), write=True)
        got = json.load(open(tmp_path / "package.json"))["grad_in_forward"]
    finally:
        tuning.set_table(None)
    assert got == json.load(open(tmp_path / "out" / "tuned.json"))["grad_in_forward"]
    assert got == {"other": {"bf16": {"1000": "triton"}}, CARD: {"bf16": {
        "1000": "default",  # 0.995 in the second record: not 2 % faster there
        "2000": "triton",  # the cluster's 0.95 at worst against the Triton kernel's 0.9
        "4000": "default",  # 1 % faster: within GAIN
        "8000": "default"}}}  # faster in one record, slower in the other; Liger's row is no candidate
    assert [r["V"] for r in rows] == [1000, 2000, 4000, 8000]


def test_from_logits_entries_of_the_committed_table_are_its_records():
    """The shipped table's "grad_in_forward" entries are what ``bench tune --from-logits`` makes of the committed
    records the record.sh beside its run names (no entry typed by hand), and docs/kernels.md lists them."""
    import shlex

    from bench import bench_tune
    run = os.path.join(ROOT, "bench", "results", "2026-11-29-grad-in-forward-table")
    script = open(os.path.join(run, "record.sh")).read().replace("\\\n", " ")
    calls = [shlex.split(line) for line in script.splitlines() if line.startswith("python -m bench tune")]
    assert len(calls) == 2
    tuning.set_table({"format": 1, "devices": {}})
    rows = []
    try:
        for call in calls:
            arm = call[call.index("--arm") + 1] if "--arm" in call else "hk.fused"
            rows += bench_tune.from_logits([os.path.join(ROOT, r) for r in call if r.endswith("logits.json")],
                                           out_dir=os.path.join(ROOT, "bench", "out", "test-from-logits"),
                                           write=False, arm=arm)
    finally:
        tuning.set_table(None)
    made = {}
    for r in rows:
        made.setdefault(r["card"], {}).setdefault(r["dtype"], {})[str(r["V"])] = r["entry"]
    assert made == tuning.table()["grad_in_forward"]
    # docs/kernels.md's table of them: a row each, the entry and the Triton kernel's worst ratio as made here
    doc = open(os.path.join(ROOT, "docs", "kernels.md")).read()
    span = doc.split("<!-- table: grad_in_forward (tests/ops/test_tuning.py) -->")[1].split("<!-- /table -->")[0]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in span.strip().splitlines()[2:]]
    said = {"the default path": "default", "the Triton kernel": "triton"}
    assert len(cells) == len(rows)
    for r, (card, dtype, V, runs, source) in zip(rows, cells):
        assert (card, dtype, int(V), said[runs]) == (r["card"], r["dtype"], r["V"], r["entry"])
        ratio = float(re.search(r"the Triton kernel ([0-9.]+)x", source).group(1))
        assert abs(ratio - r["worst triton"]) < 6e-4, (source, r)  # (as printed, to 3 decimals)


def test_the_table_choice_traces_under_torch_compile(monkeypatch):
    """A CUDA card's entry read inside a compiled function (the card's name and its entries are constants to
    torch.compile; ``V`` compares as a guard, also when dynamic): no graph break, and the entry decides the traced
    branch."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: CARD)
    monkeypatch.setattr(tuning, "_NAMES", {})
    monkeypatch.setattr(tuning, "device_name", lambda d: tuning._cuda_name(0))  # (CPU tensors named as CUDA's)
    tuning.set_table(json.loads(json.dumps(PATHS)))
    try:
        def f(x):
            return x * 2 if tuning.grad_in_forward_entry(x) == "default" else x * 3
        for dynamic in (False, True):
            torch._dynamo.reset()
            g = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=dynamic)
            for V, factor in ((128256, 2), (32000, 3), (100000, 2), (200000, 3), (700000, 3)):
                assert g(torch.ones(V, dtype=torch.bfloat16))[0].item() == factor, (dynamic, V)
    finally:
        tuning.set_table(None)
        torch._dynamo.reset()
