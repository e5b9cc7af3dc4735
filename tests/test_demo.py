"""The main job runs end to end (reduced sizes) for every objective and prints its measured table."""
import io
import os
import subprocess
import sys

import pytest
import torch

from humanline_kernels import demo


def test_rule_checker():
    prompts = torch.tensor([[demo.BOS, 4, 5, 6, 4 + demo.K - 1, demo.SEP]])
    want = demo.rule_completion(prompts)
    assert want.tolist() == [[4, 5, 6, 7, 8]]  # wraps around after the last symbol
    good = torch.cat([want, torch.tensor([[demo.EOS]])], 1)
    assert demo.token_scores(prompts, good).min().item() == 1.0
    bad = good.clone()
    bad[0, 2] = 4
    assert demo.token_scores(prompts, bad).sum().item() == 5.0


@pytest.mark.parametrize("objective,interpret", [("dpo", "1"), ("kto", "0"), ("grpo", "0")])
def test_demo_runs(monkeypatch, objective, interpret):
    # DPO goes through the Triton kernels in the interpreter, the others through the eager CPU path users run
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    out = io.StringIO()
    res = demo.run(objective, steps=3, sft_steps=3, eval_n=16, batch=8, quiet=True, out=out, sync_every=1)
    text = out.getvalue()
    assert f"offline {objective}" in text and f"humanline {objective}" in text
    offline, humanline = res["rows"]
    assert offline["clip_frac"] is None and 0.0 <= humanline["clip_frac"] <= 1.0
    for r in res["rows"]:
        assert 0.0 <= r["rule_rate"] <= 1.0 and torch.isfinite(torch.tensor(r["final_loss"]))


def test_demo_cli():
    cmd = [sys.executable, "-m", "humanline_kernels.demo", "--steps", "2", "--sft-steps", "2", "--batch", "8",
           "--objective", "dpo", "--quiet"]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    assert "humanline dpo" in p.stdout and "rule_rate" in p.stdout


@pytest.mark.parametrize("flags", [["--steps", "0"], ["--device", "gpu"], ["--device", "cuda"],
                                   ["--log-eps-p", "2", "--log-eps-r", "1"], ["--sync-every", "0"], ["--lr", "-1"],
                                   ["--lr", "nan"], ["--batch", "3"], ["--batch", "x"]])
def test_bad_flags_are_one_line_argparse_errors(flags, monkeypatch, capsys):
    from humanline_kernels import demo
    monkeypatch.setattr(demo.torch.cuda, "is_available", lambda: False)  # "--device cuda" without CUDA
    with pytest.raises(SystemExit) as e:
        demo.main(flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert len([ln for ln in err.splitlines() if "error:" in ln]) == 1, err


def test_help_shows_defaults(capsys):
    from humanline_kernels import demo
    with pytest.raises(SystemExit) as e:
        demo.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "(default: 200)" in out and "(default: dpo)" in out
