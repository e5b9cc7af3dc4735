"""Integrations: a transformers ``TrainerCallback`` and humanline DPO/KTO/GRPO trainers for TRL.

``hk.integrations.transformers.HumanlineSyncCallback`` syncs any ``transformers.Trainer``'s reference model;
``hk.integrations.trl.Humanline{DPO,KTO,GRPO}Trainer`` are drop-in TRL trainers (see docs/integrations.md);
``hk.integrations.verl`` registers humanline in verl (an optional extra with an environment of its own, docs/verl.md).
Submodules are imported on first use so that ``import humanline_kernels`` does not pull in transformers/TRL.
"""
from __future__ import annotations

import importlib

__all__ = ["transformers", "trl", "verl"]


def __getattr__(name):
    if name in __all__:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
