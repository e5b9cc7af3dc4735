"""``HumanlineGRPOTrainer``: TRL's GRPO trainer with humanline clipping and syncing."""
from __future__ import annotations

import copy

import torch
from accelerate.utils import is_peft_model
from trl import GRPOTrainer
from trl.models import prepare_deepspeed, prepare_fsdp
from trl.trainer.utils import add_fused_lm_head, create_model_from_path, disable_dropout_in_model, get_config_model_id

from ... import losses
from ._common import HumanlineMixin, _precheck_common, _refuse
from .config import GRPO_NO_LOOKAHEAD, HumanlineGRPOConfig, hk_settings, reference_mode

_GRPO_LOSS_TYPES = ("dapo", "bnpo", "grpo", "dr_grpo")


class HumanlineGRPOTrainer(HumanlineMixin, GRPOTrainer):
    """``trl.GRPOTrainer`` with humanline clipping and syncing.

    With humanline on, the synced reference (θ_{t-1} during step t) is the importance ratio's denominator, as in
    the paper and HALOs: ``ρ = exp(clamp(log π_θ − log π_ref, log_eps_p, log_eps_r))``, then the PPO clip at
    1 ± ε and, when ``beta != 0``, the k3 KL against the same reference (unclipped). TRL's
    ``old_per_token_logps`` is not used: we require one generation per optimizer step, where TRL sets it to the
    detached current log-probs (ratio ≡ 1); the reference is built and its log-probs computed even when
    ``beta == 0``. With humanline off the ratio is TRL's (against ``old_per_token_logps``) and the KL against the
    fixed reference, exactly like ``trl.GRPOTrainer``.

    Extra keyword ``ref_model``: a reference model instance (default: loaded like TRL does from the policy's
    name or path, or a deep copy of an in-memory policy).
    """

    def __init__(self, model, reward_funcs=None, args=None, *posargs, ref_model=None, peft_config=None, **kwargs):
        if args is None:
            args = HumanlineGRPOConfig("humanline-grpo")
        self.hk_humanline, self.hk_clip, self.hk_sync_every, self.hk_fused = hk_settings(args)
        name = type(self).__name__
        _refuse(reference_mode(args, name) == "lookahead", f"{name}: {GRPO_NO_LOOKAHEAD}")
        _precheck_common(name, args, model, peft_config, self.hk_humanline)
        _refuse(args.loss_type not in _GRPO_LOSS_TYPES,
                f"{name} supports loss_type in {_GRPO_LOSS_TYPES}, got {args.loss_type!r}")
        _refuse(args.importance_sampling_level != "token", f"{name} supports importance_sampling_level='token' only")
        _refuse(args.delta is not None, f"{name} does not support delta (two-sided clipping)")
        _refuse(args.off_policy_mask_threshold is not None, f"{name} does not support off_policy_mask_threshold")
        _refuse(args.top_entropy_quantile < 1.0, f"{name} does not support top_entropy_quantile < 1")
        _refuse(args.entropy_coef != 0.0 or args.use_adaptive_entropy, f"{name} does not support the entropy bonus")
        _refuse(args.use_vllm and args.vllm_importance_sampling_correction,
                f"{name}: vLLM importance-sampling correction (TRL's per-token sampling ratio) is not applied by the "
                "humanline GRPO loss; set vllm_importance_sampling_correction=False")
        if self.hk_humanline:
            gen_every = args.steps_per_generation * args.num_iterations
            _refuse(gen_every != args.gradient_accumulation_steps,
                    f"{name}: with humanline the reference log-probs of a generation batch must all come from the "
                    "reference of one optimizer step, so a generation batch must span exactly one optimizer step: "
                    f"steps_per_generation * num_iterations ({gen_every}) must equal gradient_accumulation_steps "
                    f"({args.gradient_accumulation_steps})")
        beta = args.beta
        if ref_model is not None:
            args.beta = 0.0  # keep TRL from loading its own reference; ours is installed below
        try:
            super().__init__(model, reward_funcs, args, *posargs, peft_config=peft_config, **kwargs)
        finally:
            args.beta = beta
        self.beta = beta
        if self.ref_model is None and (ref_model is not None or (self.hk_humanline and not is_peft_model(self.model))):
            self.ref_model = self._hk_prepare_ref(ref_model)  # a PEFT policy gets a reference adapter instead
        self._hk_setup(temperature=self.temperature)

    def _hk_prepare_ref(self, ref_model):
        if ref_model is None:
            path = get_config_model_id(self.model.config)
            if path:
                init = dict(self.args.model_init_kwargs or {})
                init.setdefault("dtype", self.model.dtype)
                init.setdefault("attn_implementation", self.model.config._attn_implementation)
                ref_model = create_model_from_path(path, **init)
            else:  # an in-memory policy: copy it, minus the forward TRL bound to the policy
                ref_model = copy.deepcopy(self.model)
                ref_model.__dict__.pop("forward", None)
        if self.args.disable_dropout:
            disable_dropout_in_model(ref_model)
        add_fused_lm_head(ref_model, temperature=self.temperature)
        if self.is_deepspeed_enabled:
            return prepare_deepspeed(ref_model, self.accelerator)
        if self.is_fsdp_enabled:
            return prepare_fsdp(ref_model, self.accelerator)
        return self.accelerator.prepare_model(ref_model, evaluation_mode=True)

    def _generate_and_score_completions(self, inputs):
        beta = self.beta
        if self.hk_humanline and beta == 0.0:
            self.beta = 1.0  # TRL computes ref_per_token_logps only when beta != 0; humanline always needs them
        try:
            out = super()._generate_and_score_completions(inputs)
        finally:
            self.beta = beta
        # The generation batch is this optimizer step's only reference forward: start the sync now.
        self._hk_reference_done(boundary_only=False)
        return out

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mm = {k: inputs.get(k) for k in ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
                                         "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids",
                                         "mm_token_type_ids", "image_position_ids")}
        logps, entropies, aux = self._get_per_token_logps_and_entropies(
            model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1),
            completion_ids.size(1), compute_entropy=True, compute_aux_loss=self.aux_loss_enabled, **mm)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        mask = mask.bool()
        advantages = inputs["advantages"]
        if advantages.dim() != 1:
            raise ValueError(f"{type(self).__name__} expects advantages of shape [B], got {list(advantages.shape)}")
        logps = logps.float()
        if self.hk_humanline:
            denom, kl_ref = inputs["ref_per_token_logps"].float(), None
        else:
            old = inputs.get("old_per_token_logps")
            denom = logps.detach() if old is None else old.float()
            kl_ref = inputs["ref_per_token_logps"].float() if self.beta != 0.0 else None
        accum = self.current_gradient_accumulation_steps if mode == "train" else 1
        normalizer, scale = None, 1.0 / accum
        if self.loss_type == "dapo":  # TRL: global token count of the accumulation window, per process
            normalizer = inputs["num_items_in_batch"].float().clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normalizer = normalizer * accum / self.args.steps_per_generation
            scale = 1.0
        # TRL's use_bias_correction_kl (default True) weights k3 by the ratio exp(logp - old); it applies with
        # humanline off (parity with TRL). With humanline on the KL term is HALOs' (no weight).
        bias_corr = kl_ref is not None and self.args.use_bias_correction_kl
        agg = dict(loss_type=self.loss_type, normalizer=normalizer, max_completion_length=self.max_completion_length)
        loss, met = losses.grpo(logps, denom, advantages.float(), mask, clip=self.hk_clip,
                                beta=0.0 if bias_corr else self.beta, epsilon_low=self.epsilon_low,
                                epsilon_high=self.epsilon_high, kl_ref_logps=kl_ref, **agg)
        if bias_corr:
            x = torch.where(mask, kl_ref - logps, 0.0)
            k3 = (torch.exp(x) - x - 1.0) * torch.exp(logps - denom)
            loss = loss + self.beta * losses.grpo_aggregate(torch.where(mask, k3, 0.0), mask, **agg)
            met["kl"] = (k3.detach() * mask).sum() / mask.sum().clamp(min=1)
        loss = loss * scale
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux / accum
        self._hk_log_grpo(mode, met, entropies, mask)
        return loss

    def _hk_log_grpo(self, mode, met, entropies, mask):
        with torch.no_grad():
            n = mask.sum().float()
            s = torch.stack([met["kl"] * n, met["clip_frac_low"] * n, met["clip_frac_high"] * n,
                             met["unclipped_frac"] * n, (entropies.float() * mask).sum(), n])
            kl, low, high, inside, ent, n = self.accelerator.reduce(s, reduction="sum").tolist()
        m = self._metrics[mode]
        d = max(n, 1.0)
        if self.beta != 0.0:
            m["kl"].append(kl / d)
        m["entropy"].append(ent / d)
        m["clip_ratio/low_mean"].append(low / d)
        m["clip_ratio/high_mean"].append(high / d)
        m["clip_ratio/region_mean"].append((low + high) / d)
        m["humanline/unclipped_frac"].append(inside / d if n > 0 else 1.0)
