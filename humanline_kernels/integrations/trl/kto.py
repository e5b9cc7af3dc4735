"""``HumanlineKTOTrainer``: TRL's KTO trainer with humanline clipping and syncing, both TRL 1.16 loss types.

The loss is :mod:`humanline_kernels.losses` on the per-token log-probs: one pass over the rows' tokens
(:func:`~humanline_kernels.losses.sequence_rows`), then KTO on the ``[B]`` sums
(:func:`~humanline_kernels.losses.kto_from_sums`); the logs read the same sums. The KL baseline ``z0`` of
``loss_type="kto"`` is estimated from the (clamped) KL rows: with ``humanline=False`` as TRL 1.16 does (the mean
over every KL row, the mean of the ranks' means), with humanline as HALOs does, whose KTO the paper ran (the sum
over the KL rows with a non-zero log-ratio sum, divided by their count, both all-reduced: a global mean that
neither empty KL rows nor unequal per-rank row counts bias). ``"apo_zero_unpaired"`` has no baseline (TRL builds
no KL rows for it).
"""
from __future__ import annotations

import torch
from trl import KTOTrainer
from trl.trainer import kto_trainer as _kto_module

from ... import _validation, losses
from ._common import HumanlineMixin, StepStats, _lookahead_init, _precheck_common
from ._layouts import SUPERVISED, LayoutCollator, last_positions, supervised_key
from .config import HumanlineKTOConfig, hk_settings

_KTO_NON_MODEL = {"completion_mask", "KL_input_ids", "KL_attention_mask", "KL_completion_mask", "KL_token_type_ids",
                  "KL_mm_token_type_ids", "label", "ref_logps", "ref_KL_logps", "hk_ref_logps", SUPERVISED,
                  supervised_key("KL_")}


