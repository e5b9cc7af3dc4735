"""What the humanline TRL trainers share: set-up and prechecks, the reference forward, syncing (a reference model,
a PEFT reference adapter, or the lookahead), logging."""
from __future__ import annotations

import contextlib
import os
from typing import NamedTuple, Optional

import torch
import transformers
from accelerate.utils import is_peft_model
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import use_adapter

from .._head import install_head
from ..transformers import HumanlineSyncCallback, LookaheadTrainerMixin, _refuse
from ._layouts import CU_SEQLENS, last_positions, supervised_key
from .config import reference_mode

# The frozen reference adapter the trainers keep on a PEFT policy: TRL's own name for a PEFT reference adapter, so
# TRL's reference forwards (GRPO's included) use it; an existing "ref" adapter (TRL's re-training convention: the
# initial copy of the adapter) is the starting reference and is then synced.
HK_REF_ADAPTER = "ref"


def _checkpointing_on(args):
    """Activation (gradient) checkpointing requested in the training arguments, under either of its names."""
    return bool(getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", False))




def _precheck_common(name, args, model, peft_config, humanline):
    _refuse(getattr(args, "precompute_ref_log_probs", False),
            f"{name}: precompute_ref_log_probs=True stores only summed reference log-probs; the humanline losses need "
            "per-token reference log-probs from a live reference model. Set precompute_ref_log_probs=False.")
    if humanline:
        _refuse(args.sync_ref_model,
                f"{name}: sync_ref_model=True (TR-DPO, syncs after the update) conflicts with humanline syncing "
                "(before the update, every sync_every steps). Set sync_ref_model=False.")


def _precheck_lookahead(name, args, ref_model):
    if ref_model is not None:
        raise ValueError(f"{name}: humanline_reference='lookahead' uses no reference model (the policy computes the "
                         "reference log-probs); do not pass ref_model, or use humanline_reference='sync'")
    _refuse(args.eval_strategy != "no",
            f"{name}: evaluation needs reference log-probs of the evaluation batches, which humanline_reference="
            "'lookahead' does not have (no reference model); set eval_strategy='no' or use humanline_reference='sync'")


def _lookahead_init(trainer, args, ref_model, trl_module):
    """Set ``trainer.hk_lookahead`` from ``args``; the context TRL's ``__init__`` runs in (with the lookahead: the
    lookahead's prechecks, then no reference model loaded)."""
    name = type(trainer).__name__
    trainer.hk_lookahead = reference_mode(args, name) == "lookahead"
    if not trainer.hk_lookahead:
        return contextlib.nullcontext()
    _precheck_lookahead(name, args, ref_model)
    return _no_trl_reference(trainer, trl_module)


@contextlib.contextmanager
def _no_trl_reference(trainer, trl_module):
    """Keep TRL from loading a reference model. TRL 1.16 (dpo_trainer.py 908-927, kto_trainer.py 919-938) loads one
    with ``create_model_from_path(get_config_model_id(self.model.config), ...)`` when ``ref_model`` is None, unless
    the policy is a PEFT model or ``precompute_ref_log_probs`` is set (which would precompute summed log-probs, hash
    the model and, under FSDP, still load a reference). The same function loads a policy given by path earlier in
    ``__init__``, before ``self.model`` is set (Trainer.__init__): so calls made once the trainer has its model
    are the reference's, and get None (TRL then skips every reference step: ``if self.ref_model is not None``)."""
    load = trl_module.create_model_from_path

    def policy_only(*args, **kwargs):
        return None if "model" in vars(trainer) else load(*args, **kwargs)
    trl_module.create_model_from_path = policy_only
    try:
        yield
    finally:
        trl_module.create_model_from_path = load



# transformers 5.17-5.22 (Trainer._load_from_checkpoint): when a checkpoint holds adapters in subfolders (a PEFT
# policy with humanline's "ref" adapter always does), only those are loaded, not the trained one at its root, so the
# resumed policy is the initial adapter (our fingerprint check refuses the resume). 5.23 loads the root adapter too;
# before it, we do.
_ROOT_ADAPTER_LOADED = tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 23)
_ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")


def _load_root_adapter(model, folder):
    if _ROOT_ADAPTER_LOADED or not (hasattr(model, "active_adapters") and hasattr(model, "load_adapter")):
        return
    if not any(os.path.isfile(os.path.join(folder, f)) for f in _ADAPTER_FILES):
        return
    active = model.active_adapters[0]
    model.load_adapter(folder, active, is_trainable=True)
    model.set_adapter(active)


