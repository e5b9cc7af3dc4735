"""Target of the ``verl.plugins`` entry point: ``import verl`` imports this module in every process.

It registers the ``humanline`` policy loss (``actor.policy_loss.loss_mode=humanline``).
"""
from __future__ import annotations

from verl.trainer.ppo.core_algos import register_policy_loss

from ._loss import LOSS_MODE, humanline_policy_loss

register_policy_loss(LOSS_MODE)(humanline_policy_loss)
