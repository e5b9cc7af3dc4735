"""The options of one call as one frozen object, and the loss's extra tensors as one named tuple.

A public function builds its loss's params from its keywords (the same keywords at every input level), checks
them once (:mod:`._validation`), and hands the object down whole: to the ``autograd.Function``, to the
fused-linear driver, to the kernels' launchers, which hand its fields on by name, as scalars only where a kernel
or a ``torch.library`` op needs scalars (``clip.log_eps_p`` is ``log_eps_p`` down to the kernel). The tensors a loss
needs besides the log-probs (advantages, the KTO labels and KL rows, ...) travel as the loss's :attr:`Loss.Inputs`
tuple.

A new objective adds a params class here (its keywords), its math in :mod:`humanline_kernels.losses` and its
ground truth in :mod:`humanline_kernels.reference`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Optional

from torch import Tensor

from ._clip import DEFAULT_CLIP, HumanlineClip
from .ops.constants import Aggregation, Terms

# TRL 1.16's GRPO loss types, every one at the log-prob level (hk.reference, hk.losses)
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
# the ones the kernels aggregate (the logits and hidden-state levels), and how: over tokens (dapo, bnpo), the mean of
# the row means (grpo), over a fixed count (dr_grpo)
GRPO_AGGREGATION = {"dapo": Aggregation.TOKENS, "bnpo": Aggregation.TOKENS, "grpo": Aggregation.ROWS,
                    "dr_grpo": Aggregation.FIXED}

# the metrics of each loss's finalize, in the order of the kernel's ``metrics`` tensor
METRICS = {
    "dpo": ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy", "unclipped_frac"),
    "kto": ("kl", "rewards_desirable", "rewards_undesirable", "unclipped_frac"),
    "grpo": ("unclipped_frac", "kl", "clip_frac_low", "clip_frac_high"),
    "sequence": ("unclipped_frac", "n_tokens", "n_unclipped"),
}


def named_metrics(name, met):
    """The API's metrics dict of a finalize kernel's ``metrics`` tensor (0-d views, in :data:`METRICS` order)."""
    return dict(zip(METRICS[name], met.unbind(0)))


def options(spec):
    """The defaults of a public function's loss options, written once: the params class ``spec`` (its dataclass
    fields' defaults) fills every keyword-only parameter that the function's signature lists without a default, so
    ``hk.losses``, ``hk.fused`` and ``hk.fused_linear`` name the same options and share one set of defaults. A
    keyword that ``spec`` has must not restate a default of its own; one that it lacks (a level's own, e.g.
    ``validate``) must have one."""
    fields = {f.name: f for f in dataclasses.fields(spec)}

    def stamp(fn):
        code = fn.__code__
        kwonly = code.co_varnames[code.co_argcount:code.co_argcount + code.co_kwonlyargcount]
        given = dict(fn.__kwdefaults__ or {})
        for name in kwonly:
            field = fields.get(name)
            if field is not None and name in given:
                raise TypeError(f"{fn.__qualname__}: {name}'s default is {spec.__name__}'s, not written again here")
            if field is None and name not in given:
                raise TypeError(f"{fn.__qualname__}: {name} has no default and {spec.__name__} has no such option")
            if field is not None:
                given[name] = field.default
        fn.__kwdefaults__ = given
        return fn
    return stamp


@dataclass(frozen=True, kw_only=True)
class Tokens:
    """Options of the per-token log-probs: ``log_softmax(logits / temperature)[label]``, 0 where ignored."""

    temperature: float = 1.0
    ignore_index: int = -100


class NoInputs(NamedTuple):
    pass


class DPOInputs(NamedTuple):
    log_sum_sq_probs: Optional[Tensor] = None  # per-token log sum_v p_v^2 (WPO, at the log-prob level only)


class KTOInputs(NamedTuple):
    desirable: Tensor
    kl_logps: Optional[Tensor] = None
    kl_ref_logps: Optional[Tensor] = None
    kl_mask: Optional[Tensor] = None
    z0: Optional[Tensor] = None  # the baseline when known beforehand (all-reduced across ranks)


class GRPOInputs(NamedTuple):
    advantages: Tensor
    kl_ref_logps: Optional[Tensor] = None
    normalizer: Optional[Tensor] = None  # a tensor normalizer (a number travels in the params)
    # TRL 1.16's per-token inputs, at the log-prob level only (hk.losses.grpo): the vLLM importance weight ([B, T],
    # [B, 1] or [B]), the tool-output mask, the sampler's log-probs (off-policy mask), the policy's entropies and a
    # caller's high-entropy mask
    importance_sampling_ratio: Optional[Tensor] = None
    tool_mask: Optional[Tensor] = None
    sampling_per_token_logps: Optional[Tensor] = None
    entropies: Optional[Tensor] = None
    entropy_mask: Optional[Tensor] = None


@dataclass(frozen=True, kw_only=True)
class Loss(Tokens):
    """Options every loss has. ``name`` keys the finalize kernel and the metrics; ``mode`` the row kernel's."""

    clip: Optional[HumanlineClip] = DEFAULT_CLIP
    name: ClassVar[str]
    mode: ClassVar[Terms] = Terms.RATIO
    Inputs: ClassVar[type] = NoInputs
    # whether the loss needs ref_logps (the sequence-level primitive takes None as a reference of 0; SimPO and SLiC
    # have none)
    needs_ref: ClassVar[bool] = True


