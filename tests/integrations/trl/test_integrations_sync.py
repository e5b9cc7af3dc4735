"""Humanline syncing through the TRL trainers (CPU, tiny random-init Llama): at every optimizer step the reference
holds the policy from before the previous sync step's update; sync_every and gradient accumulation."""
import importlib.util
import os

import pytest
import torch

pytest.importorskip("trl")
from transformers import TrainerCallback  # noqa: E402

from humanline_kernels.integrations.trl import (  # noqa: E402
    HumanlineDPOConfig,
    HumanlineDPOTrainer,
    HumanlineGRPOConfig,
    HumanlineGRPOTrainer,
    HumanlineKTOConfig,
    HumanlineKTOTrainer,
)

pytestmark = pytest.mark.slow  # trainer runs

_spec = importlib.util.spec_from_file_location(
    "hk_trl_tests", os.path.join(os.path.dirname(__file__), "test_integrations_trl.py"))
T = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(T)
tiny_path = T.tiny_path


class Snapshots(TrainerCallback):
    """Policy and reference weights at the beginning of every optimizer step (before any forward)."""

    def __init__(self, ref_getter):
        self.ref_getter, self.policy, self.ref = ref_getter, [], []

    def on_step_begin(self, args, state, control, model=None, **kw):
        self.policy.append([p.detach().clone() for p in model.parameters()])
        self.ref.append([p.detach().clone() for p in self.ref_getter().parameters()])


