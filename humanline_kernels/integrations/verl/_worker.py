"""``HumanlineActorRolloutRefWorker``: verl's hybrid worker with the humanline reference.

verl 0.9.1's ``ActorRolloutRefWorker`` (``verl/workers/engine_workers.py``) holds the actor and the reference as
two FSDP engines in one process, on the same device mesh; the reference is forward-only, CPU-offloaded and never
updated. This subclass, in ``init_model``:

* checks the setup (:func:`check_setup`: every refused combination is named with its reason);
* installs :func:`~humanline_kernels.integrations.verl.humanline_ppo_loss` as the actor's loss (verl's
  ``ppo_loss`` with ``ref_log_prob`` handed to the policy loss);
* attaches a :class:`~humanline_kernels.integrations.verl.HumanlineReference` to the actor
  (:class:`HumanlineTrainingWorker`), which syncs the reference every ``sync_every`` optimizer steps inside the
  actor update and recomputes ``ref_log_prob`` for a mini-batch that follows a sync of the same verl step;
* rebinds verl's fused-kernel ``linear_cross_entropy`` to ours when ``policy_loss.fused_logprobs``.

The trainer modes ``humanline_sync`` / ``humanline_colocate_async`` (``_trainer.py``) put this worker in place of
verl's; nothing else in the step changes, so the sync needs no call from the trainer.
"""
from __future__ import annotations

import os
import warnings
from functools import partial

from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

from ...sync._state import STATE_FILE, _atomic, _dist, _dump_json, has_humanline_state
from ._config import HumanlinePolicyLossConfig
from ._kernel import rebind
from ._loss import LOSS_MODE, humanline_ppo_loss
from ._reference import HumanlineReference

__all__ = ["HumanlineActorRolloutRefWorker", "HumanlineTrainingWorker", "check_setup", "uses_lora", "HUMANLINE_DIR",
           "HUMANLINE_MARKER"]

HUMANLINE_DIR = "humanline"  # beside verl's files in the actor's checkpoint folder
HUMANLINE_MARKER = "humanline_run.json"  # beside it: this checkpoint is a humanline run's


def _write_marker(local_path):
    if _dist()[0] == 0:
        os.makedirs(local_path, exist_ok=True)
        _atomic(os.path.join(local_path, HUMANLINE_MARKER), lambda tmp: _dump_json(tmp, {"reference": "sync"}))


class HumanlineTrainingWorker(TrainingWorker):
    """verl's ``TrainingWorker`` (the actor) with a :class:`HumanlineReference` around each optimizer step."""

    humanline: HumanlineReference | None = None

    def train_mini_batch(self, data):
        if self.humanline is not None:
            self.humanline.begin_update()
        return super().train_mini_batch(data)

    def train_batch(self, data):
        if self.humanline is not None:
            self.humanline.before_step(data)
        return super().train_batch(data)


def uses_lora(model_config) -> bool:
    """verl's own test for a LoRA actor whose reference is the adapter-disabled actor (``ref_in_actor``)."""
    rank = model_config.get("lora", {}).get("rank", 0)
    if rank <= 0:
        rank = model_config.get("lora_rank", 0)
    return rank > 0 or model_config.get("lora_adapter_path") is not None


def check_setup(config, role: str) -> HumanlinePolicyLossConfig:
    """Validate ``actor_rollout_ref`` for the humanline worker in ``role``; return the policy-loss settings."""
    actor = config.actor
    if actor.policy_loss.get("loss_mode") != LOSS_MODE:
        raise ValueError(f"the humanline worker trains actor.policy_loss.loss_mode='{LOSS_MODE}', got "
                         f"{actor.policy_loss.get('loss_mode')!r}")
    settings = omega_conf_to_dataclass(actor.policy_loss)
    if not isinstance(settings, HumanlinePolicyLossConfig):
        raise ValueError("actor.policy_loss._target_ must be humanline_kernels.integrations.verl."
                         f"HumanlinePolicyLossConfig, got {type(settings).__name__}")
    if not actor.use_kl_loss:
        raise ValueError("actor.use_kl_loss must be True: verl computes the reference log-probs (ref_log_prob) "
                         "only then (set actor.kl_loss_coef=0 for no KL term)")
    if actor.strategy not in ("fsdp", "fsdp2"):
        raise ValueError(f"actor.strategy={actor.strategy!r}: the humanline reference sync copies FSDP shards; "
                         "megatron, veomni and torchtitan engines are not supported")
    if settings.reference == "sync":
        if uses_lora(config.model):
            raise ValueError("policy_loss.reference='sync' with LoRA: verl's reference is then the actor with its "
                             "adapter disabled (ref_in_actor); a synced reference adapter would need a second adapter "
                             "created before FSDP wraps the PEFT model, which verl 0.9.1's engine does not expose. "
                             "Use full fine-tuning, or reference='frozen' (the clamp against the base model)")
        if "actor" in role and "ref" not in role:
            raise ValueError(f"policy_loss.reference='sync' needs the reference in the actor's process (worker role "
                             f"'actor_rollout_ref'), got role {role!r} (a separate reference worker group, as the "
                             "separate-async trainer builds it)")
    if settings.fused_logprobs:
        model = config.model
        backend = (model.get("fused_kernel_options") or {}).get("impl_backend")
        if not model.get("use_fused_kernels", False) or backend != "triton":
            raise ValueError("policy_loss.fused_logprobs replaces verl's Triton fused kernel: set "
                             "model.use_fused_kernels=True and model.fused_kernel_options.impl_backend=triton")
    return settings


