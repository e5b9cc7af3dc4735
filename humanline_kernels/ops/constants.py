"""The kernels' modes and layouts, shared by their launchers and the layers above (importable without Triton; the
API's names are :mod:`humanline_kernels._params`'). A launch passes a mode as ``int(mode)``; the kernels compare it
with the constexpr mirrors in :mod:`.common` and :mod:`.grpo`."""
from __future__ import annotations

from enum import IntEnum


class Terms(IntEnum):
    """What the row kernel (:mod:`.token_terms`) computes per token: the clipped log-ratio (DPO, KTO, the
    sequence-level primitive) or GRPO's per-token term (its ``MODE``)."""

    RATIO = 1
    GRPO = 2


# the row kernel's aux planes ([p < D < r]; then the policy's log-prob and two zero planes, or GRPO's low / high clip
# indicators and k3, and GRPO's policy log-prob) and the plane of the policy's log-prob, which the kernel paths
# differentiate the loss's other [B, T] inputs at (losses.input_grads)
AUX_PLANES = {Terms.RATIO: 4, Terms.GRPO: 5}
LOGP_PLANE = {Terms.RATIO: 1, Terms.GRPO: 4}


class Aggregation(IntEnum):
    """How the GRPO tail aggregates the per-token terms: over the tokens, the mean of the row means, over a fixed
    count (its ``aggregation``)."""

    TOKENS = 0
    ROWS = 1
    FIXED = 2


class Normalizer(IntEnum):
    """What divides the tokens' sum (``Aggregation.TOKENS``): their count, a number, or a tensor read on the device."""

    COUNT = 0
    NUMBER = 1
    TENSOR = 2


class GradInForward(IntEnum):
    """GRPO's gradient in the forward in the one-launch kernel (its ``GRAD``): none, or on the persistent grid with
    each row's weight (from the weights-only tail launched first) or the weight every row shares (found in the
    kernel)."""

    NONE = 0
    ROW_WEIGHTS = 2
    SHARED_WEIGHT = 3


# the metrics each tail kernel writes into its ``metrics`` tensor (their names, in that order: _params.METRICS)
N_METRICS = {"dpo": 5, "kto": 4, "grpo": 4, "sequence": 3}