class HumanlineKTOTrainer(HumanlineMixin, KTOTrainer):
    """``trl.KTOTrainer`` with humanline clipping and syncing: ``loss_type`` "kto" (KL baseline: TRL's estimate
    with ``humanline=False``, HALOs' with humanline) or "apo_zero_unpaired"."""

    def __init__(self, model, ref_model=None, args=None, *posargs, peft_config=None, **kwargs):
        if args is None:
            args = HumanlineKTOConfig("humanline-kto")
        self.hk_humanline, self.hk_clip, self.hk_sync_every, self.hk_fused = hk_settings(args)
        name = type(self).__name__
        _precheck_common(name, args, model, peft_config, self.hk_humanline)
        self.hk_kl_estimate = "halos" if self.hk_humanline else "trl"
        try:
            _validation.check_kto_options(loss_type=args.loss_type, kl_estimate=self.hk_kl_estimate, has_kl_rows=False)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        with _lookahead_init(self, args, ref_model, _kto_module):
            super().__init__(model, ref_model, args, *posargs, peft_config=peft_config, **kwargs)
        self._hk_setup()
        if self.hk_supervised:  # the rows' and the KL rows' supervised ranges, from TRL's collator's masks
            self.data_collator = LayoutCollator(self.data_collator, prefixes=("", "KL_"))

    def _hk_inputs(self, batch):
        """Model keyword arguments, labels and completion mask ``[B, T]`` of a micro-batch."""
        kw = {k: v for k, v in batch.items() if k not in _KTO_NON_MODEL}
        kw["use_cache"] = False
        kw.update(self._hk_head_layout(batch))
        labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
        return kw, labels, batch["completion_mask"][:, 1:].bool()

    def _hk_reference_of(self, policy, batch):
        """The rows' reference log-probs and, when KTO estimates its KL baseline, the KL rows' after them on the
        same rows (``[B, T + T_KL]``: LookaheadReference keeps one tensor per micro-batch)."""
        batch = self._prepare_inputs(batch)  # (on the device, as training_step does)
        kw, labels, mask = self._hk_inputs(batch)
        ref = self._hk_ref_forward(kw, labels, mask.size(1), policy)
        if not self.calculate_KL:
            return ref
        kl_kw, kl_labels, kl_mask = self._hk_kl_inputs(batch)
        return torch.cat([ref, self._hk_ref_forward(kl_kw, kl_labels, kl_mask.size(1), policy)], 1)

    def _hk_kl_inputs(self, batch):
        kw = {k: v for k, v in batch.items() if k not in _KTO_NON_MODEL | {"input_ids", "attention_mask"}}
        kw.update(input_ids=batch["KL_input_ids"], attention_mask=batch["KL_attention_mask"], use_cache=False,
                  **self._hk_head_layout(batch, "KL_"))
        for k in ("token_type_ids", "mm_token_type_ids"):
            if "KL_" + k in batch:
                kw[k] = batch["KL_" + k]
        labels = batch["KL_input_ids"].masked_fill(batch["KL_completion_mask"] == 0, -100)
        return kw, labels, batch["KL_completion_mask"][:, 1:].bool()

    def _compute_loss(self, model, inputs, return_outputs):
        mode = "train" if self.model.training else "eval"
        dev = self.accelerator.device
        batch = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
        desirable = torch.as_tensor(batch["label"], dtype=torch.bool, device=dev)
        kw, labels, mask = self._hk_inputs(batch)
        T = mask.size(1)
        kl = kl_ref = kl_mask = None
        if self.calculate_KL:
            kl_kw, kl_labels, kl_mask = self._hk_kl_inputs(batch)
        if self.hk_lookahead:
            ref_logps = self._hk_lookahead_refs(batch)
            ref_logps, kl_ref = (ref_logps[:, :T], ref_logps[:, T:]) if self.calculate_KL else (ref_logps, None)
        else:
            if self.calculate_KL:
                kl_ref = self._hk_ref_forward(kl_kw, kl_labels, kl_mask.size(1))
            ref_logps = self._hk_ref_forward(kw, labels, T)
            self._hk_reference_done()
        if self.calculate_KL:
            with torch.no_grad():  # the KL rows only set the detached baseline z0
                kl = model(**kl_kw, labels=kl_labels, fused_lm_head=True).log_probs[:, -kl_mask.size(1):].float()
        out = model(**kw, labels=labels, fused_lm_head=True, **self._hk_policy_kwargs())
        logps = out.log_probs[:, -T:].float()
        loss, stats = self._hk_loss(logps, ref_logps, mask, desirable, kl, kl_ref, kl_mask)
        loss = self._hk_add_aux_loss(mode, loss, out)
        self._hk_log_kto(mode, out, stats, mask, desirable, batch["attention_mask"])
        if return_outputs:
            with torch.no_grad():
                return loss, model(**kw)
        return loss

    def _hk_loss(self, logps, ref_logps, mask, desirable, kl_logps=None, kl_ref_logps=None, kl_mask=None):
        """``(loss, StepStats)``: one pass over the rows' tokens gives the clamped sums that the loss and the logs
        read; the KL rows (when KTO estimates its baseline) give ``z0`` (:attr:`hk_kl_estimate`)."""
        rows, metrics = losses.sequence_rows(logps, ref_logps, mask, self.hk_clip)
        z0 = rows.s.new_zeros(()) if kl_logps is None else \
            losses.kto_kl_baseline(kl_logps, kl_ref_logps, kl_mask, self.hk_clip, rows.s, self.hk_kl_estimate)
        loss, _ = losses.kto_from_sums(rows.s, z0, desirable, beta=self.beta, desirable_weight=self.desirable_weight,
                                       undesirable_weight=self.undesirable_weight, loss_type=self.loss_type)
        return loss, StepStats(rows.s.detach(), rows.policy.detach(), metrics["n_unclipped"], metrics["n_tokens"], z0)

    def _hk_log_kto(self, mode, out, stats, mask, desirable, attention_mask):
        """TRL's KTO metrics from the loss's rows (sums over each label's rows across ranks), and ours."""
        self._hk_log_common(mode, last_positions(out.entropy, mask.size(1)), mask, attention_mask.sum(),
                            (stats.n_unclipped, stats.n_tokens))
        with torch.no_grad():
            r, lp, d = self.beta * stats.s, stats.policy, desirable.float()
            s = torch.stack([(r * d).sum(), (lp * d).sum(), d.sum(), (r * (1 - d)).sum(), (lp * (1 - d)).sum(),
                             (1 - d).sum()])
            if out.mean_logits is not None:
                ml = out.mean_logits[:, -mask.size(1):] * mask
                md = mask & desirable[:, None]
                mu = mask & ~desirable[:, None]
                s = torch.cat([s, torch.stack([(ml * md).sum(), md.sum().float(), (ml * mu).sum(), mu.sum().float()])])
            s = self.accelerator.reduce(s, reduction="sum").tolist()
        m = self._metrics[mode]
        m["kl"].append(float(stats.kl))
        if s[2] > 0:
            m["rewards/chosen"].append(s[0] / s[2])
            m["logps/chosen"].append(s[1] / s[2])
        if s[5] > 0:
            m["rewards/rejected"].append(s[3] / s[5])
            m["logps/rejected"].append(s[4] / s[5])
        if s[2] > 0 and s[5] > 0:
            m["rewards/margins"].append(s[0] / s[2] - s[3] / s[5])
        if len(s) > 6:
            if s[7] > 0:
                m["logits/chosen"].append(s[6] / s[7])
            if s[9] > 0:
                m["logits/rejected"].append(s[8] / s[9])
