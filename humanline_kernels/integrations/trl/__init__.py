"""Humanline DPO / KTO / GRPO trainers for TRL (tested against TRL >=1.16,<1.17).

Switch an existing run by changing the trainer class and the config class, and setting three fields::

    from humanline_kernels.integrations.trl import HumanlineDPOConfig, HumanlineDPOTrainer
    args = HumanlineDPOConfig(..., humanline=True, sync_every=1, log_eps_p=-1.5)   # log_eps_r=1.5 by default
    trainer = HumanlineDPOTrainer(model, ref_model=None, args=args, train_dataset=ds, processing_class=tok)

Config fields (also read from a plain TRL config, with these defaults):

* ``humanline`` (True): clamp each token's log-ratio to ``[log_eps_p, log_eps_r]`` and sync the reference from the
  policy every ``sync_every`` optimizer steps, before the update (:class:`~.transformers.HumanlineSyncCallback`).
  False gives the plain objective through the same code path (equal to TRL's stock trainer).
* ``log_eps_p`` (-1.5), ``log_eps_r`` (1.5): the clip band (the paper's; HALOs' repository defaults P to -1.0).
* ``sync_every`` (1): k; the paper uses 1 for instruction following, 12-24 for math GRPO.
* ``fused`` ("linear"): how per-token log-probs are computed. "linear": hidden states and lm_head weight through
  :mod:`humanline_kernels.fused_linear`, inside the model's forward; "logits": the model's logits through
  :func:`humanline_kernels.token_logprobs`; "off": TRL's own chunked log-prob head. The loss is always
  :mod:`humanline_kernels.losses` on the per-token log-probs.
* ``humanline_reference`` ("sync"): "lookahead" keeps no reference model: the policy computes the
  reference log-probs of the coming ``sync_every`` steps' batches at each sync step
  (:class:`humanline_kernels.LookaheadReference`, docs/lookahead.md); GRPO's from TRL's generation buffer, with a
  generation every N >= 2 optimizer steps (:mod:`._grpo_lookahead`; refused with a generation every step).

Layout: :mod:`.config` (the three configs, one shared set of fields and checks), :mod:`._common` (what the
trainers share: reference forwards, syncing, PEFT reference adapters, logging), one module per trainer
(:mod:`.dpo`, :mod:`.kto`, :mod:`.grpo`); the lookahead's training loop is
:class:`humanline_kernels.integrations.transformers.LookaheadTrainerMixin`, usable by any transformers Trainer.

Metric names are TRL's (``rewards/chosen``, ``logps/chosen``, ``kl``, ``clip_ratio/low_mean``, ...) plus
``humanline/unclipped_frac`` (fraction of completion tokens strictly inside the band) and ``humanline/num_syncs``
(reference syncs so far). With humanline on, ``rewards/*`` are β times the *clipped*
summed log-ratios, the rewards the loss sees. ``logits/*`` and ``mean_token_accuracy`` are logged with
``fused="off"`` only (our fused paths do not compute them); GRPO's per-sequence ``clip_ratio/low_min`` and
``clip_ratio/high_max`` are not logged.
"""
from __future__ import annotations

from ... import losses  # noqa: F401  (the loss module the trainers call; tests patch it here)
from ._common import HK_REF_ADAPTER
from .config import HumanlineDPOConfig, HumanlineGRPOConfig, HumanlineKTOConfig
from .dpo import HumanlineDPOTrainer
from .grpo import HumanlineGRPOTrainer
from .kto import HumanlineKTOTrainer

__all__ = ["HumanlineDPOConfig", "HumanlineKTOConfig", "HumanlineGRPOConfig", "HumanlineDPOTrainer",
           "HumanlineKTOTrainer", "HumanlineGRPOTrainer", "HK_REF_ADAPTER"]
