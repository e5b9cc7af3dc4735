r"""``HumanlineGRPOTrainer``: TRL's GRPO trainer with humanline clipping and syncing, every TRL 1.16 GRPO option,
and off-policy generation (a generation batch sampled every N optimizer steps), as the paper runs GRPO.

The loss is :func:`humanline_kernels.losses.grpo` on the per-token log-probs of the fused head, with TRL's options
read where TRL reads them (``self.loss_type``, ``self.beta``, ``self.args.delta``, ...). With ``humanline=False`` it
is TRL's loss on the same batch (the ratio against TRL's ``old_per_token_logps``, the KL against the fixed
reference). With ``humanline=True`` TRL's log-ratio ``log pi - log pi_old`` becomes
``Delta_hat = clamp(log pi - log pi_ref, log_eps_p, log_eps_r)`` against the *synced* reference, whatever the
loss type; the vLLM importance weight, the masks and the entropy terms are TRL's.

Reference log-probs with humanline are computed at training time, per micro-batch, from the reference as synced
for that micro-batch's own optimizer step (θ_s, ``s`` the last sync step before it), not at generation time: a
generation batch may then span any number of steps (``steps_per_generation`` > ``gradient_accumulation_steps``,
``num_iterations`` >= 1). ``humanline_reference="sync"``: a no-grad reference forward per micro-batch (log-probs
only), then, on the step's last micro-batch, the copy policy -> reference starts. ``"lookahead"``: no reference
model; the policy computes them ahead from TRL's buffer (:mod:`._grpo_lookahead`).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import warnings

import torch
from accelerate.utils import is_peft_model
from trl import GRPOTrainer
from trl.models import prepare_deepspeed, prepare_fsdp
from trl.trainer.utils import (
    add_fused_lm_head,
    create_model_from_path,
    disable_dropout_in_model,
    get_config_model_id,
    use_adapter,
)

from ... import losses
from ..._params import GRPO_LOSS_TYPES
from ...reference import adaptive_entropy_coef
from .._head import supervised_rows
from ..transformers import LookaheadTrainerMixin
from ._common import HK_REF_ADAPTER, HumanlineMixin, _checkpointing_on, _precheck_common, _refuse
from ._grpo_lookahead import BufferLookahead
from .config import HumanlineGRPOConfig, hk_settings, reference_mode

_PPO_CLIP_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
_GLOBAL_NORMALIZER_TYPES = ("dapo", "cispo", "vespo")  # TRL divides these by the window's token count
_MM_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
            "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


class HumanlineGRPOTrainer(HumanlineMixin, GRPOTrainer):
    """``trl.GRPOTrainer`` with humanline clipping and syncing; see the module docstring.

    With humanline on, the synced reference (θ_s during step t, s the last sync step before t) is the importance
    ratio's denominator, as in the paper and HALOs: ``rho = exp(clamp(log pi_theta - log pi_ref, log_eps_p,
    log_eps_r))`` in TRL's formula for ``loss_type``, and the k3 KL (``beta != 0``) against the same reference,
    unclipped (times ``rho`` with ``use_bias_correction_kl``). TRL's ``old_per_token_logps`` is not the
    denominator; it is computed at generation only where vLLM's importance weight or the off-policy mask read it.
    The reference is built (from the policy's hub id/path, or a copy of an in-memory policy; or pass ``ref_model=``)
    even when ``beta == 0`` (TRL's default), except with ``humanline_reference="lookahead"``, which keeps none.

    Extra keyword ``ref_model``: a reference model instance.
    """

    def __init__(self, model, reward_funcs=None, args=None, *posargs, ref_model=None, peft_config=None, **kwargs):
        if args is None:
            args = HumanlineGRPOConfig("humanline-grpo")
        self.hk_humanline, self.hk_clip, self.hk_sync_every, self.hk_fused = hk_settings(args)
        name = type(self).__name__
        self.hk_lookahead = reference_mode(args, name) == "lookahead"
        _precheck_common(name, args, model, peft_config, self.hk_humanline)
        _precheck_grpo(name, args, self.hk_lookahead, ref_model)
        beta = args.beta
        if ref_model is not None or self.hk_lookahead:
            args.beta = 0.0  # keep TRL from loading its own reference: ours is installed below (lookahead: none)
        try:
            super().__init__(model, reward_funcs, args, *posargs, peft_config=peft_config, **kwargs)
        finally:
            args.beta = beta
        self.beta = beta
        wants_ref = ref_model is not None or (self.hk_humanline and not is_peft_model(self.model))
        if self.ref_model is None and wants_ref and not self.hk_lookahead:
            with _rng_untouched():  # (loading must not move the RNG that samples the completions)
                self.ref_model = self._hk_prepare_ref(ref_model)  # a PEFT policy gets a reference adapter instead
        self._hk_setup(temperature=self.temperature)

    # ------------------------------------------------------------------------------------------- set-up
    def _hk_prepare_ref(self, ref_model):
        if ref_model is None:
            path = get_config_model_id(self.model.config)
            if path:
                init = dict(self.args.model_init_kwargs or {})
                init.setdefault("dtype", self.model.dtype)
                init.setdefault("attn_implementation", self.model.config._attn_implementation)
                ref_model = create_model_from_path(path, **init)
            else:  # an in-memory policy: copy it, minus the forwards TRL bound to the policy's modules
                ref_model = copy.deepcopy(self.model)
                ref_model.__dict__.pop("forward", None)
                ref_model.get_output_embeddings().__dict__.pop("forward", None)
        if self.args.disable_dropout:
            disable_dropout_in_model(ref_model)
        if self.args.cast_lm_head_to_fp32:
            _cast_lm_head_to_fp32(ref_model)  # as TRL casts the policy's: a sync then copies fp32 into fp32
        add_fused_lm_head(ref_model, temperature=self.temperature, cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32)
        if self.is_deepspeed_enabled:
            return prepare_deepspeed(ref_model, self.accelerator)
        if self.is_fsdp_enabled:
            return prepare_fsdp(ref_model, self.accelerator)
        return self.accelerator.prepare_model(ref_model, evaluation_mode=True)

    def _hk_precheck_lookahead_trainer(self, name):
        # (replaces the offline lookahead's checks: GRPO's data comes from TRL's buffer, not the data loader)
        _refuse(self.is_fsdp_enabled or self.is_deepspeed_enabled,
                f"{name}: humanline_reference='lookahead' for GRPO swaps the last sync's parameters into the policy "
                "for the first micro-batches of each new generation, which needs whole parameters on every rank; "
                "FSDP and DeepSpeed shard them. Use humanline_reference='sync'.")

    # The offline lookahead (LookaheadTrainerMixin) draws the data loader ahead; GRPO's reads TRL's buffer instead.
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        return super(LookaheadTrainerMixin, self).get_batch_samples(epoch_iterator, num_batches, device)

    def set_initial_training_values(self, args, dataloader, *a, **k):
        return super(LookaheadTrainerMixin, self).set_initial_training_values(args, dataloader, *a, **k)

    # --------------------------------------------------------------------------------------- the data
    def _generate(self, prompts):
        out = super()._generate(prompts)
        # the completions' lengths while they are host lists (TRL's completion_ids, tool turns included), for the
        # head's supervised ranges: TRL pads them into completion_ids / completion_mask on the device
        self._hk_completion_lens = [len(ids) for ids in out[1]]
        return out

    def _generate_and_score_completions(self, inputs):
        self._hk_completion_lens = None
        batch = self._hk_generate_and_score(inputs)
        lens = self._hk_completion_lens
        # a list: TRL's shuffle and split carry it along with the rows (trl/trainer/utils.py shuffle_sequence_dict,
        # split_tensor_dict); none (a dense head) if _generate was bypassed or its rows are not the batch's
        if self.hk_supervised and lens is not None and len(lens) == batch["completion_ids"].size(0):
            batch["hk_completion_lens"] = lens
        return batch

    def _hk_generate_and_score(self, inputs):
        if not self.hk_humanline:
            return super()._generate_and_score_completions(inputs)
        # With humanline the reference log-probs are taken at training time, from each micro-batch's own step's
        # reference: TRL's generation-time reference forward (beta != 0) would be the wrong reference for every
        # later step of the buffer; and its old log-probs are read only by vLLM's importance weight and the
        # off-policy mask (TRL _generate_and_score_completions computes both in one no-grad block).
        beta, self.beta = self.beta, 0.0
        skip_old = not self._hk_needs_old_logps()
        if skip_old:  # with beta == 0 the only per-token call of the generation step is the old log-probs'
            self._get_per_token_logps_and_entropies = _no_logps
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self.beta = beta
            if skip_old:
                del self._get_per_token_logps_and_entropies

    def _hk_needs_old_logps(self):
        return bool(self.use_vllm and self.vllm_importance_sampling_correction) or \
            self.off_policy_mask_threshold is not None

    def _prepare_inputs(self, generation_batch):
        training = self.model.training
        span = self.args.steps_per_generation * self.num_iterations
        generates = training and (self._step % span == 0 or self._buffered_inputs is None)
        inputs = super()._prepare_inputs(generation_batch)
        if self.hk_lookahead and training:
            if self.hk_la is None:
                self.hk_la = self._hk_new_lookahead()
            ref = self.hk_la.reference(self._step, self.state.global_step, self._buffered_inputs, generates)
            self.hk_la_syncs = self.hk_la.windows
            inputs = dict(inputs, hk_ref_logps=ref)
        return inputs

    def _hk_new_lookahead(self):
        policy = self.model
        trainable = [p for p in self.accelerator.unwrap_model(policy).parameters() if p.requires_grad]
        la = BufferLookahead(functools.partial(self._hk_policy_reference, policy), trainable,
                             every=self.hk_sync_every, accum=self.args.gradient_accumulation_steps,
                             steps_per_generation=self.args.steps_per_generation,
                             num_iterations=self.num_iterations, max_steps=self.state.max_steps)
        self._hk_restore_lookahead(la)
        return la

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        out = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if resume_from_checkpoint is not None and self.hk_humanline:
            # TRL does not checkpoint its generation buffer: a resumed run samples a new one at once (stock TRL
            # too), so only a checkpoint at a generation boundary resumes the uninterrupted run
            accum = self.args.gradient_accumulation_steps
            span = self.args.steps_per_generation * self.num_iterations
            micro = self.state.global_step * accum
            if micro % span:
                msg = (f"{type(self).__name__}: the checkpoint of step {self.state.global_step} is inside a generation "
                       f"batch (one every {span // accum} optimizer steps); TRL does not checkpoint its generation "
                       "buffer, so the resumed run samples a new one now and trains on other completions than the "
                       "run that never stopped. Resume from a checkpoint at a generation boundary (save_steps a "
                       f"multiple of {span // accum})")
                if self.hk_lookahead:  # its saved reference log-probs belong to the lost buffer's completions
                    raise ValueError(msg + " for humanline_reference='lookahead'")
                warnings.warn(msg, UserWarning, stacklevel=2)
            # TRL restarts its micro-step counter at 0; the generation schedule (every span micro-steps) and the
            # lookahead's positions count from the run's start
            self._step = micro
        return out

    # --------------------------------------------------------------------------- reference log-probs
    def _hk_reference(self, inputs):
        """The micro-batch's reference log-probs ``[B, T]`` (fp32): from the lookahead, or a forward of the synced
        reference (model or PEFT adapter) now, after which the step's copy may start (its last micro-batch)."""
        if self.hk_lookahead:
            return self._hk_lookahead_refs(inputs)
        if self.ref_model is not None:
            ref = self._hk_batch_logps(self.ref_model, inputs)
        else:
            with use_adapter(self.accelerator.unwrap_model(self.model), adapter_name=HK_REF_ADAPTER):
                ref = self._hk_batch_logps(self.model, inputs)
        self._hk_reference_done()
        return ref

    def _hk_policy_reference(self, policy, inputs):
        """The policy's log-probs of a micro-batch as a reference model would compute them: eval mode (no
        dropout), no grad, no entropy."""
        call = functools.partial(policy, hk_entropy=False) if self.hk_fused != "off" else policy
        with _eval_mode(policy):
            return self._hk_batch_logps(call, inputs)

    def _hk_batch_logps(self, model, inputs):
        """Per-token log-probs (no grad, fp32) of a micro-batch's completions, through TRL's per-token call."""
        ckpt = _no_checkpointing(self) if _checkpointing_on(self.args) else contextlib.nullcontext()
        with torch.no_grad(), ckpt, supervised_rows(_supervised(inputs)):
            logps, _, _ = self._get_per_token_logps_and_entropies(model, *_sequences(inputs), **_mm(inputs))
        return logps.float()

    # ------------------------------------------------------------------------------------------ the loss
    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        ref = self._hk_reference(inputs) if self.hk_humanline else None  # (before the policy's forward)
        with supervised_rows(_supervised(inputs)):  # (TRL makes one model call: no batch_size given)
            logps, entropies, aux = self._get_per_token_logps_and_entropies(
                model, *_sequences(inputs), compute_entropy=True, compute_aux_loss=self.aux_loss_enabled,
                **_mm(inputs))
        logps = logps.float()
        mask = inputs["completion_mask"].bool()
        tool = inputs.get("tool_mask")
        acting = mask if tool is None else mask & (tool != 0)  # the tokens the loss acts on (TRL: the mask times it)
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old.float()  # TRL: None when generation is on-policy
        options, scale = self._hk_loss_options(inputs, logps, entropies, old, acting, mode)
        loss, met = losses.grpo(logps, old if ref is None else ref, inputs["advantages"].float(), mask,
                                clip=self.hk_clip, **options)
        loss = loss * scale
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux / (self.current_gradient_accumulation_steps
                                                             if mode == "train" else 1)
        if mode == "train" and self.use_adaptive_entropy:
            self._hk_entropy_controller(met)
        self._hk_log_grpo(mode, met, acting.sum(), aux)
        return loss

    def _hk_loss_options(self, inputs, logps, entropies, old, acting, mode):
        """``hk.losses.grpo``'s keywords from TRL's settings and the micro-batch (``acting``: the completion and
        tool mask), and the scale TRL applies for gradient accumulation (``GRPOTrainer._compute_loss``): "dapo",
        "cispo", "vespo" divide by the window's token count (``num_items_in_batch`` spans the generation batch:
        rescaled to one window), the others and the entropy bonus by the accumulation steps."""
        accum = self.current_gradient_accumulation_steps if mode == "train" else 1
        normalizer, scale, coef = None, 1.0 / accum, self.entropy_coef
        if self.loss_type in _GLOBAL_NORMALIZER_TYPES:
            normalizer = inputs["num_items_in_batch"].float().clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normalizer = normalizer * accum / self.args.steps_per_generation
            scale, coef = 1.0, coef / accum
        kl_ref = None
        if not self.hk_humanline and self.beta != 0.0:
            kl_ref = inputs["ref_per_token_logps"].float()
        options = dict(
            beta=self.beta, epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high, kl_ref_logps=kl_ref,
            loss_type=self.loss_type, normalizer=normalizer, max_completion_length=self.max_completion_length,
            importance_sampling_level=self.importance_sampling_level, delta=self.args.delta,
            sapo_temperature_pos=self.args.sapo_temperature_pos, sapo_temperature_neg=self.args.sapo_temperature_neg,
            vespo_k_pos=self.args.vespo_k_pos, vespo_lambda_pos=self.args.vespo_lambda_pos,
            vespo_k_neg=self.args.vespo_k_neg, vespo_lambda_neg=self.args.vespo_lambda_neg,
            importance_sampling_ratio=self._hk_vllm_weight(inputs), tool_mask=inputs.get("tool_mask"),
            top_entropy_quantile=self.top_entropy_quantile, entropies=entropies.float(), entropy_coef=coef,
            use_adaptive_entropy=self.use_adaptive_entropy, entropy_target=self.args.entropy_target,
            last_world_entropy=self._last_world_entropy, use_bias_correction_kl=self.args.use_bias_correction_kl)
        if self.off_policy_mask_threshold is not None:
            # TRL: the sampler's log-probs (vLLM's), else the old ones (the training policy that sampled)
            options.update(off_policy_mask_threshold=self.off_policy_mask_threshold,
                           sampling_per_token_logps=inputs.get("sampling_per_token_logps", old).float())
        if self.top_entropy_quantile < 1.0:  # TRL's own mask: the quantile over every rank's tokens
            options["entropy_mask"] = self.get_high_entropy_mask(entropies, acting, 1 - self.top_entropy_quantile)
        return options, scale

    def _hk_vllm_weight(self, inputs):
        if not (self.use_vllm and self.vllm_importance_sampling_correction):
            return None
        if "importance_sampling_ratio" not in inputs:
            raise ValueError(
                f"{type(self).__name__}: use_vllm=True with vllm_importance_sampling_correction=True weights the loss "
                "by inputs['importance_sampling_ratio'] (formed by TRL at generation from the old and the sampler's "
                "log-probs), which this batch lacks (a custom rollout_func?); return it, or set "
                "vllm_importance_sampling_correction=False")
        return inputs["importance_sampling_ratio"].float()

    def _hk_entropy_controller(self, met):
        """TRL's adaptive entropy control (Skywork-OR1): window totals of every micro-batch, then at the optimizer
        step the all-reduced mean entropy sets the next step's coefficient (state in TRL's own attributes, which
        TRL checkpoints)."""
        stats = torch.stack([met["entropy_sum"], met["entropy_tokens"]]).detach().float()
        self._entropy_window_stats = stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
        if not self.accelerator.sync_gradients:
            return
        total, count = self.accelerator.reduce(self._entropy_window_stats, reduction="sum").tolist()
        self._last_world_entropy = total / max(count, 1.0)
        a = self.args
        self.entropy_coef = adaptive_entropy_coef(self.entropy_coef, self._last_world_entropy,
                                                  entropy_target=a.entropy_target,
                                                  entropy_coef_delta=a.entropy_coef_delta,
                                                  entropy_coef_min=a.entropy_coef_min,
                                                  entropy_coef_max=a.entropy_coef_max)
        self._entropy_window_stats = None

    def _hk_log_grpo(self, mode, met, n_tokens, aux):
        """TRL's metrics and ``humanline/unclipped_frac``, one host sync: token means are weighted by each rank's
        token count (``n_tokens``, completion and tool mask), per-rank values averaged over the ranks."""
        names = ("kl", "entropy", "clip_frac_low", "clip_frac_high", "unclipped_frac")
        per_rank = {k: v for k, v in (("vespo", met.get("vespo_phi_mean")), ("policy_loss", met.get("policy_loss")),
                                      ("aux", aux)) if v is not None}
        with torch.no_grad():
            n = n_tokens.float()
            stats = torch.stack([met[k].float() * n for k in names] + [n] + [v.float() for v in per_rank.values()])
            reduced = self.accelerator.reduce(stats, reduction="sum").tolist()
        d = max(reduced[len(names)], 1.0)
        kl, ent, low, high, inside = (v / d for v in reduced[:len(names)])
        rest = {k: v / self.accelerator.num_processes for k, v in zip(per_rank, reduced[len(names) + 1:])}
        m = self._metrics[mode]
        if self.beta != 0.0:
            m["kl"].append(kl)
        m["entropy"].append(ent)
        if self.loss_type in _PPO_CLIP_TYPES:
            m["clip_ratio/low_mean"].append(low)
            m["clip_ratio/high_mean"].append(high)
            m["clip_ratio/region_mean"].append(low + high)
        elif self.loss_type == "cispo":
            m["cispo_clip_ratio"].append(high)
        if "vespo" in rest:
            m["vespo/phi_seq_mean"].append(rest["vespo"])
        if "policy_loss" in rest:
            m["policy_loss"].append(rest["policy_loss"])
            if mode == "train" and self.accelerator.sync_gradients:
                m["entropy_coef"].append(self.entropy_coef)
        if "aux" in rest:
            m["aux_loss"].append(rest["aux"])
        m["humanline/unclipped_frac"].append(inside if reduced[len(names)] > 0 else 1.0)


def _precheck_grpo(name, args, lookahead, ref_model):
    """Construction-time refusals of GRPO settings that have no meaning here, each with the reason."""
    _refuse(args.loss_type not in GRPO_LOSS_TYPES,
            f"{name}: loss_type must be one of {GRPO_LOSS_TYPES} (TRL 1.16's), got {args.loss_type!r}")
    _refuse(args.importance_sampling_level not in ("token", "sequence"),
            f"{name}: importance_sampling_level must be 'token' or 'sequence', got {args.importance_sampling_level!r}")
    _refuse(args.delta is not None and args.loss_type not in _PPO_CLIP_TYPES,
            f"{name}: delta (two-sided clipping) caps the ratio of the PPO clip, which loss_type={args.loss_type!r} "
            "does not have (TRL would ignore it); unset delta or use one of " + str(_PPO_CLIP_TYPES))
    if lookahead:
        _refuse(ref_model is not None,
                f"{name}: humanline_reference='lookahead' uses no reference model (the policy computes the "
                "reference log-probs); do not pass ref_model, or use humanline_reference='sync'")
        _refuse(args.eval_strategy != "no",
                f"{name}: evaluation needs reference log-probs of the evaluation completions, which "
                "humanline_reference='lookahead' does not have (no reference model); set eval_strategy='no' or use "
                "humanline_reference='sync'")


def _sequences(inputs):
    """``(input_ids, attention_mask, logits_to_keep)`` of a GRPO micro-batch (prompt, then completion)."""
    completion_ids = inputs["completion_ids"]
    return (torch.cat([inputs["prompt_ids"], completion_ids], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), completion_ids.size(1))


def _supervised(inputs):
    """The head's ranges of a micro-batch (``fused="linear"``): row ``b`` scores its completion's tokens from the
    positions ``[P - 1, P - 1 + n_b)`` (``P`` the left-padded prompts' width, ``n_b`` the completion's length, both
    known on the host: the right padding is skipped too); None without ``hk_completion_lens``."""
    lens = inputs.get("hk_completion_lens")
    if lens is None:
        return None
    P = inputs["prompt_ids"].size(1)
    start = max(P - 1, 0)  # (an empty prompt: the first completion token is not scored)
    return [[start, max(start, P - 1 + n)] for n in lens]


def _mm(inputs):
    return {k: inputs.get(k) for k in _MM_KEYS}


def _no_logps(*args, **kwargs):
    return None, None, None


@contextlib.contextmanager
def _eval_mode(model):
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _no_checkpointing(trainer):
    from trl.models.utils import disable_gradient_checkpointing
    return disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs)


@contextlib.contextmanager
def _rng_untouched():
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield


def _cast_lm_head_to_fp32(model):
    """TRL's ``cast_lm_head_to_fp32`` on a reference model (``GRPOTrainer.__init__`` casts the policy and its own
    reference this way): an fp32 head fed fp32 hidden states, embeddings tied to it still output the model's dtype."""
    head = model.get_output_embeddings()
    dtype = head.weight.dtype
    head.float()
    head.forward = lambda hidden: torch.nn.functional.linear(hidden.float(), head.weight.float(),
                                                             None if head.bias is None else head.bias.float())
    if model.config.tie_word_embeddings:
        model.get_input_embeddings().register_forward_hook(lambda module, args, out: out.to(dtype))
