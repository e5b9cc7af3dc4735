"""Humanline alignment in verl (``pip install humanline-kernels[verl]``; verl 0.9.1, see docs/verl.md).

* ``loss_mode='humanline'``: a registered verl policy loss (:func:`humanline_policy_loss`), configured by
  :class:`HumanlinePolicyLossConfig` in ``actor.policy_loss``; the ``verl.plugins`` entry point registers it in
  every verl process.
* :class:`HumanlineActorRolloutRefWorker`: verl's actor/rollout/reference worker with the reference log-probs
  handed to the loss and the reference synced from the actor every ``sync_every`` optimizer steps (in the worker,
  shard to shard, before the update); the ``humanline_sync`` / ``humanline_colocate_async`` trainer modes use it.
* :func:`rebind_linear_cross_entropy`: verl's fused-kernel forward on ``hk.fused_linear.token_logprobs``.

The worker and trainer modules are imported on first use (they pull in verl's engines and Ray).
"""
from __future__ import annotations

import importlib

from ._config import REFUSED_BASE_MODES, SUPPORTED_BASE_MODES, HumanlinePolicyLossConfig
from ._kernel import linear_cross_entropy
from ._kernel import rebind as rebind_linear_cross_entropy
from ._loss import humanline_policy_loss, humanline_ppo_loss, reference_log_probs

__all__ = ["HumanlinePolicyLossConfig", "SUPPORTED_BASE_MODES", "REFUSED_BASE_MODES", "humanline_policy_loss",
           "humanline_ppo_loss", "reference_log_probs", "linear_cross_entropy", "rebind_linear_cross_entropy",
           "HumanlineActorRolloutRefWorker", "HumanlineTrainingWorker", "HumanlineReference"]

_LAZY = {"HumanlineActorRolloutRefWorker": "._worker", "HumanlineTrainingWorker": "._worker",
         "HumanlineReference": "._reference"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
