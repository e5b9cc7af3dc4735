"""``HumanlineDPOTrainer``: TRL's DPO trainer with humanline clipping and syncing."""
from __future__ import annotations

import torch
from trl import DPOTrainer
from trl.trainer import dpo_trainer as _dpo_module

from ... import losses
from ._common import HumanlineMixin, _clip_counts, _lookahead_init, _precheck_common, _refuse
from .config import HumanlineDPOConfig, hk_settings

_DPO_NON_MODEL = {"completion_mask", "ref_chosen_logps", "ref_rejected_logps", "hk_ref_logps"}


class HumanlineDPOTrainer(HumanlineMixin, DPOTrainer):
    """``trl.DPOTrainer`` with humanline clipping and syncing (``loss_type=["sigmoid"]``)."""

    def __init__(self, model, ref_model=None, args=None, *posargs, peft_config=None, **kwargs):
        if args is None:
            args = HumanlineDPOConfig("humanline-dpo")
        self.hk_humanline, self.hk_clip, self.hk_sync_every, self.hk_fused = hk_settings(args)
        _precheck_common(type(self).__name__, args, model, peft_config, self.hk_humanline)
        _refuse(list(args.loss_type) != ["sigmoid"] or (args.loss_weights not in (None, [1.0])),
                f"HumanlineDPOTrainer supports loss_type=['sigmoid'] only, got {args.loss_type}")
        _refuse(args.f_divergence_type != "reverse_kl", "HumanlineDPOTrainer supports f_divergence_type='reverse_kl'")
        _refuse(args.ld_alpha is not None, "HumanlineDPOTrainer does not support ld_alpha")
        _refuse(args.use_weighting, "HumanlineDPOTrainer does not support use_weighting (WPO)")
        _refuse(args.label_smoothing != 0.0, "HumanlineDPOTrainer: label_smoothing is ignored by TRL's 'sigmoid' loss "
                "and not supported here; set label_smoothing=0.0")
        with _lookahead_init(self, args, ref_model, _dpo_module):
            super().__init__(model, ref_model, args, *posargs, peft_config=peft_config, **kwargs)
        self._hk_setup()

    def _hk_inputs(self, inputs):
        """Model keyword arguments, labels and completion mask ``[B, T]`` of a micro-batch."""
        kw = {k: v for k, v in inputs.items() if k not in _DPO_NON_MODEL}
        kw["use_cache"] = False
        completion_mask = inputs["completion_mask"]
        labels = inputs["input_ids"].masked_fill(completion_mask == 0, -100)
        return kw, labels, completion_mask[:, 1:].bool()

    def _hk_reference_of(self, policy, inputs):
        kw, labels, mask = self._hk_inputs(self._prepare_inputs(inputs))  # (on the device, as training_step does)
        return self._hk_ref_forward(kw, labels, mask.size(1), policy)

    def _compute_loss(self, model, inputs, return_outputs):
        mode = "train" if self.model.training else "eval"
        kw, labels, mask = self._hk_inputs(inputs)
        T = mask.size(1)
        if self.hk_lookahead:
            ref_logps = self._hk_lookahead_refs(inputs)
        else:
            ref_logps = self._hk_ref_forward(kw, labels, T)
            self._hk_reference_done()
        out = model(**kw, labels=labels, fused_lm_head=True)
        logps = out.log_probs[:, -T:].float()
        loss, _ = losses.dpo(logps, ref_logps, mask, clip=self.hk_clip, beta=self.beta)
        if self.aux_loss_enabled and out.aux_loss is not None:
            loss = loss + self.router_aux_loss_coef * out.aux_loss
        self._hk_log_dpo(mode, out, logps, ref_logps, mask, inputs["attention_mask"])
        if return_outputs:
            with torch.no_grad():
                return loss, model(**kw)
        return loss

    def _hk_log_dpo(self, mode, out, logps, ref_logps, mask, attention_mask):
        clipped, counts = _clip_counts(logps, ref_logps, mask, self.hk_clip)
        self._hk_log_common(mode, out, mask, attention_mask, counts)
        with torch.no_grad():
            rewards = self.beta * clipped.sum(1)
            rc, rr = rewards.chunk(2)
            lc, lr = logps.detach().sum(1).chunk(2)
            g = self.accelerator.gather(torch.stack([rc, rr, (rc > rr).float(), rc - rr, lc, lr]))
            g = g.view(-1, 6, rc.numel())
            vals = g.transpose(0, 1).reshape(6, -1).mean(1).tolist()
        m = self._metrics[mode]
        for key, v in zip(("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                           "logps/chosen", "logps/rejected"), vals):
            m[key].append(v)
        if out.mean_logits is not None:  # fused="off": TRL's head also gave mean logits and top-1 hits
            T = mask.size(1)
            mc, mr = mask.chunk(2)
            lgc, lgr = (out.mean_logits[:, -T:] * mask).chunk(2)
            top1 = (out.is_top1[:, -T:].chunk(2)[0] & mc).sum()
            s = self.accelerator.reduce(torch.stack([lgc.sum(), mc.sum(), lgr.sum(), mr.sum(), top1.float()]).float(),
                                        reduction="sum").tolist()
            m["logits/chosen"].append(s[0] / s[1] if s[1] > 0 else 0.0)
            m["logits/rejected"].append(s[2] / s[3] if s[3] > 0 else 0.0)
            m["mean_token_accuracy"].append(s[4] / s[1] if s[1] > 0 else 0.0)
