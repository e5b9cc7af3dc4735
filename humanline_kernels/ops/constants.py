"""The kernels' modes and layouts, shared by their launchers and the layers above (importable without Triton; the
API's names are :mod:`humanline_kernels._params`')."""
from __future__ import annotations

# what the row kernel (ops.token_terms) computes per token: the clipped log-ratio (DPO, KTO, the sequence-level
# primitive) or GRPO's per-token term
MODE_RATIO, MODE_GRPO = 1, 2
# the row kernel's aux planes ([p < D < r]; then the policy's log-prob and two zero planes, or GRPO's low / high clip
# indicators and k3, and GRPO's policy log-prob) and the plane of the policy's log-prob, which the kernel paths
# differentiate the loss's other [B, T] inputs at (losses.input_grads)
AUX_PLANES = {MODE_RATIO: 4, MODE_GRPO: 5}
LOGP_PLANE = {MODE_RATIO: 1, MODE_GRPO: 4}

# how the GRPO finalize kernel aggregates: over tokens, the mean of the row means, over a fixed count
AGG_TOKENS, AGG_ROWS, AGG_FIXED = 0, 1, 2

# the metrics each finalize kernel writes into its ``metrics`` tensor (their names, in that order: _params.METRICS)
N_METRICS = {"dpo": 5, "kto": 4, "grpo": 4, "sequence": 3}
