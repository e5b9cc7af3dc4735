"""Humanline TRL trainers on a tiny random-init Llama (CPU): parity with TRL's stock trainers when humanline is
off, and, when on, the reference equals the policy from before the previous update at every step."""
import importlib.util
import os

import pytest
import torch

pytest.importorskip("trl")
# every FutureWarning is an error here, but for the transformers deprecations that TRL's own code raises
TRL_DEPRECATIONS = [f"ignore:`{n}` is deprecated:FutureWarning" for n in (
    "gradient_checkpointing", "is_gradient_checkpointing", "gradient_checkpointing_enable",
    "gradient_checkpointing_disable")]
pytestmark = pytest.mark.filterwarnings("error::FutureWarning", *TRL_DEPRECATIONS)
from datasets import Dataset  # noqa: E402
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, KTOConfig, KTOTrainer  # noqa: E402

from humanline_kernels.integrations.trl import (  # noqa: E402
    HumanlineDPOConfig,
    HumanlineDPOTrainer,
    HumanlineGRPOConfig,
    HumanlineGRPOTrainer,
    HumanlineKTOConfig,
    HumanlineKTOTrainer,
)

_spec = importlib.util.spec_from_file_location(
    "hk_tiny", os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "tiny.py"))
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)

COMMON = dict(report_to=[], use_cpu=True, bf16=False, save_strategy="no", logging_steps=1,
              disable_tqdm=True, seed=0)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    tiny.tiny_model().save_pretrained(path)
    tiny.tiny_tokenizer().save_pretrained(path)
    return path


def pref_data():
    return Dataset.from_list([{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": f"{a + b + 1}!"}
                              for a in range(4) for b in range(3)])


def kto_data():
    rows = []
    for a in range(4):
        for b in range(2):
            rows.append({"prompt": f"{a}*{b}=", "completion": str(a * b), "label": True})
            rows.append({"prompt": f"{a}-{b}=", "completion": f"{a + b}?", "label": False})
    return Dataset.from_list(rows)


def grpo_data():
    return Dataset.from_list([{"prompt": f"{a}+{b}="} for a in range(4) for b in range(4)])


def digit_reward(completions, **kw):
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _loss_and_grads(trainer, inputs):
    trainer.model.train()
    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop; needed by GRPO's loss
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), _grads(trainer.model)


def _assert_same(a, b, tol=1e-5):
    (la, ga), (lb, gb) = a, b
    torch.testing.assert_close(la, lb, rtol=tol, atol=tol)
    assert ga.keys() == gb.keys() and ga
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], rtol=tol, atol=tol, msg=n)


FUSED = ["off", "logits", "linear"]


@pytest.mark.parametrize("fused", FUSED)
def test_dpo_off_matches_trl(tiny_path, fused):
    tok = tiny.tiny_tokenizer()
    kw = dict(COMMON, output_dir=tiny_path + "/o", per_device_train_batch_size=3, max_steps=1)
    stock = DPOTrainer(tiny_path, args=DPOConfig(**kw), train_dataset=pref_data(), processing_class=tok)
    ours = HumanlineDPOTrainer(tiny_path, args=HumanlineDPOConfig(**kw, humanline=False, fused=fused),
                               train_dataset=pref_data(), processing_class=tok)
    inputs = stock._prepare_inputs(next(iter(stock.get_train_dataloader())))
    with torch.no_grad():  # make the policy differ from the reference so the log-ratios are not all 0
        for p, q in zip(stock.model.parameters(), ours.model.parameters()):
            p.add_(0.05 * torch.randn_like(p))
            q.copy_(p)
    _assert_same(_loss_and_grads(ours, inputs), _loss_and_grads(stock, inputs))


