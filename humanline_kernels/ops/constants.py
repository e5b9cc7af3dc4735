"""Constants shared by the kernels, their launchers, the checks and the integrations (defined here only)."""
from __future__ import annotations

# what the row kernel (ops.token_terms) computes per token: the clipped log-ratio (DPO, KTO, the sequence-level
# primitive) or GRPO's per-token term
MODE_RATIO, MODE_GRPO = 1, 2
# the row kernel's aux planes ([p < D < r]; then the policy's log-prob and two zero planes, or GRPO's low / high clip
# indicators and k3, and GRPO's policy log-prob) and the plane of the policy's log-prob, which the kernel paths
# differentiate the loss's other [B, T] inputs at (losses.input_grads)
AUX_PLANES = {MODE_RATIO: 4, MODE_GRPO: 5}
LOGP_PLANE = {MODE_RATIO: 1, MODE_GRPO: 4}

# TRL 1.16's GRPO loss types, every one at the log-prob level (hk.reference, hk.losses)
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
# the ones the kernels aggregate (the logits and hidden-state levels), and how the GRPO finalize kernel does: over
# tokens (dapo, bnpo), the mean of the row means (grpo), over a fixed count (dr_grpo)
AGG_TOKENS, AGG_ROWS, AGG_FIXED = 0, 1, 2
GRPO_AGGREGATION = {"dapo": AGG_TOKENS, "bnpo": AGG_TOKENS, "grpo": AGG_ROWS, "dr_grpo": AGG_FIXED}

# the metrics a finalize kernel writes, in the order of its ``metrics`` tensor
METRICS = {
    "dpo": ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy", "unclipped_frac"),
    "kto": ("kl", "rewards_desirable", "rewards_undesirable", "unclipped_frac"),
    "grpo": ("unclipped_frac", "kl", "clip_frac_low", "clip_frac_high"),
    "sequence": ("unclipped_frac", "n_tokens", "n_unclipped"),
}


def named_metrics(name, met):
    """The API's metrics dict of a finalize kernel's ``metrics`` tensor (0-d views, in :data:`METRICS` order)."""
    return dict(zip(METRICS[name], met.unbind(0)))