class StepStats(NamedTuple):
    """What the DPO / KTO logs read of a micro-batch's loss, formed once with it: per row the clamped log-ratio sums
    ``s`` and the policy's sums (as TRL logs them), the masked tokens strictly inside the band and all of them, and
    KTO's baseline ``z0``."""

    s: torch.Tensor
    policy: torch.Tensor
    n_unclipped: torch.Tensor
    n_tokens: torch.Tensor
    kl: Optional[torch.Tensor] = None


class HumanlineMixin(LookaheadTrainerMixin):
    """Set-up shared by the three trainers: head patching, the sync callback, metric logging."""

    def _hk_setup(self, temperature=1.0):
        name = type(self).__name__
        peft_policy = self.ref_model is None and is_peft_model(self.model)
        self.hk_la, self.hk_la_syncs = None, 0
        if self.hk_lookahead:
            # no reference model and no reference adapter: the policy computes the reference log-probs
            if self.ref_model is not None:
                raise RuntimeError(f"{name}: TRL built a reference model despite humanline_reference='lookahead'")
            self._hk_precheck_lookahead_trainer(name)
        elif self.ref_model is None and self.hk_humanline and not peft_policy:
            raise ValueError(f"{name}: humanline needs a reference model (pass ref_model=... or let TRL build one)")
        _refuse(self.hk_fused != "off" and getattr(self, "aux_loss_enabled", False),
                f"{name}: the MoE router auxiliary loss is only supported with fused='off'")
        policy = self.model.get_base_model() if is_peft_model(self.model) else self.model
        install_head(policy, self.hk_fused, temperature)
        # the head's supervised ranges (fused="linear"): none under a prompt-learning adapter, whose virtual tokens
        # shift every position of the rows the ranges are counted on (the head then runs dense)
        self.hk_supervised = self.hk_fused == "linear" and not _prompt_learning(self.model)
        self.hk_sync = None
        if self.hk_lookahead:
            return
        if self.ref_model is not None:
            install_head(_hf_module(self.ref_model), self.hk_fused, temperature, entropy=False)
        if self.hk_humanline and peft_policy:
            # PEFT: the reference is a frozen second adapter synced from the trained one (TRL's adapter-disabled
            # reference is the base model, not the pre-update policy that humanline needs); added now, before
            # accelerate wraps the model, so that DDP / FSDP wrap it like the trained adapter
            from ...sync._adapters import ensure_reference_adapter
            unwrapped = self.accelerator.unwrap_model(self.model)
            train_adapter = unwrapped.active_adapter
            ensure_reference_adapter(unwrapped, train=train_adapter, reference=HK_REF_ADAPTER)
            self.hk_sync = HumanlineSyncCallback(every=self.hk_sync_every, adapters=(train_adapter, HK_REF_ADAPTER),
                                                 save_reference=self.hk_save_reference)
        elif self.hk_humanline:
            self.hk_sync = HumanlineSyncCallback(every=self.hk_sync_every, ref_model=self.ref_model,
                                                 save_reference=self.hk_save_reference)
        if self.hk_sync is not None:
            self.hk_sync._allow_deepspeed = True  # we sync before the backward under DeepSpeed (reference_done)
            self.hk_sync._owner_saves = True      # _save_checkpoint writes the state, into the exact folder
            self.add_callback(self.hk_sync)

    @property
    def hk_save_reference(self):
        return getattr(self.args, "save_reference", True)

    # ------------------------------------------------------------------------------------------- resume
    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        out = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if self.hk_sync is not None:  # restored by the callback in on_train_begin, which comes next
            self.hk_sync.resume_from = resume_from_checkpoint
        return out

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        _load_root_adapter(self.model if model is None else model, resume_from_checkpoint)

    def _save_checkpoint(self, model, trial):
        # the humanline state first, then transformers' files (its trainer_state.json last, then the rotation of old
        # checkpoints): a process killed while any of it is written leaves the previous checkpoint whole
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self._hk_save_state(folder)
        super()._save_checkpoint(model, trial)

    def _hk_save_state(self, folder):
        if self.hk_lookahead:
            if self.hk_la is not None:
                self._hk_save_lookahead(folder, self.hk_la, self.hk_la_syncs)
        elif self.hk_sync is not None and self.hk_sync.syncer is not None:
            self.hk_sync.save_state(folder, self.state)

    def _hk_reference_done(self, boundary_only=True):
        """After the step's last reference forward: start the copy (DeepSpeed: finish it before the backward)."""
        if self.hk_sync is None or not self.model.training:
            return
        if boundary_only and not self.accelerator.sync_gradients:
            return
        self.hk_sync.reference_done(blocking=self.is_deepspeed_enabled)

    def _hk_ref_forward(self, kwargs, labels, T, policy=None):
        """Reference per-token log-probs (no grad) on the mask's ``T`` positions (``last_positions``), fp32, from
        ``self.ref_model``, the adapter-disabled PEFT policy or, with the lookahead, ``policy`` itself (in eval mode,
        put there by ``LookaheadReference``)."""
        return last_positions(self._hk_ref_logps(kwargs, labels, policy), T).float()

    def _hk_head_layout(self, inputs, prefix=""):
        """The head's keywords for the supervised ranges the collator added (``fused="linear"`` only: the other
        heads take none), with the packed stream's boundaries when the batch is packed."""
        ranges = inputs.get(supervised_key(prefix))
        if not self.hk_supervised or ranges is None:
            return {}
        return {"hk_supervised": ranges, "hk_cu_seqlens": inputs.get(CU_SEQLENS)}

    def _hk_ref_logps(self, kwargs, labels, policy):
        # only when checkpointing is on: TRL's helper asks the model about it through deprecated transformers 5 names
        ckpt = (disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs)
                if _checkpointing_on(self.args) else contextlib.nullcontext())
        with torch.no_grad(), ckpt:
            if policy is not None:
                # no entropy: a reference needs none (TRL's head, fused="off", computes its fixed outputs anyway)
                extra = {"hk_entropy": False} if self.hk_fused != "off" else {}
                return policy(**kwargs, labels=labels, fused_lm_head=True, **extra).log_probs
            if self.ref_model is None and is_peft_model(self.model):
                unwrapped = self.accelerator.unwrap_model(self.model)
                with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
                    return self.model(**kwargs, labels=labels, fused_lm_head=True).log_probs
            return self.ref_model(**kwargs, labels=labels, fused_lm_head=True).log_probs

    def _hk_log_common(self, mode, ent, mask, num_tokens, clip_counts):
        """TRL's entropy/num_tokens metrics and ours, token-weighted across ranks, one host sync (``ent``: the
        head's entropy on the mask's positions, or None; ``num_tokens``: the micro-batch's input tokens)."""
        n_in, n = clip_counts
        ent_sum = (ent.detach() * mask).sum() if ent is not None else n.new_zeros(())
        stats = torch.stack([n_in, n, ent_sum.to(n.dtype), mask.sum().to(n.dtype),
                             torch.as_tensor(num_tokens, device=n.device).to(n.dtype)]).detach()
        n_in, n, ent_sum, n_tok, n_att = self.accelerator.reduce(stats, reduction="sum").tolist()
        m = self._metrics[mode]
        if ent is not None:
            m["entropy"].append(ent_sum / n_tok if n_tok > 0 else 0.0)
        if mode == "train":
            self._total_train_tokens += int(n_att) // getattr(self, "_tp_size", 1)
        m["num_tokens"] = [self._total_train_tokens]
        m["humanline/unclipped_frac"].append(n_in / n if n > 0 else 1.0)

    def _hk_policy_kwargs(self):
        """Extra keywords of the DPO / KTO policy forward: a MoE model's router logits when its auxiliary loss is on
        (TRL 1.16 asks for them explicitly, since a model config may leave ``output_router_logits`` False)."""
        return {"output_router_logits": True} if self.aux_loss_enabled else {}

    def _hk_add_aux_loss(self, mode, loss, out):
        """``loss`` plus the weighted MoE router loss, logged as TRL logs it (DPO / KTO)."""
        if not self.aux_loss_enabled:
            return loss
        self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(out.aux_loss).mean().item())
        return loss + self.router_aux_loss_coef * out.aux_loss

    def log(self, logs, start_time=None):
        if self.model.training and (self.hk_sync is not None or self.hk_lookahead):
            # reference syncs (lookahead: window computations) so far, every sync_every steps
            logs["humanline/num_syncs"] = self.hk_la_syncs if self.hk_lookahead else self.hk_sync.num_syncs
        super().log(logs, start_time)


def _prompt_learning(model):
    """A PEFT model whose active adapter prepends virtual tokens (prompt tuning, prefix tuning, P-tuning)."""
    return is_peft_model(model) and model.active_peft_config.is_prompt_learning


def _hf_module(module):
    """The transformers model inside a DeepSpeed engine / FSDP1 wrapper (FSDP2 and plain modules are it)."""
    while not hasattr(module, "config") and hasattr(module, "module"):
        module = module.module
    return module