@pytest.mark.parametrize("fused", FUSED)
def test_kto_off_matches_trl(tiny_path, fused):
    tok = tiny.tiny_tokenizer()
    kw = dict(COMMON, output_dir=tiny_path + "/o", per_device_train_batch_size=4, max_steps=1)
    stock = KTOTrainer(tiny_path, args=KTOConfig(**kw), train_dataset=kto_data(), processing_class=tok)
    ours = HumanlineKTOTrainer(tiny_path, args=HumanlineKTOConfig(**kw, humanline=False, fused=fused),
                               train_dataset=kto_data(), processing_class=tok)
    inputs = stock._prepare_inputs(next(iter(stock.get_train_dataloader())))
    with torch.no_grad():
        for p, q in zip(stock.model.parameters(), ours.model.parameters()):
            p.add_(0.05 * torch.randn_like(p))
            q.copy_(p)
    _assert_same(_loss_and_grads(ours, inputs), _loss_and_grads(stock, inputs))


GRPO_KW = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=6, temperature=1.0)


@pytest.mark.parametrize("fused,loss_type", [("off", "dapo"), ("logits", "grpo"), ("linear", "dr_grpo"),
                                             ("linear", "bnpo")])
def test_grpo_off_matches_trl(tiny_path, fused, loss_type):
    tok = tiny.tiny_tokenizer()
    kw = dict(COMMON, **GRPO_KW, output_dir=tiny_path + "/o", max_steps=1, beta=0.05, loss_type=loss_type)
    stock = GRPOTrainer(tiny_path, reward_funcs=digit_reward, args=GRPOConfig(**kw), train_dataset=grpo_data(),
                        processing_class=tok)
    ours = HumanlineGRPOTrainer(tiny_path, reward_funcs=digit_reward, train_dataset=grpo_data(),
                                args=HumanlineGRPOConfig(**kw, humanline=False, fused=fused), processing_class=tok)
    stock.model.train()
    inputs = stock._prepare_inputs(next(iter(stock.get_train_dataloader())))
    with torch.no_grad():  # make ratio != 1 so the PPO clip and the KL both matter
        inputs["old_per_token_logps"] = inputs["ref_per_token_logps"] + 0.3 * torch.randn_like(
            inputs["ref_per_token_logps"])
    _assert_same(_loss_and_grads(ours, inputs), _loss_and_grads(stock, inputs))


@pytest.mark.gpu
@pytest.mark.parametrize("fused", ["logits", "linear"])
def test_dpo_off_matches_trl_cuda(tiny_path, fused, compiled_kernels):
    """On CUDA the fused paths run the Triton kernels (fp32 model: TRL parity to 1e-4, reduction order differs)."""
    tok = tiny.tiny_tokenizer()
    kw = dict(COMMON, use_cpu=False, output_dir=tiny_path + "/o", per_device_train_batch_size=3, max_steps=1)
    stock = DPOTrainer(tiny_path, args=DPOConfig(**kw), train_dataset=pref_data(), processing_class=tok)
    ours = HumanlineDPOTrainer(tiny_path, args=HumanlineDPOConfig(**kw, humanline=False, fused=fused),
                               train_dataset=pref_data(), processing_class=tok)
    assert next(ours.model.parameters()).is_cuda
    inputs = stock._prepare_inputs(next(iter(stock.get_train_dataloader())))
    with torch.no_grad():
        for p, q in zip(stock.model.parameters(), ours.model.parameters()):
            p.add_(0.05 * torch.randn_like(p))
            q.copy_(p)
    _assert_same(_loss_and_grads(ours, inputs), _loss_and_grads(stock, inputs), tol=1e-4)


def _grpo_generating(tiny_path, trainer_cls, config_cls, device_kw, steps=4, **cfg):
    """(trainer, completions scored at each generation, (loss, reward) logged at each optimizer step) of a short
    GRPO run that generates every 2 optimizer steps (``steps_per_generation=2``: one generation feeds two)."""
    scored = []

    def reward(completions, **kw):
        scored.append(len(completions))
        return digit_reward(completions)
    kw = dict(COMMON, **GRPO_KW, **device_kw, output_dir=tiny_path + "/g-gen", max_steps=steps, learning_rate=5e-2,
              beta=0.05, steps_per_generation=2)
    tr = trainer_cls(tiny_path, reward_funcs=reward, train_dataset=grpo_data(), args=config_cls(**kw, **cfg),
                     processing_class=tiny.tiny_tokenizer())
    tr.train()
    logs = [(h["loss"], h.get("reward")) for h in tr.state.log_history if "loss" in h]  # reward: at generation
    assert len(logs) == steps, tr.state.log_history
    return tr, scored, logs


