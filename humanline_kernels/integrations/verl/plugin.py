"""Target of the ``verl.plugins`` entry point: ``import verl`` imports this module in every process.

It registers the ``humanline`` policy loss and, where verl's v1 trainer can be imported (it needs verl's
``TransferQueue``), the ``humanline_sync`` and ``humanline_colocate_async`` trainer modes. verl swallows a plugin's
exceptions (logged at debug level), so the loss is registered first and does not depend on the trainers.
"""
from __future__ import annotations

import importlib.util

from verl.trainer.ppo.core_algos import register_policy_loss

from ._loss import LOSS_MODE, humanline_policy_loss

register_policy_loss(LOSS_MODE)(humanline_policy_loss)

if importlib.util.find_spec("transfer_queue") is not None:
    from . import _trainer  # noqa: F401  (registers the trainer modes)
