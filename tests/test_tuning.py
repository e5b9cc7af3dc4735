"""The tuning table (humanline_kernels/ops/tuning.py; issue 53, target 4): what an entry applies to, that the launchers
read it per family, that a forced configuration computes the reference's numbers, that the committed table is valid
and compiled by the gate, and ``python -m bench tune``'s flags and CPU run."""
import json
import os
import subprocess
import sys

import pytest
import torch

import humanline_kernels as hk
from humanline_kernels import reference as R
from humanline_kernels.ops import common, dpo, grpo, kto, logprobs, sequence, token_terms, tuning

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
        import compile_gate  # (it sets both for its own process at import: put back for the tests after this one)
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


@pytest.mark.parametrize("args", [(), ("--quick", "--family", "nope"), ("--quick", "--n", "0"),
                                  ("--quick", "--vocab", "1"), ("--quick", "--write"), ("--bogus",)])
def test_bench_tune_bad_flags_are_one_line(args):
    r = _tune(*args)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "python -m bench tune --help" in r.stderr


def test_bench_tune_quick_times_every_candidate(tmp_path):
    r = _tune("--quick", "--family", "fwd", "gif", "--vocab", "60", "--n", "4", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.load(open(tmp_path / "tune_quick.json"))["rows"]
    assert {(row["family"], row["candidate"]) for row in rows} == {
        (f, f"{b}x{w}") for f in ("fwd", "gif") for b, w in tuning.CANDIDATES[f]}
    assert all("ms" in row for row in rows)
    assert json.load(open(tmp_path / "tuned.json"))["devices"] == {}  # a CPU run tunes no card
    assert "tune " in r.stderr  # progress
