"""The examples run end to end on CPU with reduced sizes (tiny random-init model)."""
import importlib.util
import math
import os
import sys

import pytest

pytest.importorskip("trl")
EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def _load(name):
    sys.path.insert(0, EXAMPLES)
    spec = importlib.util.spec_from_file_location(f"hk_example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_plain_loop():
    hist = _load("plain_loop").main(["--steps", "3", "--pairs", "2", "--sync-every", "2", "--lr", "1e-2"])
    assert [h["synced"] for h in hist] == [True, False, True]
    assert abs(hist[0]["loss"] - math.log(2.0)) < 1e-6  # reference == policy at step 0: every margin is 0
    assert hist[1]["loss"] != hist[0]["loss"] and all(math.isfinite(h["loss"]) for h in hist)


@pytest.mark.slow
def test_lookahead_loop_trains_like_the_synced_plain_loop():
    """examples/lookahead_loop.py (no reference model) gives the losses and metrics of examples/plain_loop.py."""
    args = ["--steps", "5", "--pairs", "2", "--sync-every", "2", "--lr", "1e-2"]
    synced = _load("plain_loop").main(args)
    look = _load("lookahead_loop").main(args)
    assert [h["synced"] for h in look] == [h["synced"] for h in synced] == [True, False, True, False, True]
    for a, b in zip(look, synced):
        for k in a:
            assert math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-6), (a["step"], k, a[k], b[k])


def test_lora_dpo_example(tmp_path):
    pytest.importorskip("peft")
    tr, per_sync, full = _load("humanline_lora_dpo").main(["--max-steps", "2", "--batch-size", "2", "--lora-r", "2",
                                                          "--output-dir", str(tmp_path), "--fused", "logits"])
    assert tr.ref_model is None and tr.hk_sync.num_syncs == 2
    assert 0 < per_sync < full / 5
    assert all(math.isfinite(h["loss"]) for h in tr.state.log_history if "loss" in h)


def test_dpo_example(tmp_path):
    tr = _load("humanline_dpo").main(["--max-steps", "2", "--batch-size", "2", "--output-dir", str(tmp_path),
                                      "--fused", "logits"])
    assert tr.hk_sync.num_syncs == 2
    assert any("humanline/unclipped_frac" in h for h in tr.state.log_history)


def test_grpo_example(tmp_path):
    tr = _load("humanline_grpo").main(["--max-steps", "2", "--batch-size", "2", "--max-completion-length", "4",
                                       "--output-dir", str(tmp_path), "--sync-every", "2"])
    assert tr.hk_sync.num_syncs == 1  # steps 0 and 1 with sync_every=2: only step 0 syncs
    logs = [h for h in tr.state.log_history if "reward" in h]
    assert len(logs) == 2
    # the smoke run learns something: a reward signal and a non-zero gradient at every step (not zeros)
    assert all(h["reward"] > 0 and h["grad_norm"] > 0 for h in logs), logs


def test_grpo_example_off_policy_lookahead(tmp_path):
    """--generate-every 2: one generation every 2 steps; --reference lookahead: no reference model."""
    tr = _load("humanline_grpo").main(["--max-steps", "4", "--batch-size", "2", "--max-completion-length", "4",
                                       "--output-dir", str(tmp_path), "--generate-every", "2", "--sync-every", "3",
                                       "--reference", "lookahead", "--fused", "off"])
    assert tr.ref_model is None and tr.args.steps_per_generation == 2 and tr.hk_la_syncs == 2  # steps 0 and 3
    assert len([h for h in tr.state.log_history if "reward" in h]) == 2  # two generations in four steps


def test_flash_attention_only_when_it_can_run(monkeypatch):
    """FA2 is requested only for a half-precision model on CUDA with flash_attn importable (it rejects fp32)."""
    import importlib.util as iu

    import torch

    tiny = _load("tiny")
    real_find_spec = iu.find_spec
    monkeypatch.setattr(iu, "find_spec", lambda n, *a: object() if n == "flash_attn" else real_find_spec(n, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert tiny.attn_implementation(torch.bfloat16) == "flash_attention_2"
    assert tiny.attn_implementation(torch.float16) == "flash_attention_2"
    assert tiny.attn_implementation(torch.float32) is None  # the examples' default without --bf16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tiny.attn_implementation(torch.bfloat16) is None