@dataclass(frozen=True, kw_only=True)
class DPO(Loss):
    """DPO and TRL 1.16's DPO loss types (``hk.reference.dpo`` documents each keyword)."""

    beta: float = 0.1
    label_smoothing: float = 0.0
    loss_type: object = "sigmoid"  # a name or a tuple of names
    loss_weights: Optional[tuple] = None
    rpo_alpha: Optional[float] = None
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    ld_alpha: Optional[float] = None
    discopop_tau: float = 0.05
    use_weighting: bool = False
    name: ClassVar[str] = "dpo"
    Inputs: ClassVar[type] = DPOInputs

    def __post_init__(self):
        # a list of loss types (TRL's config form) is kept as a tuple: params are hashable, torch.compile constants
        for name in ("loss_type", "loss_weights"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def fast(self) -> bool:
        """Whether the DPO finalize kernel computes this loss (sigmoid / cDPO on plain sums) rather than the
        sequence-level primitive and the batch math of :mod:`humanline_kernels._objectives`."""
        return (self.loss_type in ("sigmoid", ("sigmoid",)) and self.loss_weights in (None, (1.0,))
                and self.rpo_alpha is None and self.f_divergence_type == "reverse_kl" and self.ld_alpha is None
                and not self.use_weighting)


@dataclass(frozen=True, kw_only=True)
class KTO(Loss):
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    loss_type: str = "kto"  # or "apo_zero_unpaired" (no baseline)
    kl_estimate: str = "halos"  # z0 from the KL rows: HALOs' (non-empty rows) or TRL's (every row)
    name: ClassVar[str] = "kto"
    Inputs: ClassVar[type] = KTOInputs


@dataclass(frozen=True, kw_only=True)
class SequenceLoss(Loss):
    """An objective on per-sequence sums: no clipping unless asked for (DESIGN's default for these)."""

    clip: Optional[HumanlineClip] = None


@dataclass(frozen=True, kw_only=True)
class Sequence(SequenceLoss):
    """The sequence-level primitive: ``(s, policy_sums, metrics)``."""

    normalize: bool = False
    name: ClassVar[str] = "sequence"
    needs_ref: ClassVar[bool] = False


@dataclass(frozen=True, kw_only=True)
class IPO(SequenceLoss):
    beta: float = 0.1
    name: ClassVar[str] = "ipo"


@dataclass(frozen=True, kw_only=True)
class SimPO(SequenceLoss):
    beta: float = 2.0
    gamma_beta_ratio: float = 0.25
    name: ClassVar[str] = "simpo"
    needs_ref: ClassVar[bool] = False


@dataclass(frozen=True, kw_only=True)
class SLiC(SequenceLoss):
    beta: float = 1.0
    lambda_coef: float = 0.1
    name: ClassVar[str] = "slic"
    needs_ref: ClassVar[bool] = False


@dataclass(frozen=True, kw_only=True)
class GRPO(Loss):
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    loss_type: str = "dapo"
    normalizer: Optional[float] = None  # a number; a tensor normalizer travels in GRPOInputs
    max_completion_length: Optional[int] = None
    # TRL 1.16's other GRPO options (hk.reference.grpo documents each); the defaults are the kernels' loss, and the
    # logits and hidden-state levels take none of them
    importance_sampling_level: str = "token"
    delta: Optional[float] = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: Optional[float] = None
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    use_adaptive_entropy: bool = False
    entropy_target: float = 0.2
    last_world_entropy: float = math.inf
    use_bias_correction_kl: bool = False
    name: ClassVar[str] = "grpo"
    mode: ClassVar[Terms] = Terms.GRPO
    Inputs: ClassVar[type] = GRPOInputs

    @classmethod
    def of(cls, *, normalizer, **options):
        """``(params, tensor normalizer or None)``: a number normalizer travels in the params, a tensor as an input
        (:class:`GRPOInputs`)."""
        tensor = normalizer if isinstance(normalizer, Tensor) else None
        return cls(normalizer=None if tensor is not None else normalizer, **options), tensor

    @property
    def aggregation(self) -> Aggregation:
        """How the GRPO finalize kernel aggregates this ``loss_type`` (one the kernels compute)."""
        return GRPO_AGGREGATION[self.loss_type]

    @property
    def vespo(self) -> dict:
        """VESPO's four ``k`` / ``lambda`` values by keyword (what ``grpo_vespo_weights`` and the checks take)."""
        return {k: getattr(self, k) for k in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")}