GPU_BF16 = dict(use_cpu=False, bf16=True)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", ["logits", "linear"])
def test_grpo_trains_on_cuda_generating_every_2_steps(tiny_path, fused, compiled_kernels):
    """HumanlineGRPOTrainer as users run it on one GPU (bf16 autocast, TRL's own generation every 2 optimizer
    steps): humanline off, the steps fed by the first generation log TRL's GRPOTrainer's losses and rewards (the
    same seed samples the same completions); humanline on, the reference is synced every step, two generations
    of 8 completions are scored and every loss is finite."""
    _, stock_scored, stock = _grpo_generating(tiny_path, GRPOTrainer, GRPOConfig, GPU_BF16, steps=2)
    tr, scored, ours = _grpo_generating(tiny_path, HumanlineGRPOTrainer, HumanlineGRPOConfig, GPU_BF16, steps=2,
                                        humanline=False, fused=fused)
    assert next(tr.model.parameters()).is_cuda and scored == stock_scored == [8]
    assert ours[0][1] is not None and ours[0][1] == pytest.approx(stock[0][1])  # the same completions scored
    assert [loss for loss, _ in ours] == pytest.approx([loss for loss, _ in stock], rel=2e-2, abs=2e-3)
    tr, scored, logs = _grpo_generating(tiny_path, HumanlineGRPOTrainer, HumanlineGRPOConfig, GPU_BF16,
                                        fused=fused, sync_every=1)
    assert scored == [8, 8] and tr.hk_sync.num_syncs == 4
    assert all(torch.isfinite(torch.tensor(loss)) for loss, _ in logs)


