"""What the humanline worker and trainer modes accept and refuse, on verl's own default config (verl environment).

Each refused setup raises a ``ValueError`` that names the option and why, on the driver (trainer mode) and in the
worker; the registered trainer modes put ``HumanlineActorRolloutRefWorker`` where verl's v1 trainer puts
``ActorRolloutRefWorker``.
"""
import pytest

verl = pytest.importorskip("verl")
pytest.importorskip("transfer_queue", reason="verl's v1 trainer needs TransferQueue")

import os  # noqa: E402

from omegaconf import OmegaConf, open_dict  # noqa: E402
from verl.trainer.ppo.utils import Role  # noqa: E402
from verl.trainer.ppo.v1 import get_trainer_cls  # noqa: E402

from humanline_kernels.integrations.verl import HumanlineActorRolloutRefWorker  # noqa: E402
from humanline_kernels.integrations.verl._trainer import check_trainer_config  # noqa: E402
from humanline_kernels.integrations.verl._worker import check_setup  # noqa: E402

TARGET = "humanline_kernels.integrations.verl.HumanlinePolicyLossConfig"


def config(**overrides):
    """verl's flattened default PPO config with the humanline settings docs/verl.md gives, then ``overrides``."""
    cfg = OmegaConf.load(os.path.join(verl.__path__[0], "trainer/config/_generated_ppo_trainer.yaml"))
    with open_dict(cfg):
        cfg.actor_rollout_ref.actor.policy_loss = {"_target_": TARGET, "loss_mode": "humanline", "sync_every": 4}
        cfg.actor_rollout_ref.actor.use_kl_loss = True
        cfg.actor_rollout_ref.actor.kl_loss_coef = 0.0
        cfg.merge_with(OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()]))
    return cfg


def test_the_documented_setup_passes():
    settings = check_setup(config().actor_rollout_ref, "actor_rollout_ref")
    assert settings.sync_every == 4 and settings.reference == "sync"
    check_trainer_config(config(**{"actor_rollout_ref.actor.strategy": "fsdp2"}))
    # LoRA with the frozen reference (verl's adapter-disabled actor): clamp only, no sync
    lora = config(**{"actor_rollout_ref.model.lora_rank": 8, "actor_rollout_ref.actor.policy_loss.reference": "frozen"})
    check_setup(lora.actor_rollout_ref, "actor_rollout")
    # our fused log-probs with verl's entropy bonus: the entropy is differentiable
    # (tests/integrations/verl/test_verl_kernel.py)
    fused = config(**{"actor_rollout_ref.actor.policy_loss.fused_logprobs": True,
                      "actor_rollout_ref.model.use_fused_kernels": True, "actor_rollout_ref.actor.entropy_coeff": 0.01})
    fused.actor_rollout_ref.model.fused_kernel_options = {"impl_backend": "triton"}
    assert check_setup(fused.actor_rollout_ref, "actor_rollout_ref").fused_logprobs


@pytest.mark.parametrize("overrides, role, match", [
    ({"actor_rollout_ref.actor.use_kl_loss": False}, "actor_rollout_ref", "use_kl_loss must be True"),
    ({"actor_rollout_ref.actor.strategy": "megatron"}, "actor_rollout_ref", "strategy='megatron'"),
    ({"actor_rollout_ref.model.lora_rank": 8}, "actor_rollout", "reference='sync' with LoRA"),
    ({}, "actor", "needs the reference in the actor's process"),
    ({"actor_rollout_ref.actor.policy_loss.loss_mode": "vanilla"}, "actor_rollout_ref", "trains actor.policy_loss"),
    ({"actor_rollout_ref.actor.policy_loss.fused_logprobs": True}, "actor_rollout_ref", "impl_backend=triton"),
    ({"actor_rollout_ref.actor.policy_loss.base_loss_mode": "clip_cov"}, "actor_rollout_ref",
     "'clip_cov' has no humanline variant"),
])
def test_refused_setups_name_the_reason(overrides, role, match):
    plain = {k.lstrip("+"): v for k, v in overrides.items()}
    with pytest.raises(Exception, match=match):
        check_setup(config(**plain).actor_rollout_ref, role)


def test_the_trainer_refuses_bypass_mode():
    with pytest.raises(ValueError, match="bypass_mode=True rewrites policy_loss.loss_mode"):
        check_trainer_config(config(**{"algorithm.rollout_correction.bypass_mode": True}))


@pytest.mark.parametrize("mode", ["sync", "colocate_async"])
def test_registered_trainer_modes_use_the_humanline_worker(mode):
    cls = get_trainer_cls(f"humanline_{mode}")
    assert issubclass(cls, get_trainer_cls(mode))  # verl's own trainer for the rest of the step
    trainer = object.__new__(cls)  # only the worker mapping: no dataloader, Ray or TransferQueue
    trainer.config = config(**{"trainer.v1.trainer_mode": f"humanline_{mode}"})
    trainer.trainer_mode = trainer.config.trainer.v1.trainer_mode  # what verl's __init__ does
    assert trainer.trainer_mode == mode  # verl's `trainer_mode == "sync"` branches see the base mode
    trainer._init_resource_pool_mgr()
    worker = trainer.role_worker_mapping[Role.ActorRolloutRef]
    assert worker.__ray_actor_class__ is HumanlineActorRolloutRefWorker
    trainer.config = config(**{"actor_rollout_ref.actor.use_kl_loss": False})
    with pytest.raises(ValueError, match="use_kl_loss must be True"):
        trainer._init_resource_pool_mgr()
