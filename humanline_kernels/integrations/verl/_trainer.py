"""Trainer modes ``humanline_sync`` and ``humanline_colocate_async`` for verl's v1 trainer.

``trainer.v1.trainer_mode`` picks a class from verl's trainer registry (``verl/trainer/ppo/v1/trainer_base.py``);
these two are verl's ``sync`` and ``colocate_async`` trainers with :class:`HumanlineActorRolloutRefWorker` in
place of ``ActorRolloutRefWorker`` (the v1 trainer names that class in ``_init_resource_pool_mgr``) and the
setup checked on the driver before any worker starts. The reference sync itself runs inside the workers' actor
update, so the step loop is verl's own. verl's ``separate_async`` mode is not offered: it keeps the reference in a
worker group of its own, out of reach of the actor's shards. The legacy trainer (``trainer.use_v1=False``) has no
registry; with it, ``loss_mode='humanline'`` fails at its first loss call, naming the missing worker.
"""
from __future__ import annotations

import ray
from verl.trainer.ppo.utils import Role
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from ._worker import HumanlineActorRolloutRefWorker, check_setup, uses_lora

__all__ = ["HumanlinePPOTrainerSync", "HumanlinePPOTrainerColocateAsync", "check_trainer_config"]

_WORKER_ROLES = (Role.ActorRolloutRef, Role.ActorRollout, Role.Actor, Role.RefPolicy)


def check_trainer_config(config) -> None:
    """The driver-side checks: what only the whole config shows, then the worker's own checks."""
    rollout_correction = config.algorithm.get("rollout_correction") or {}
    if rollout_correction.get("bypass_mode", False):
        raise ValueError("algorithm.rollout_correction.bypass_mode=True rewrites policy_loss.loss_mode to "
                         "'bypass_mode' (old_log_prob = rollout log-probs); use the decoupled mode, whose "
                         "rollout_is_weights the humanline loss applies")
    role = "actor_rollout" if uses_lora(config.actor_rollout_ref.model) else "actor_rollout_ref"
    check_setup(config.actor_rollout_ref, role)


class _HumanlineWorkers:
    """Mixin: verl's worker mapping with the humanline worker in place of ``ActorRolloutRefWorker``.

    verl's trainer also branches on ``self.trainer_mode == "sync"`` (its replay buffer, refills, checkpoints), set
    from ``trainer.v1.trainer_mode``: here it reads as the mode this trainer is a humanline variant of.
    """

    base_mode: str = ""

    @property
    def trainer_mode(self) -> str:
        return self.base_mode

    @trainer_mode.setter
    def trainer_mode(self, name) -> None:
        pass  # verl assigns "humanline_<mode>" from the config; every branch must see "<mode>"

    def _init_resource_pool_mgr(self):
        check_trainer_config(self.config)
        super()._init_resource_pool_mgr()
        for role in _WORKER_ROLES:
            if role in self.role_worker_mapping:
                self.role_worker_mapping[role] = ray.remote(HumanlineActorRolloutRefWorker)


@register_trainer("humanline_sync")
class HumanlinePPOTrainerSync(_HumanlineWorkers, PPOTrainerSync):
    """verl's ``sync`` trainer with the humanline reference."""

    base_mode = "sync"


@register_trainer("humanline_colocate_async")
class HumanlinePPOTrainerColocateAsync(_HumanlineWorkers, PPOTrainerColocateAsync):
    """verl's ``colocate_async`` trainer with the humanline reference."""

    base_mode = "colocate_async"
