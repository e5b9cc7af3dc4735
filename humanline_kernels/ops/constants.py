"""Constants shared by the kernels, their launchers, the checks and the integrations (defined here only)."""
from __future__ import annotations

import os as _os

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


# Selectable kernel paths (issue 53), read at call time; the environment sets them at import.
# FOLD_FINALIZE: a logits-level DPO / KTO / GRPO forward in one launch, the finalize folded into the row kernel as a
# deterministic last-arrival reduction (ops/finalize/folded.py). The default since run 5 (H100, bench/NOTES.md)
# checked what the interpreter cannot, the memory ordering between programs (tests/test_fold.py's GPU test: 20 calls
# bit-equal, counters zero, errors against float64 no larger than the previous path's), with parity 48/48 and
# CUDA-graph capture. HK_FOLD_FINALIZE=0: the previous path, the row kernel and then a one-program finalize launch.
FOLD_FINALIZE = _os.environ.get("HK_FOLD_FINALIZE", "1") != "0"
# FOLD_ROW_WARPS_PER_SM (HK_FOLD_ROW_WARPS_PER_SM): the folded row kernels' register budget leaves room for this many
# warps an SM (28: 7 programs of 4 warps, 72 registers; run 8, H200: KTO's kernel at 90 registers, 5 programs, read
# at 82 % of the DRAM peak against DPO's 89 % at 72). 4 (one program) restores the budget before run 8 (248).
FOLD_ROW_WARPS_PER_SM = int(_os.environ.get("HK_FOLD_ROW_WARPS_PER_SM", "28"))
# GIF_PERSISTENT: with FOLD_FINALIZE, GRPO's gradient in the forward on a persistent grid (GIF_PROGRAMS_PER_SM
# programs an SM of GIF_WARPS warps walk the rows, so that the rows in flight stay in L2 for the gradient's second
# sweep); False (HK_GIF_PERSISTENT=0): one program a row.
GIF_PERSISTENT = _os.environ.get("HK_GIF_PERSISTENT", "1") != "0"
GIF_PROGRAMS_PER_SM = int(_os.environ.get("HK_GIF_PROGRAMS_PER_SM", "1"))
# GIF_PROGRAMS (HK_GIF_PROGRAMS): the persistent grid's size when > 0, in place of SMs x GIF_PROGRAMS_PER_SM: fewer
# rows in flight, for the L2 to hold (run 5, H100: 132 rows of 256 KB did not stay; `bench logits --gif-programs`)
GIF_PROGRAMS = int(_os.environ.get("HK_GIF_PROGRAMS", "0"))
GIF_WARPS = int(_os.environ.get("HK_GIF_WARPS", "16"))
GIF_BYTES_PER_THREAD = int(_os.environ.get("HK_GIF_BYTES_PER_THREAD", "32"))
