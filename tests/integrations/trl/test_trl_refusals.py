"""The trainers' refusals that no other test holds (docs/integrations.md, "Refused settings", names a test for each
refusal): no reference model, a model whose logits are not ``hidden @ weight.T`` or an MoE router loss under our
heads, DPO's packing with a vision dataset, GRPO's lookahead under FSDP or DeepSpeed. Each raises a ``ValueError``
that names the setting and why, at construction."""
import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402

from humanline_kernels.integrations.trl import (  # noqa: E402
    HumanlineDPOConfig,
    HumanlineDPOTrainer,
    HumanlineGRPOTrainer,
    HumanlineKTOConfig,
    HumanlineKTOTrainer,
)

_spec = importlib.util.spec_from_file_location(
    "hk_tiny", os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "tiny.py"))
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)
tiny.quiet_trl_deprecations()

COMMON = dict(report_to=[], use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True, seed=0,
              per_device_train_batch_size=2, max_steps=1)


def pref_data():
    return Dataset.from_list([{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": f"{a + b + 1}!"}
                              for a in range(2) for b in range(2)])


def _saved(tmp_path, model):
    path = str(tmp_path / "model")
    model.save_pretrained(path)
    tiny.tiny_tokenizer().save_pretrained(path)
    return path


def test_humanline_without_a_reference_model_is_refused(tmp_path, monkeypatch):
    """TRL builds the reference from the policy's path; where it builds none, humanline has nothing to sync."""
    import trl.trainer.dpo_trainer as dpo_trainer
    path = _saved(tmp_path, tiny.tiny_model())
    monkeypatch.setattr(dpo_trainer, "create_model_from_path", lambda *a, **k: None)
    model = tiny.tiny_model()
    model.config._name_or_path = path
    with pytest.raises(ValueError, match="humanline needs a reference model"):
        HumanlineDPOTrainer(model, ref_model=None, args=HumanlineDPOConfig(output_dir=str(tmp_path / "o"), **COMMON),
                            train_dataset=pref_data(), processing_class=tiny.tiny_tokenizer())


@pytest.mark.parametrize("name", ["final_logit_softcapping", "logit_scale"])
@pytest.mark.parametrize("fused", ["linear", "logits"])
def test_logit_softcapping_or_scaling_is_refused_with_our_heads(tmp_path, name, fused):
    """Our heads compute ``log_softmax(hidden @ weight.T / T)``; a model that caps or scales its logits is refused
    with fused != "off" (TRL's own head, fused="off", applies them)."""
    model = tiny.tiny_model()
    setattr(model.config, name, 30.0)
    path = _saved(tmp_path, model)
    with pytest.raises(ValueError, match=f"does not apply the model's {name}"):
        HumanlineDPOTrainer(path, args=HumanlineDPOConfig(output_dir=str(tmp_path / "o"), fused=fused, **COMMON),
                            train_dataset=pref_data(), processing_class=tiny.tiny_tokenizer())
    HumanlineDPOTrainer(path, args=HumanlineDPOConfig(output_dir=str(tmp_path / "o"), fused="off", **COMMON),
                        train_dataset=pref_data(), processing_class=tiny.tiny_tokenizer())


def test_moe_router_aux_loss_is_refused_with_our_heads(tmp_path):
    """router_aux_loss_coef (an MoE model's router loss) needs the router logits, which our heads do not return;
    fused="off" trains it (tests/integrations/trl/test_trl_dpo_kto_objectives.py)."""
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, pad_token_id=0,
                        eos_token_id=1, bos_token_id=None, tie_word_embeddings=False, router_aux_loss_coef=0.1)
    path = _saved(tmp_path, MixtralForCausalLM(cfg))
    kto = Dataset.from_list([{"prompt": f"{a}*2=", "completion": str(2 * a), "label": a % 2 == 0} for a in range(4)])
    with pytest.raises(ValueError, match="router auxiliary loss is only supported with fused='off'"):
        HumanlineKTOTrainer(path, args=HumanlineKTOConfig(output_dir=str(tmp_path / "o"), fused="linear", **COMMON),
                            train_dataset=kto, processing_class=tiny.tiny_tokenizer())


def test_padding_free_with_a_vision_dataset_is_refused():
    """A vision dataset's images and their tokens are per row: DPO's padding_free=True, which packs the rows into
    one, is refused (the check the trainer runs when padding_free is set, on a vision trainer's state)."""
    trainer = SimpleNamespace(_is_vision_dataset=True, model=tiny.tiny_model())
    with pytest.raises(ValueError, match="padding_free=True packs text sequences; a vision dataset"):
        HumanlineDPOTrainer._hk_precheck_padding_free(trainer, "HumanlineDPOTrainer")
    HumanlineDPOTrainer._hk_precheck_padding_free(SimpleNamespace(_is_vision_dataset=False, model=trainer.model),
                                                  "HumanlineDPOTrainer")


@pytest.mark.parametrize("fsdp,deepspeed", [(True, False), (False, True)])
def test_grpo_lookahead_under_fsdp_or_deepspeed_is_refused(fsdp, deepspeed):
    """GRPO's humanline_reference="lookahead" swaps the last sync's parameters into the policy for a new
    generation's first micro-batches: it needs whole parameters on every rank (the check the trainer runs on its
    accelerator state)."""
    trainer = SimpleNamespace(is_fsdp_enabled=fsdp, is_deepspeed_enabled=deepspeed)
    with pytest.raises(ValueError, match="needs whole parameters on every rank; FSDP and DeepSpeed shard them"):
        HumanlineGRPOTrainer._hk_precheck_lookahead_trainer(trainer, "HumanlineGRPOTrainer")
    HumanlineGRPOTrainer._hk_precheck_lookahead_trainer(SimpleNamespace(is_fsdp_enabled=False,
                                                                        is_deepspeed_enabled=False), "X")