def _check_lag(snap, every):
    """ref at step t == policy at the start of the last sync step s < t (sync steps: s % every == 0)."""
    steps = len(snap.policy)
    assert steps >= 2
    for t in range(1, steps):
        assert any(not torch.equal(a, b) for a, b in zip(snap.policy[t], snap.policy[t - 1])), "policy did not move"
        s = ((t - 1) // every) * every
        for a, b in zip(snap.ref[t], snap.policy[s]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # before any sync the reference is the initial policy
    for a, b in zip(snap.ref[0], snap.policy[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _train(trainer):
    snap = Snapshots(lambda: trainer.ref_model)
    trainer.add_callback(snap)
    trainer.train()
    return snap


def _logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


@pytest.mark.parametrize("fused,every,accum", [("logits", 1, 1), ("linear", 3, 1), ("off", 1, 2)])
def test_dpo_reference_lags_policy(tiny_path, fused, every, accum):
    steps = 5 if every > 1 else 3
    args = HumanlineDPOConfig(**T.COMMON, output_dir=tiny_path + "/o", per_device_train_batch_size=2,
                              gradient_accumulation_steps=accum, max_steps=steps, learning_rate=5e-2,
                              fused=fused, sync_every=every, log_eps_p=-0.02, log_eps_r=0.02)
    tok = T.tiny.tiny_tokenizer()
    tr = HumanlineDPOTrainer(tiny_path, args=args, train_dataset=T.pref_data(), processing_class=tok)
    snap = _train(tr)
    _check_lag(snap, every)
    assert tr.hk_sync.num_syncs == len(range(0, steps, every))  # once per optimizer step, not per micro-batch
    frac = _logged(tr, "humanline/unclipped_frac")
    assert len(frac) == steps and frac[0] == 1.0 and min(frac[1:]) < 1.0  # the narrow band clips after step 0
    assert _logged(tr, "humanline/num_syncs")[-1] == tr.hk_sync.num_syncs
    for key in ("rewards/chosen", "rewards/margins", "logps/chosen", "entropy", "num_tokens"):
        assert len(_logged(tr, key)) == steps, key
    syncs = tr.hk_sync.num_syncs
    ev = tr.evaluate(T.pref_data().select(range(4)))  # eval neither syncs nor breaks on the fused head
    assert "eval_humanline/unclipped_frac" in ev and "eval_entropy" in ev and tr.hk_sync.num_syncs == syncs


def test_kto_reference_lags_policy(tiny_path):
    args = HumanlineKTOConfig(**T.COMMON, output_dir=tiny_path + "/o", per_device_train_batch_size=4,
                              gradient_accumulation_steps=2, max_steps=3, learning_rate=5e-2, fused="logits")
    tr = HumanlineKTOTrainer(tiny_path, args=args, train_dataset=T.kto_data(), processing_class=T.tiny.tiny_tokenizer())
    snap = _train(tr)
    _check_lag(snap, 1)
    assert tr.hk_sync.num_syncs == 3
    assert len(_logged(tr, "kl")) == 3 and len(_logged(tr, "humanline/unclipped_frac")) == 3


@pytest.mark.parametrize("beta,accum", [(0.0, 1), (0.05, 2)])
def test_grpo_reference_lags_policy(tiny_path, beta, accum):
    args = HumanlineGRPOConfig(**T.COMMON, **T.GRPO_KW, output_dir=tiny_path + "/o", max_steps=3, learning_rate=5e-2,
                               beta=beta, gradient_accumulation_steps=accum, fused="linear")
    tr = HumanlineGRPOTrainer(tiny_path, reward_funcs=T.digit_reward, args=args, train_dataset=T.grpo_data(),
                              processing_class=T.tiny.tiny_tokenizer())
    assert tr.ref_model is not None  # built for humanline even with beta == 0
    snap = _train(tr)
    _check_lag(snap, 1)
    assert tr.hk_sync.num_syncs == 3
    for key in ("humanline/unclipped_frac", "clip_ratio/region_mean", "entropy"):
        assert len(_logged(tr, key)) == 3, key
    assert (len(_logged(tr, "kl")) == 3) == (beta != 0)
    if accum == 1:
        ev = tr.evaluate(T.grpo_data().select(range(4)))
        assert "eval_humanline/unclipped_frac" in ev and tr.hk_sync.num_syncs == 3


def test_refusals(tiny_path):
    tok = T.tiny.tiny_tokenizer()
    kw = dict(T.COMMON, output_dir=tiny_path + "/o")
    with pytest.raises(ValueError, match="precompute_ref_log_probs"):
        HumanlineDPOTrainer(tiny_path, args=HumanlineDPOConfig(**kw, precompute_ref_log_probs=True),
                            train_dataset=T.pref_data(), processing_class=tok)
    with pytest.raises(ValueError, match="sync_ref_model"):
        HumanlineKTOTrainer(tiny_path, args=HumanlineKTOConfig(**kw, per_device_train_batch_size=2,
                                                               sync_ref_model=True),
                            train_dataset=T.kto_data(), processing_class=tok)
    with pytest.raises(ValueError, match="delta .* loss_type='sapo'"):  # (off-policy generation and vLLM's
        HumanlineGRPOTrainer(tiny_path, reward_funcs=T.digit_reward, train_dataset=T.grpo_data(),  # weight: tests/
                             processing_class=tok,  # test_trl_grpo_offpolicy.py, test_trl_grpo_options.py)
                             args=HumanlineGRPOConfig(**kw, **T.GRPO_KW, loss_type="sapo", delta=1.5))
    with pytest.raises(ValueError, match="log_eps_p"):
        HumanlineDPOConfig(**kw, log_eps_p=1.0, log_eps_r=0.5)
    with pytest.raises(ValueError, match="fused"):
        HumanlineDPOConfig(**kw, fused="chunked")
    with pytest.raises(ValueError, match="sync_every"):
        HumanlineGRPOConfig(**kw, **T.GRPO_KW, sync_every=0)


def test_configs_take_output_dir_positionally():
    """Like TRL's configs (and the trainers' ``args=None`` default), the first positional field is output_dir."""
    kw = dict(use_cpu=True, report_to=[])
    for cls in (HumanlineDPOConfig, HumanlineKTOConfig, HumanlineGRPOConfig):
        c = cls("out-dir", **kw)
        assert c.output_dir == "out-dir" and c.humanline is True and c.fused == "linear", cls


def test_callback_standalone(tmp_path):
    from types import SimpleNamespace as NS

    from humanline_kernels.integrations.transformers import HumanlineSyncCallback

    pol, ref = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="every"):
        HumanlineSyncCallback(every=0)
    cb = HumanlineSyncCallback(every=2)
    with pytest.raises(ValueError, match="reference"):
        cb.on_train_begin(NS(), NS(global_step=0), None, model=pol)
    with pytest.raises(ValueError, match="DeepSpeed"):
        cb.on_train_begin(NS(deepspeed_plugin=object()), NS(global_step=0), None, model=pol, ref_model=ref)
    # reference through the event keyword (TRL's CallbackHandlerWithRefModel pattern); resume at global step 3 from
    # the humanline state of a checkpoint in output_dir/checkpoint-3 (resume_from_checkpoint=True)
    cb.on_train_begin(NS(), NS(global_step=0), None, model=pol, ref_model=ref)
    cb.syncer.load_state_dict({"step": 3})  # (three steps trained)
    cb.save_state(tmp_path / "checkpoint-3", NS(global_step=3))
    cb.on_train_begin(NS(output_dir=str(tmp_path)), NS(global_step=3, log_history=[]), None, model=pol,
                      ref_model=ref)
    assert cb.syncer.step == 3
    before = ref.weight.detach().clone()
    cb.on_step_begin(None, None, None)
    cb.on_pre_optimizer_step(None, None, None)  # step 3: 3 % 2 != 0, no sync
    assert torch.equal(ref.weight, before) and not torch.equal(ref.weight, pol.weight)
    cb.on_step_begin(None, None, None)
    cb.reference_done()  # step 4 syncs; the copy starts here and completes in on_pre_optimizer_step
    cb.on_pre_optimizer_step(None, None, None)
    assert torch.equal(ref.weight, pol.weight) and torch.equal(ref.bias, pol.bias) and cb.num_syncs == 1


@pytest.mark.parametrize("kw, match", [
    (dict(overlap="no"), "overlap must be a bool"), (dict(overlap=1), "overlap must be a bool"),
    (dict(adapters="ref"), r"adapters must be a pair of adapter names \(train, reference\)"),
    (dict(adapters=("default",)), "adapters must be a pair"),
    (dict(adapters=("a", "a")), "adapters: train and reference must be different adapters"),
    (dict(adapters=(None, "ref")), "adapters: the train adapter's name must be a non-empty str"),
    (dict(ref_model="model"), "ref_model must be a torch.nn.Module or None"),
    (dict(ref_model=torch.nn.Linear(1, 1), adapters=("default", "ref")), "pass adapters or ref_model, not both"),
    (dict(resume_from=3), "resume_from must be a checkpoint folder"),
    (dict(every=True), "every must be a positive int"),
])
def test_callback_refuses_bad_arguments_at_construction(kw, match):
    """The syncer's rule at construction: overlap="no" became True through bool() (the syncer refuses a non-bool),
    adapters="ref" failed at on_train_begin with "too many values to unpack", a resume_from that is no path was
    skipped silently at the resume."""
    from humanline_kernels.integrations.transformers import HumanlineSyncCallback

    with pytest.raises(ValueError, match=match):
        HumanlineSyncCallback(**kw)
    cb = HumanlineSyncCallback(adapters=["default", "ref"], overlap=False)  # (a list from a config file: a pair)
    assert cb.adapters == ("default", "ref") and cb.overlap is False
    with pytest.raises(ValueError, match="blocking must be a bool, got 'no'"):  # (was a blocking sync)
        cb.reference_done(blocking="no")


@pytest.mark.gpu
def test_dpo_reference_lags_policy_cuda_overlap(tiny_path):
    """On CUDA the copy runs on a side stream during the policy's forward/backward; the lag must still hold."""
    args = HumanlineDPOConfig(**dict(T.COMMON, use_cpu=False), output_dir=tiny_path + "/o",
                              per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
                              learning_rate=5e-2, fused="linear", sync_every=1)
    tok = T.tiny.tiny_tokenizer()
    tr = HumanlineDPOTrainer(tiny_path, args=args, train_dataset=T.pref_data(), processing_class=tok)
    snap = _train(tr)
    assert snap.policy[0][0].is_cuda
    _check_lag(snap, 1)
    assert tr.hk_sync.num_syncs == 4