class HumanlineActorRolloutRefWorker(ActorRolloutRefWorker):
    """``ActorRolloutRefWorker`` whose actor trains ``loss_mode='humanline'`` against a synced reference."""

    actor_worker_cls = HumanlineTrainingWorker

    def __init__(self, config, role, distillation_config=None, **kwargs):
        super().__init__(config, role, distillation_config=distillation_config, **kwargs)
        if self.distillation_enabled:
            raise ValueError("distillation with loss_mode='humanline': the humanline worker wraps ppo_loss, verl's "
                             "distillation_ppo_loss is not wrapped")
        self.humanline_settings = check_setup(config, role) if "actor" in role else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        settings = self.humanline_settings
        if settings is not None and settings.fused_logprobs:
            rebind()  # before any forward; the reference's forwards in this process use it too
        super().init_model()
        if settings is None:
            return
        actor_config = self.loss_fn.keywords["config"]  # the ActorConfig verl's ppo_loss was bound to
        self.loss_fn = partial(humanline_ppo_loss, config=actor_config)
        self.actor.set_loss_fn(self.loss_fn)
        if self.ref is not None:
            self.actor.humanline = HumanlineReference(self.actor, self.ref, every=settings.sync_every,
                                                      sync=settings.reference == "sync",
                                                      save_reference=settings.save_reference)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sync_reference(self):
        """Copy the actor into the reference now, on every rank, outside the every-k schedule (a custom trainer's
        override; the schedule itself runs inside ``update_actor``)."""
        if self.actor is not None and self.actor.humanline is not None:
            self.actor.humanline.sync_now()

    # verl 0.9.1's checkpoint manager (FSDPCheckpointManager) saves the actor's model, optimizer and extra state
    # (scheduler, RNG) per rank and has no hook for more; the reference it never saves (it reloads the initial
    # model). So the worker writes the humanline state into <local_path>/humanline itself: before verl's own files,
    # and so before verl's trainer points latest_checkpointed_iteration.txt at this step and before an old
    # checkpoint is removed (max_ckpt_to_keep), which takes the folder with it. A marker file beside that folder
    # (HUMANLINE_MARKER) says the checkpoint is a humanline run's, also once the folder is lost.
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        humanline = self.actor.humanline if self.actor is not None else None
        if local_path is not None and humanline is not None and humanline.syncer is not None:
            _write_marker(local_path)
            humanline.save_state(os.path.join(local_path, HUMANLINE_DIR))
        super().save_checkpoint(local_path, hdfs_path, global_step, max_ckpt_to_keep)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
        super().load_checkpoint(local_path, hdfs_path, del_local_after_load)
        humanline = self.actor.humanline if self.actor is not None else None
        if humanline is None or humanline.syncer is None:
            return
        folder = os.path.join(local_path, HUMANLINE_DIR)
        if has_humanline_state(folder):
            humanline.load_state(folder)
            return
        marker = os.path.join(local_path, HUMANLINE_MARKER)
        if os.path.isfile(marker):
            raise ValueError(
                f"humanline verl worker: {os.path.join(folder, STATE_FILE)} is missing, but {marker} marks the "
                "checkpoint as a humanline run's: its reference as of the last sync cannot be rebuilt, and resuming "
                f"would train against another one. Restore {folder}, resume from another checkpoint, or start over "
                f"deliberately: delete {marker} to resume with the reference restarted from the actor (warned)")
        # a checkpoint of verl's own worker (or of this package before 0.2): no reference to restore
        warnings.warn(f"humanline verl worker: {folder} holds no humanline state; the reference restarts from the "
                      "resumed actor and the sync counter from 0: not the run that never stopped", UserWarning,
                      stacklevel=2)
        humanline.sync_now()