def test_model_id_or_path_with_peft_installed(tiny_path):
    """A model given by path (as most users do) with peft installed: accelerate's is_peft_model must not be asked
    about a str (it walked it as a module: AttributeError '_modules'). A PeftModel with humanline on gets a synced
    reference adapter (tested below)."""
    peft = pytest.importorskip("peft")
    tok = tiny.tiny_tokenizer()
    kw = dict(COMMON, output_dir=tiny_path + "/peft", per_device_train_batch_size=2, max_steps=1)
    trainer = HumanlineDPOTrainer(tiny_path, args=HumanlineDPOConfig(**kw), train_dataset=pref_data(),
                                  processing_class=tok)
    assert trainer.ref_model is not None and not isinstance(trainer.model, peft.PeftModel)
    lora = peft.get_peft_model(tiny.tiny_model(), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    trainer = HumanlineDPOTrainer(lora, args=HumanlineDPOConfig(**kw), train_dataset=pref_data(),
                                  processing_class=tok)  # PEFT + humanline: a reference adapter, no model
    assert trainer.ref_model is None and "ref" in trainer.model.peft_config


@pytest.mark.parametrize("fused", ["logits", "linear"])
def test_grpo_cast_lm_head_to_fp32_matches_trl(tiny_path, fused):
    """``cast_lm_head_to_fp32=True`` on a bf16 model: the fp32 head and fp32 logits (or fp32 hidden states and
    weight for the fused-linear GEMMs) go through our kernels; parity with TRL's stock trainer in that mode."""
    tok = tiny.tiny_tokenizer()
    kw = dict(COMMON, **GRPO_KW, output_dir=tiny_path + "/o32", max_steps=1, beta=0.05, loss_type="dapo",
              cast_lm_head_to_fp32=True, model_init_kwargs={"dtype": torch.bfloat16})
    stock = GRPOTrainer(tiny_path, reward_funcs=digit_reward, args=GRPOConfig(**kw), train_dataset=grpo_data(),
                        processing_class=tok)
    ours = HumanlineGRPOTrainer(tiny_path, reward_funcs=digit_reward, train_dataset=grpo_data(),
                                args=HumanlineGRPOConfig(**kw, humanline=False, fused=fused), processing_class=tok)
    for tr in (stock, ours):
        assert tr.model.lm_head.weight.dtype == torch.float32
        assert tr.model.model.embed_tokens.weight.dtype == torch.bfloat16
    stock.model.train()
    inputs = stock._prepare_inputs(next(iter(stock.get_train_dataloader())))
    with torch.no_grad():
        inputs["old_per_token_logps"] = inputs["ref_per_token_logps"] + 0.3 * torch.randn_like(
            inputs["ref_per_token_logps"])
    _assert_same(_loss_and_grads(ours, inputs), _loss_and_grads(stock, inputs), tol=1e-5)


def _peft_config():
    peft = pytest.importorskip("peft")
    return peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


@pytest.mark.parametrize("fused", ["logits", "linear"])
def test_dpo_peft_humanline_off_matches_trl(tiny_path, fused):
    """humanline=False with PEFT: the reference is the adapter-disabled base, as in TRL's stock trainer."""
    tok = tiny.tiny_tokenizer()
    kw = dict(COMMON, output_dir=tiny_path + "/peft-off", per_device_train_batch_size=3, max_steps=1)
    stock = DPOTrainer(tiny_path, args=DPOConfig(**kw), train_dataset=pref_data(), processing_class=tok,
                       peft_config=_peft_config())
    ours = HumanlineDPOTrainer(tiny_path, args=HumanlineDPOConfig(**kw, humanline=False, fused=fused),
                               train_dataset=pref_data(), processing_class=tok, peft_config=_peft_config())
    inputs = stock._prepare_inputs(next(iter(stock.get_train_dataloader())))
    with torch.no_grad():  # a non-zero adapter, the same in both
        for p, q in zip(stock.model.parameters(), ours.model.parameters()):
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
                q.copy_(p)
    _assert_same(_loss_and_grads(ours, inputs), _loss_and_grads(stock, inputs))


def _adapter_lag(tr, every, steps):
    """Train; at step t the reference adapter holds the trained adapter of the last sync step s < t."""
    from transformers import TrainerCallback

    from humanline_kernels.integrations.trl import HK_REF_ADAPTER
    assert tr.ref_model is None and HK_REF_ADAPTER in tr.model.peft_config

    def adapter(name):
        return [p.detach().clone() for n, p in tr.model.named_parameters() if f".{name}." in n]

    class Snap(TrainerCallback):
        def __init__(self):
            self.train, self.ref = [], []

        def on_step_begin(self, *a, **k):
            self.train.append(adapter("default"))
            self.ref.append(adapter(HK_REF_ADAPTER))
    snap = Snap()
    tr.add_callback(snap)
    tr.train()
    assert not any(p.requires_grad for n, p in tr.model.named_parameters() if f".{HK_REF_ADAPTER}." in n)
    assert len(snap.train) == steps and snap.ref[0]
    for t in range(1, steps):
        s = ((t - 1) // every) * every
        for a, b in zip(snap.ref[t], snap.train[s]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert any(not torch.equal(a, b) for a, b in zip(snap.train[t], snap.train[t - 1]))


@pytest.mark.slow
@pytest.mark.parametrize("every,accum", [(1, 1), (3, 1), (3, 2)])
def test_dpo_peft_humanline_reference_is_the_pre_update_peft_model(tiny_path, every, accum):
    """humanline=True with PEFT: at every step the reference log-probs equal those of a deep copy of the PEFT model
    taken just before the update of the last sync step; the reference adapter (TRL's "ref") is frozen, never gets
    a gradient and is not in the optimizer; no reference model."""
    import copy

    from transformers import TrainerCallback
    kw = dict(COMMON, output_dir=tiny_path + "/peft-on", per_device_train_batch_size=2, max_steps=5,
              learning_rate=5e-2, gradient_accumulation_steps=accum)
    tr = HumanlineDPOTrainer(tiny_path, args=HumanlineDPOConfig(**kw, sync_every=every), train_dataset=pref_data(),
                             processing_class=tiny.tiny_tokenizer(), peft_config=_peft_config())
    snaps, calls = [], []

    class Snap(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **k):
            snaps.append(copy.deepcopy(tr.accelerator.unwrap_model(tr.model)))

    ref_logps = tr._hk_ref_logps

    def recording(kwargs, labels, policy):
        out = ref_logps(kwargs, labels, policy)
        if tr.model.training:
            calls.append((tr.state.global_step, {k: v.clone() for k, v in kwargs.items() if torch.is_tensor(v)},
                          labels.clone(), out.detach().clone()))
        return out
    tr._hk_ref_logps = recording
    tr.add_callback(Snap())
    _adapter_lag(tr, every, 5)
    assert len(calls) == 5 * accum
    for t, kwargs, labels, out in calls:
        s = ((t - 1) // every) * every if t else 0
        with torch.no_grad():
            expect = snaps[s](**kwargs, use_cache=False, labels=labels, fused_lm_head=True).log_probs
        torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-6, msg=f"step {t}")
    ref_params = [p for n, p in tr.model.named_parameters() if ".ref." in n]
    assert all(p.grad is None for p in ref_params)
    in_opt = {id(p) for g in tr.optimizer.param_groups for p in g["params"]}
    assert not any(id(p) in in_opt for p in ref_params) and in_opt


@pytest.mark.slow
@pytest.mark.parametrize("every,accum", [(1, 1), (3, 2)])
def test_grpo_peft_humanline_syncs_a_reference_adapter(tiny_path, every, accum):
    """GRPO: TRL's own reference forward uses the "ref" adapter, which humanline keeps synced."""
    kw = dict(COMMON, **GRPO_KW, output_dir=tiny_path + "/g-peft", max_steps=4, learning_rate=5e-2, beta=0.0,
              gradient_accumulation_steps=accum, steps_per_generation=accum)
    tr = HumanlineGRPOTrainer(tiny_path, reward_funcs=digit_reward, train_dataset=grpo_data(),
                              args=HumanlineGRPOConfig(**kw, sync_every=every), processing_class=tiny.tiny_tokenizer(),
                              peft_config=_peft_config())
    _adapter_lag(tr, every, 4)
    assert tr.hk_sync.num_syncs == len(range(0, 4, every))


@pytest.mark.slow
@pytest.mark.parametrize("every,accum", [(1, 1), (3, 2)])
def test_kto_peft_humanline_syncs_a_reference_adapter(tiny_path, every, accum):
    kw = dict(COMMON, output_dir=tiny_path + "/kto-peft", per_device_train_batch_size=4, max_steps=4,
              learning_rate=5e-2, gradient_accumulation_steps=accum)
    tr = HumanlineKTOTrainer(tiny_path, args=HumanlineKTOConfig(**kw, sync_every=every), train_dataset=kto_data(),
                             processing_class=tiny.tiny_tokenizer(), peft_config=_peft_config())
    _adapter_lag(tr, every, 4)
    assert tr.hk_sync.num_syncs == len(range(0, 4, every))


def test_dpo_peft_ref_adapter_humanline_off_matches_trl(tiny_path):
    """humanline=False with a PEFT model given as such (re-training an adapter): TRL adds its "ref" adapter, an
    initial copy, and both trainers use it as the reference."""
    peft = pytest.importorskip("peft")
    tok = tiny.tiny_tokenizer()
    kw = dict(COMMON, output_dir=tiny_path + "/peft-ref", per_device_train_batch_size=3, max_steps=1)

    def model():
        m = peft.get_peft_model(tiny.tiny_model(), _peft_config())
        g = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_" in n:
                    p.copy_(0.2 * torch.randn(p.shape, generator=g))
        return m
    stock = DPOTrainer(model(), args=DPOConfig(**kw), train_dataset=pref_data(), processing_class=tok)
    ours = HumanlineDPOTrainer(model(), args=HumanlineDPOConfig(**kw, humanline=False), train_dataset=pref_data(),
                               processing_class=tok)
    assert "ref" in stock.model.peft_config and "ref" in ours.model.peft_config
    with torch.no_grad():  # move the trained adapter away from its "ref" copy, the same in both
        for (n, p), q in zip(stock.model.named_parameters(), ours.model.parameters()):
            if ".default." in n:
                p.add_(0.1 * torch.randn_like(p))
                q.copy_(p)
    inputs = stock._prepare_inputs(next(iter(stock.get_train_dataloader())))
    _assert_same(_loss_and_grads(ours, inputs), _loss_and_grads(stock, inputs))
