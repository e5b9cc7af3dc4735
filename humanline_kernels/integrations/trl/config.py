"""The humanline trainers' configs: TRL's configs plus one shared set of fields, checked once."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from trl import DPOConfig, GRPOConfig, KTOConfig

from ..._clip import HumanlineClip
from ..._validation import check_real
from .._head import FUSED_MODES

__all__ = ["HumanlineDPOConfig", "HumanlineKTOConfig", "HumanlineGRPOConfig", "hk_settings", "reference_mode"]

REFERENCE_MODES = ("sync", "lookahead")


def _hk_field(default, help_):
    return field(default=default, metadata={"help": help_})


@dataclass
class _HumanlineFields:
    """The fields every humanline config adds to TRL's, and their checks (after TRL's own ``__post_init__``)."""

    humanline: bool = _hk_field(True, "Humanline clipping and pre-update reference syncing (False: plain objective).")
    log_eps_p: float = _hk_field(-1.5, "Lower end of the per-token log-ratio clip band (paper: -1.5).")
    log_eps_r: float = _hk_field(1.5, "Upper end of the per-token log-ratio clip band (paper: 1.5).")
    sync_every: int = _hk_field(1, "Sync the reference from the policy every this many optimizer steps.")
    fused: str = _hk_field("linear", "Per-token log-probs: 'linear' (hidden+lm_head), 'logits' or 'off' (TRL's).")
    save_reference: bool = _hk_field(
        True, "Save the humanline state in every checkpoint with the reference's weights (False: the schedule only; "
        "a resume then restarts the reference from the resumed policy, not exactly the uninterrupted run).")
    humanline_reference: str = _hk_field(
        "sync", "'sync': a reference model synced from the policy; 'lookahead': no reference model, the policy "
        "computes the reference log-probs of the coming steps' batches at each sync step (GRPO: from the generation "
        "buffer).")

    def __post_init__(self):
        super().__post_init__()
        hk_settings(self)
        reference_mode(self, type(self).__name__)


def hk_settings(args):
    """Validated ``(humanline, clip, sync_every, fused)`` from a humanline config or a plain TRL config."""
    humanline = getattr(args, "humanline", True)
    if not isinstance(humanline, bool):
        raise ValueError(f"humanline must be a bool, got {humanline!r}")
    clip = HumanlineClip(getattr(args, "log_eps_p", -1.5), getattr(args, "log_eps_r", 1.5))
    every = getattr(args, "sync_every", 1)
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"sync_every must be a positive int, got {every!r}")
    save_reference = getattr(args, "save_reference", True)
    if not isinstance(save_reference, bool):
        raise ValueError(f"save_reference must be a bool, got {save_reference!r}")
    fused = getattr(args, "fused", "linear")
    if fused not in FUSED_MODES:
        raise ValueError(f"fused must be one of {FUSED_MODES}, got {fused!r}")
    return humanline, (clip if humanline else None), every, fused


def reference_mode(args, name):
    """Validated ``humanline_reference`` ("sync" or "lookahead") from a humanline or a plain TRL config."""
    mode = getattr(args, "humanline_reference", "sync")
    if mode not in REFERENCE_MODES:
        raise ValueError(f"{name}: humanline_reference must be one of {REFERENCE_MODES}, got {mode!r}")
    if mode == "lookahead" and not getattr(args, "humanline", True):
        raise ValueError(f"{name}: humanline_reference='lookahead' needs humanline=True (with humanline off the "
                         "reference is the fixed initial model; use humanline_reference='sync')")
    if mode == "lookahead" and isinstance(args, GRPOConfig):
        grpo_lookahead_check(args, name)
    return mode


def grpo_lookahead_check(args, name):
    """GRPO's lookahead needs the coming steps' completions before the sync step's update: a generation batch that
    spans whole optimizer steps, at least two (TRL's buffer then holds the next steps' micro-batches)."""
    accum = args.gradient_accumulation_steps
    spg = args.steps_per_generation or accum  # (None before TRL's own __post_init__ has set it)
    span = spg * args.num_iterations  # micro-batches per generation
    if span % accum or span < 2 * accum:
        raise ValueError(
            f"{name}: humanline_reference='lookahead' computes, at each sync step and before its update, the "
            "reference log-probs of the next steps' micro-batches from TRL's generation buffer; here a generation "
            f"batch spans {span} micro-batches (steps_per_generation * num_iterations) for {accum} per optimizer "
            "step (gradient_accumulation_steps), so the next step's completions do not exist yet at that point "
            "(they are sampled by the updated policy). Sample every N >= 2 optimizer steps (steps_per_generation * "
            "num_iterations a multiple of gradient_accumulation_steps, at least twice it), or use "
            "humanline_reference='sync'.")


@dataclass
class HumanlineDPOConfig(_HumanlineFields, DPOConfig):
    """``trl.DPOConfig`` plus ``humanline``, ``log_eps_p``, ``log_eps_r``, ``sync_every``, ``fused``,
    ``save_reference``, ``humanline_reference`` and ``rpo_alpha`` (RPO's NLL weight: the same loss as TRL 1.16's
    spelling, ``"sft"`` appended to ``loss_type`` with this weight appended to ``loss_weights``)."""

    rpo_alpha: Optional[float] = _hk_field(
        None, "RPO: add the chosen completions' mean NLL with this weight (TRL 1.16's loss_type=[..., 'sft'], "
        "loss_weights=[..., rpo_alpha]); None: no NLL term.")

    def __post_init__(self):
        super().__post_init__()
        if self.rpo_alpha is not None:  # (a field of ours: checked with the others, at construction)
            check_real("rpo_alpha", self.rpo_alpha, low=0.0)


@dataclass
class HumanlineKTOConfig(_HumanlineFields, KTOConfig):
    """``trl.KTOConfig`` plus ``humanline``, ``log_eps_p``, ``log_eps_r``, ``sync_every``, ``fused``,
    ``save_reference``, ``humanline_reference``."""


@dataclass
class HumanlineGRPOConfig(_HumanlineFields, GRPOConfig):
    """``trl.GRPOConfig`` plus ``humanline``, ``log_eps_p``, ``log_eps_r``, ``sync_every``, ``fused``,
    ``save_reference``, ``humanline_reference`` ("lookahead" with a generation batch spanning at least two optimizer
    steps)."""
