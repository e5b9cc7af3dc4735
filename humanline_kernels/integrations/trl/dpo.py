"""``HumanlineDPOTrainer``: TRL's DPO trainer with humanline clipping and syncing, every TRL 1.16 DPO loss type.

The loss is :mod:`humanline_kernels.losses` on the per-token log-probs: one pass over the tokens
(:func:`~humanline_kernels.losses.sequence_rows`: the clamped sums ``s``, the policy's sums, the counts and the clip
counts), then the batch math on those ``[2P]`` rows (:func:`~humanline_kernels.losses.from_rows`); the logs read
the same rows. TRL 1.16 (``DPOTrainer._compute_loss``) differs from ``hk.losses.dpo`` in two places, which the
trainer follows, so that ``humanline=False`` is TRL exactly:

* "sigmoid" ignores ``label_smoothing`` (ours reads it: cDPO). In a mixture with a loss type that reads it
  ("exo_pair", "robust", "aot", "aot_unpaired") the "sigmoid" term gets 0; a ``label_smoothing`` that no term
  reads is refused (TRL would ignore it silently).
* "ipo" and "sigmoid_norm" divide by the *unshifted* completion mask's count, which also counts the first
  completion token when the prompt is empty (or cut off by ``truncation_mode="keep_end"``); every other count is
  the scored tokens'.

``padding_free=True`` (TRL 1.16 turns it off and pads) packs each micro-batch on the CPU into one row, chosen
sequences then their rejected partners (:func:`._layouts.pack`); the policy and reference forwards run packed
(flash-attn varlen with ``attn_implementation="flash_attention_2"``, a block-diagonal mask from ``position_ids`` with
sdpa/eager) and the per-token outputs move to the padded rows with ``hk.Packed``
(:func:`humanline_kernels.losses.unpacked`) before the loss, so that the loss and the logs are the padded batch's.
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from trl import DPOTrainer
from trl.trainer import dpo_trainer as _dpo_module

from ... import _validation, losses
from ..._layout import Packed
from ..._params import DPO
from ...losses import _weighted_sum
from ._common import HumanlineMixin, StepStats, _lookahead_init, _precheck_common, _prompt_learning, _refuse
from ._layouts import CU_SEQLENS, SUPERVISED, LayoutCollator, last_positions
from .config import HumanlineDPOConfig, hk_settings

_DPO_NON_MODEL = {"completion_mask", "ref_chosen_logps", "ref_rejected_logps", "hk_ref_logps", SUPERVISED, CU_SEQLENS}
# TRL 1.16 DPOTrainer._compute_loss reads label_smoothing in these loss types only ("sigmoid" is not cDPO there)
_READS_LABEL_SMOOTHING = ("exo_pair", "robust", "aot", "aot_unpaired")
# ... and divides these by the count of the unshifted completion_mask
_UNSHIFTED_COUNT = ("ipo", "sigmoid_norm")


class _Terms(NamedTuple):
    """Terms of the mixture that one :func:`~humanline_kernels.losses.from_rows` call computes: same params, same
    token counts (``unshifted``: TRL's count of the unshifted completion mask)."""

    params: DPO
    types: tuple
    weights: tuple
    unshifted: bool


class _Tokens(NamedTuple):
    """A micro-batch's per-token tensors on the mask's positions (``[2P, T]`` rows, or a packed ``[1, N]`` stream,
    which :func:`~humanline_kernels.losses.unpacked` moves to the padded rows); the head's optional outputs None
    where it gave none."""

    logps: torch.Tensor
    ref_logps: torch.Tensor
    mask: torch.Tensor
    completion_mask: torch.Tensor  # (unshifted: "ipo"/"sigmoid_norm" count it)
    entropy: Optional[torch.Tensor]
    log_sum_sq_probs: Optional[torch.Tensor]
    mean_logits: Optional[torch.Tensor]
    is_top1: Optional[torch.Tensor]


class DPOObjective(NamedTuple):
    """The DPO loss of a config, checked and fixed at construction. ``groups``: the mixture's terms by params and
    count; ``aot``: "aot" is in the mixture (it reads the policy's and the reference's own sums);
    ``wpo``: ``use_weighting``."""

    groups: tuple
    ld_alpha: Optional[float]
    aot: bool
    wpo: bool


def dpo_objective(name, args, clip, fused):
    """Check every DPO option of ``args`` (a ``DPOConfig``; ``rpo_alpha`` when it is a humanline one) for a run with
    ``clip`` and ``fused``, and build its :class:`DPOObjective`; a ``ValueError`` names what cannot be honoured."""
    ls, rpo_alpha = args.label_smoothing, getattr(args, "rpo_alpha", None)
    try:  # the loss's own checks (WPO's input is the head's: checked below)
        types, weights = _validation.check_dpo_options(
            None, clip=clip, beta=args.beta, label_smoothing=ls, loss_type=list(args.loss_type),
            loss_weights=args.loss_weights, rpo_alpha=rpo_alpha, f_divergence_type=args.f_divergence_type,
            f_alpha_divergence_coef=args.f_alpha_divergence_coef, ld_alpha=args.ld_alpha,
            discopop_tau=args.discopop_tau, use_weighting=False, log_sum_sq_probs=None)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    _refuse(ls > 0 and not set(types) & set(_READS_LABEL_SMOOTHING),
            f"{name}: label_smoothing={ls} is read by none of loss_type {types}: TRL 1.16's 'sigmoid' ignores it (it "
            f"is not cDPO there), only {list(_READS_LABEL_SMOOTHING)} read it. Set label_smoothing=0.0 (or use "
            "'robust' for noisy preference labels)")
    _refuse(args.use_weighting and fused != "off",
            f"{name}: use_weighting=True (WPO) needs each token's log sum_v p_v^2, which TRL's log-prob head computes "
            f"and the fused={fused!r} heads do not (their row kernels form only the log-prob and the entropy); use "
            "fused='off'")
    p = DPO(clip=clip, beta=args.beta, label_smoothing=ls, f_divergence_type=args.f_divergence_type,
            f_alpha_divergence_coef=args.f_alpha_divergence_coef, ld_alpha=args.ld_alpha,
            discopop_tau=args.discopop_tau, use_weighting=args.use_weighting)
    return DPOObjective(_mixture_groups(p, types, weights), args.ld_alpha, "aot" in types, args.use_weighting)


def _mixture_groups(p, types, weights):
    """The mixture's terms in groups that share params and counts (one group unless "sigmoid" meets a
    ``label_smoothing`` or "ipo"/"sigmoid_norm" meet another type)."""
    groups = {}
    for t, w in zip(types, weights):
        key = (t in _UNSHIFTED_COUNT, t == "sigmoid" and p.label_smoothing > 0)
        groups.setdefault(key, []).append((t, w))
    out = []
    for (unshifted, plain_sigmoid), terms in groups.items():
        ts, ws = (tuple(x) for x in zip(*terms))
        params = replace(p, label_smoothing=0.0) if plain_sigmoid else p
        out.append(_Terms(replace(params, loss_type=ts, loss_weights=ws), ts, ws, unshifted))
    return tuple(out)


class HumanlineDPOTrainer(HumanlineMixin, DPOTrainer):
    """``trl.DPOTrainer`` with humanline clipping and syncing: every TRL 1.16 ``loss_type`` (mixtures with
    ``loss_weights``), ``f_divergence_type``, ``ld_alpha``, ``discopop_tau``, ``label_smoothing`` where TRL reads it,
    ``use_weighting`` (``fused="off"``) and RPO (``rpo_alpha`` or TRL's ``[..., "sft"]``); docs/integrations.md
    lists what is refused and why. ``padding_free=True`` trains on packed micro-batches (module docstring)."""

    def __init__(self, model, ref_model=None, args=None, *posargs, peft_config=None, **kwargs):
        if args is None:
            args = HumanlineDPOConfig("humanline-dpo")
        self.hk_humanline, self.hk_clip, self.hk_sync_every, self.hk_fused = hk_settings(args)
        name = type(self).__name__
        _precheck_common(name, args, model, peft_config, self.hk_humanline)
        self.hk_objective = dpo_objective(name, args, self.hk_clip, self.hk_fused)
        padding_free = args.padding_free
        args.padding_free = False  # (TRL 1.16 would warn that it falls back to padding: we pack, below)
        try:
            with _lookahead_init(self, args, ref_model, _dpo_module):
                super().__init__(model, ref_model, args, *posargs, peft_config=peft_config, **kwargs)
        finally:
            args.padding_free = padding_free
        self.padding_free = padding_free
        if padding_free:
            self._hk_precheck_padding_free(name)
        self._hk_setup()
        if padding_free or self.hk_supervised:
            self.data_collator = LayoutCollator(self.data_collator, ranges=self.hk_supervised,
                                                packed=padding_free, pad_token_id=self._tokenizer.pad_token_id,
                                                pad_to_multiple_of=args.pad_to_multiple_of)

    def _hk_precheck_padding_free(self, name):
        _refuse(self._is_vision_dataset,
                f"{name}: padding_free=True packs text sequences; a vision dataset's images and their tokens are per "
                "row. Set padding_free=False.")
        _refuse(_prompt_learning(self.model),
                f"{name}: padding_free=True with a prompt-learning PEFT adapter: its virtual tokens are prepended to "
                "each row, which a packed row of many sequences does not have. Set padding_free=False.")

    def _hk_inputs(self, inputs):
        """Model keyword arguments, labels, the scored positions' mask ``[B, T]`` (``[1, N]`` packed: position
        ``t`` scores token ``t + 1``, the last none) and the micro-batch's :class:`~humanline_kernels.Packed` (None
        when padded)."""
        kw = {k: v for k, v in inputs.items() if k not in _DPO_NON_MODEL}
        kw["use_cache"] = False
        kw.update(self._hk_head_layout(inputs))
        completion_mask = inputs["completion_mask"]
        labels = inputs["input_ids"].masked_fill(completion_mask == 0, -100)
        if CU_SEQLENS not in inputs:
            return kw, labels, completion_mask[:, 1:].bool(), None
        # no sequence's first token is scored from the previous sequence's last (TRL's SFT collator does the same)
        labels = labels.masked_fill(inputs["position_ids"] == 0, -100)
        return kw, labels, F.pad(labels[:, 1:] != -100, (0, 1)), Packed(inputs[CU_SEQLENS])

    def _hk_reference_of(self, policy, inputs):
        kw, labels, mask, _ = self._hk_inputs(self._prepare_inputs(inputs))  # (on the device, as training_step does)
        return self._hk_ref_forward(kw, labels, mask.size(1), policy)

    def _compute_loss(self, model, inputs, return_outputs):
        mode = "train" if self.model.training else "eval"
        kw, labels, mask, packed = self._hk_inputs(inputs)
        T = mask.size(1)
        if self.hk_lookahead:
            ref_logps = self._hk_lookahead_refs(inputs)
        else:
            ref_logps = self._hk_ref_forward(kw, labels, T)
            self._hk_reference_done()
        out = model(**kw, labels=labels, fused_lm_head=True, **self._hk_policy_kwargs())
        tok = _Tokens(last_positions(out.log_probs, T).float(), ref_logps, mask, inputs["completion_mask"],
                      *(last_positions(getattr(out, k), T) for k in _Tokens._fields[4:]))
        if packed is not None:  # the padded rows [2P, T'] that the loss and the logs read: one scatter each
            tok = _Tokens(*losses.unpacked(packed, *tok))
        lssp = tok.log_sum_sq_probs.float() if self.hk_objective.wpo else None
        loss, stats = self._hk_loss(tok.logps, tok.ref_logps, tok.mask, tok.completion_mask, lssp)
        loss = self._hk_add_aux_loss(mode, loss, out)
        n_tokens = inputs["attention_mask"].sum() if packed is None else inputs["input_ids"].size(1)
        self._hk_log_dpo(mode, tok, stats, n_tokens)
        if return_outputs:
            with torch.no_grad():
                return loss, model(**kw)
        return loss

    def _hk_loss(self, logps, ref_logps, mask, completion_mask, log_sum_sq_probs=None):
        """``(loss, StepStats)`` of ``[2P, T]`` log-probs: one pass over the tokens gives the rows that the loss and
        the logs read (``StepStats.policy``: the policy's sums as TRL logs them, LD-weighted with ``ld_alpha``)."""
        o = self.hk_objective
        rows, metrics, tw = losses.dpo_rows(logps, ref_logps, mask, self.hk_clip, ld_alpha=o.ld_alpha, aot=o.aot,
                                            log_sum_sq_probs=log_sum_sq_probs if o.wpo else None)
        loss = None
        for g in o.groups:
            r = rows._replace(counts=completion_mask.sum(dim=1).to(rows.counts.dtype)) if g.unshifted else rows
            term, _ = losses.from_rows(g.params, r, metrics, mixture=(g.types, g.weights))
            loss = term if loss is None else loss + term
        with torch.no_grad():
            policy = rows.policy if tw is None else rows.aot_policy if o.aot else _weighted_sum(logps, mask, tw)
        return loss, StepStats(rows.s.detach(), policy.detach(), metrics["n_unclipped"], metrics["n_tokens"])

    def _hk_log_dpo(self, mode, tok, stats, num_tokens):
        """TRL's DPO metrics from the loss's rows (per pair, gathered across ranks, then averaged), and ours."""
        mask = tok.mask
        self._hk_log_common(mode, tok.entropy, mask, num_tokens, (stats.n_unclipped, stats.n_tokens))
        with torch.no_grad():
            rc, rr = (self.beta * stats.s).chunk(2)
            lc, lr = stats.policy.chunk(2)
            g = self.accelerator.gather(torch.stack([rc, rr, (rc > rr).float(), rc - rr, lc, lr]))
            g = g.view(-1, 6, rc.numel())
            vals = g.transpose(0, 1).reshape(6, -1).mean(1).tolist()
        m = self._metrics[mode]
        for key, v in zip(("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                           "logps/chosen", "logps/rejected"), vals):
            m[key].append(v)
        if tok.mean_logits is not None:  # fused="off": TRL's head also gave mean logits and top-1 hits
            mc, mr = mask.chunk(2)
            lgc, lgr = (tok.mean_logits * mask).chunk(2)
            top1 = (tok.is_top1.chunk(2)[0] & mc).sum()
            s = self.accelerator.reduce(torch.stack([lgc.sum(), mc.sum(), lgr.sum(), mr.sum(), top1.float()]).float(),
                                        reduction="sum").tolist()
            m["logits/chosen"].append(s[0] / s[1] if s[1] > 0 else 0.0)
            m["logits/rejected"].append(s[2] / s[3] if s[3] > 0 else 0.0)
            m["mean_token_accuracy"].append(s[4] / s[1] if s[1] > 0 else 0.0)
