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
* ``humanline_reference`` ("sync"): "lookahead" (DPO, KTO) keeps no reference model: the policy computes the
  reference log-probs of the coming ``sync_every`` steps' batches at each sync step
  (:class:`humanline_kernels.LookaheadReference`, docs/lookahead.md). GRPO refuses it (online data).

Metric names are TRL's (``rewards/chosen``, ``logps/chosen``, ``kl``, ``clip_ratio/low_mean``, ...) plus
``humanline/unclipped_frac`` (fraction of completion tokens strictly inside the band) and ``humanline/num_syncs``
(reference syncs so far). With humanline on, ``rewards/*`` are β times the *clipped*
summed log-ratios, the rewards the loss sees. ``logits/*`` and ``mean_token_accuracy`` are logged with
``fused="off"`` only (our fused paths do not compute them); GRPO's per-sequence ``clip_ratio/low_min`` and
``clip_ratio/high_max`` are not logged.
"""
from __future__ import annotations

import contextlib
import copy
import warnings
from dataclasses import dataclass, field

import torch
from accelerate.utils import is_peft_model
from transformers.trainer_utils import has_length
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, KTOConfig, KTOTrainer
from trl.models import prepare_deepspeed, prepare_fsdp
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer import dpo_trainer as _dpo_module
from trl.trainer import kto_trainer as _kto_module
from trl.trainer.utils import (add_fused_lm_head, create_model_from_path, disable_dropout_in_model,
                               get_config_model_id, use_adapter)

from .. import losses
from .._clip import HumanlineClip
from ._head import FUSED_MODES, install_head
from .transformers import HumanlineSyncCallback

# The frozen reference adapter the trainers keep on a PEFT policy: TRL's own name for a PEFT reference adapter, so
# TRL's reference forwards (GRPO's included) use it; an existing "ref" adapter (TRL's re-training convention: the
# initial copy of the adapter) is the starting reference and is then synced.
HK_REF_ADAPTER = "ref"

__all__ = ["HumanlineDPOConfig", "HumanlineKTOConfig", "HumanlineGRPOConfig", "HumanlineDPOTrainer",
           "HumanlineKTOTrainer", "HumanlineGRPOTrainer"]


# ---------------------------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------------------------
def _hk_field(default, help_):
    return field(default=default, metadata={"help": help_})


@dataclass
class _HumanlineFields:
    humanline: bool = _hk_field(True, "Humanline clipping and pre-update reference syncing (False: plain objective).")
    log_eps_p: float = _hk_field(-1.5, "Lower end of the per-token log-ratio clip band (paper: -1.5).")
    log_eps_r: float = _hk_field(1.5, "Upper end of the per-token log-ratio clip band (paper: 1.5).")
    sync_every: int = _hk_field(1, "Sync the reference from the policy every this many optimizer steps.")
    fused: str = _hk_field("linear", "Per-token log-probs: 'linear' (hidden+lm_head), 'logits' or 'off' (TRL's).")
    humanline_reference: str = _hk_field(
        "sync", "'sync': a reference model synced from the policy; 'lookahead' (DPO/KTO): no reference model, the "
        "policy computes the reference log-probs of the coming steps' batches at each sync step.")


def _hk_settings(args):
    """Validated ``(humanline, clip, sync_every, fused)`` from a humanline config or a plain TRL config."""
    humanline = getattr(args, "humanline", True)
    if not isinstance(humanline, bool):
        raise ValueError(f"humanline must be a bool, got {humanline!r}")
    clip = HumanlineClip(getattr(args, "log_eps_p", -1.5), getattr(args, "log_eps_r", 1.5))
    every = getattr(args, "sync_every", 1)
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"sync_every must be a positive int, got {every!r}")
    fused = getattr(args, "fused", "linear")
    if fused not in FUSED_MODES:
        raise ValueError(f"fused must be one of {FUSED_MODES}, got {fused!r}")
    return humanline, (clip if humanline else None), every, fused


_REFERENCE_MODES = ("sync", "lookahead")


def _hk_reference_mode(args, name):
    """Validated ``humanline_reference`` ("sync" or "lookahead") from a humanline or a plain TRL config."""
    mode = getattr(args, "humanline_reference", "sync")
    if mode not in _REFERENCE_MODES:
        raise ValueError(f"{name}: humanline_reference must be one of {_REFERENCE_MODES}, got {mode!r}")
    if mode == "lookahead" and not getattr(args, "humanline", True):
        raise ValueError(f"{name}: humanline_reference='lookahead' needs humanline=True (with humanline off the "
                         "reference is the fixed initial model; use humanline_reference='sync')")
    return mode


_GRPO_NO_LOOKAHEAD = (
    "humanline_reference='lookahead' is not available for GRPO: its data is generated online, so the batch of "
    "step t+1 (the policy's own completions after step t's update) does not exist at step t, before the update, "
    "when the lookahead would have to compute its reference log-probs. Use humanline_reference='sync' (or a PEFT "
    "policy, whose reference is a second adapter rather than a second model).")


@dataclass
class HumanlineDPOConfig(_HumanlineFields, DPOConfig):
    """``trl.DPOConfig`` plus ``humanline``, ``log_eps_p``, ``log_eps_r``, ``sync_every``, ``fused``,
    ``humanline_reference``."""

    def __post_init__(self):
        super().__post_init__()
        _hk_settings(self)
        _hk_reference_mode(self, type(self).__name__)


@dataclass
class HumanlineKTOConfig(_HumanlineFields, KTOConfig):
    """``trl.KTOConfig`` plus ``humanline``, ``log_eps_p``, ``log_eps_r``, ``sync_every``, ``fused``,
    ``humanline_reference``."""

    def __post_init__(self):
        super().__post_init__()
        _hk_settings(self)
        _hk_reference_mode(self, type(self).__name__)


@dataclass
class HumanlineGRPOConfig(_HumanlineFields, GRPOConfig):
    """``trl.GRPOConfig`` plus ``humanline``, ``log_eps_p``, ``log_eps_r``, ``sync_every``, ``fused``
    (``humanline_reference`` must stay "sync")."""

    def __post_init__(self):
        super().__post_init__()
        _hk_settings(self)
        if _hk_reference_mode(self, type(self).__name__) == "lookahead":
            raise ValueError(f"{type(self).__name__}: {_GRPO_NO_LOOKAHEAD}")


# ---------------------------------------------------------------------------------------------------------------
# shared trainer machinery
# ---------------------------------------------------------------------------------------------------------------
def _checkpointing_on(args):
    """Activation (gradient) checkpointing requested in the training arguments, under either of its names."""
    return bool(getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", False))


def _refuse(cond, msg):
    if cond:
        raise ValueError(msg)


def _precheck_common(name, args, model, peft_config, humanline):
    _refuse(getattr(args, "precompute_ref_log_probs", False),
            f"{name}: precompute_ref_log_probs=True stores only summed reference log-probs; the humanline losses need "
            "per-token reference log-probs from a live reference model. Set precompute_ref_log_probs=False.")
    if humanline:
        _refuse(args.sync_ref_model,
                f"{name}: sync_ref_model=True (TR-DPO, syncs after the update) conflicts with humanline syncing "
                "(before the update, every sync_every steps). Set sync_ref_model=False.")
    _refuse(getattr(args, "padding_free", False), f"{name}: padding_free=True is not supported")


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
    trainer.hk_lookahead = _hk_reference_mode(args, name) == "lookahead"
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


class _HumanlineMixin:
    """Set-up shared by the three trainers: head patching, the sync callback, metric logging."""

    hk_lookahead = False  # humanline_reference="lookahead" (DPO / KTO only)

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
        self.hk_sync = None
        if self.hk_lookahead:
            return
        if self.ref_model is not None:
            install_head(_hf_module(self.ref_model), self.hk_fused, temperature, entropy=False)
        if self.hk_humanline and peft_policy:
            # PEFT: the reference is a frozen second adapter synced from the trained one (TRL's adapter-disabled
            # reference is the base model, not the pre-update policy that humanline needs); added now, before
            # accelerate wraps the model, so that DDP / FSDP wrap it like the trained adapter
            from ..sync._adapters import ensure_reference_adapter
            unwrapped = self.accelerator.unwrap_model(self.model)
            train_adapter = unwrapped.active_adapter
            ensure_reference_adapter(unwrapped, train=train_adapter, reference=HK_REF_ADAPTER)
            self.hk_sync = HumanlineSyncCallback(every=self.hk_sync_every, adapters=(train_adapter, HK_REF_ADAPTER))
            self.hk_sync._allow_deepspeed = True
            self.add_callback(self.hk_sync)
        elif self.hk_humanline:
            self.hk_sync = HumanlineSyncCallback(every=self.hk_sync_every, ref_model=self.ref_model)
            self.hk_sync._allow_deepspeed = True  # we sync before the backward under DeepSpeed (reference_done)
            self.add_callback(self.hk_sync)

    def _hk_reference_done(self, boundary_only=True):
        """After the step's last reference forward: start the copy (DeepSpeed: finish it before the backward)."""
        if self.hk_sync is None or not self.model.training:
            return
        if boundary_only and not self.accelerator.sync_gradients:
            return
        self.hk_sync.reference_done(blocking=self.is_deepspeed_enabled)

    def _hk_ref_forward(self, kwargs, labels, T, policy=None):
        """Reference per-token log-probs (no grad) of the last ``T`` positions, fp32, from ``self.ref_model``, the
        adapter-disabled PEFT policy or, with the lookahead, ``policy`` itself (in eval mode, put there by
        ``LookaheadReference``)."""
        return self._hk_ref_logps(kwargs, labels, policy)[:, -T:].float()

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

    def _hk_log_common(self, mode, out, mask, attention_mask, clip_counts):
        """TRL's entropy/num_tokens metrics and ours, token-weighted across ranks, one host sync."""
        n_in, n = clip_counts
        ent = out.entropy
        ent_sum = (ent[:, -mask.size(1):].detach() * mask).sum() if ent is not None else n.new_zeros(())
        stats = torch.stack([n_in, n, ent_sum.to(n.dtype), mask.sum().to(n.dtype),
                             attention_mask.sum().to(n.dtype)]).detach()
        n_in, n, ent_sum, n_tok, n_att = self.accelerator.reduce(stats, reduction="sum").tolist()
        m = self._metrics[mode]
        if ent is not None:
            m["entropy"].append(ent_sum / n_tok if n_tok > 0 else 0.0)
        if mode == "train":
            self._total_train_tokens += int(n_att) // getattr(self, "_tp_size", 1)
        m["num_tokens"] = [self._total_train_tokens]
        m["humanline/unclipped_frac"].append(n_in / n if n > 0 else 1.0)

    def log(self, logs, start_time=None):
        if self.model.training and (self.hk_sync is not None or self.hk_lookahead):
            # reference syncs (lookahead: window computations) so far, every sync_every steps
            logs["humanline/num_syncs"] = self.hk_la_syncs if self.hk_lookahead else self.hk_sync.num_syncs
        super().log(logs, start_time)

    # -- humanline_reference="lookahead": the trainer's data flow ---------------------------------------------
    # transformers 5.x Trainer (trainer.py): _inner_training_loop gets the loop's counts from
    # set_initial_training_values and the dataloader from _prepare_for_training; _run_epoch calls set_epoch(epoch) on
    # the dataloader and on its batch_sampler.batch_sampler, makes epoch_iterator = iter(train_dataloader), then for
    # each optimizer step calls get_batch_samples(epoch_iterator, n, device) with n = gradient_accumulation_steps,
    # or steps_in_epoch % gradient_accumulation_steps for the last step of an epoch, and trains on those micro-batches
    # (optimizer.step() after the last one). We take over get_batch_samples: a LookaheadReference draws the same
    # per-step micro-batch lists, in the same order, from a stream that crosses epochs the way _run_epoch does.
    def _hk_reference_of(self, policy, inputs):
        """Per-token reference log-probs of a micro-batch, computed by ``policy`` (see the trainers)."""
        raise NotImplementedError

    def _hk_precheck_lookahead_trainer(self, name):
        # the stream plans the coming steps from the data's length (a dataset without one restarts whenever it runs
        # out, with partial steps that transformers trains without an optimizer step)
        _refuse(self.train_dataset is not None and not has_length(self.train_dataset),
                f"{name}: {_LOOKAHEAD_NEEDS_LENGTH}")
        cp = getattr(self, "get_cp_size", lambda: 1)()
        sp = getattr(self, "get_sp_size", lambda: 1)()
        _refuse(cp > 1 or sp > 1,
                f"{name}: humanline_reference='lookahead' does not support context or sequence parallelism (cp_size="
                f"{cp}, sp_size={sp}): its reference forwards over the coming steps' batches do not split the "
                "sequences; use humanline_reference='sync'")

    def set_initial_training_values(self, args, dataloader, *a, **k):
        if self.hk_lookahead and not has_length(dataloader):
            raise ValueError(f"{type(self).__name__}: {_LOOKAHEAD_NEEDS_LENGTH}")
        values = super().set_initial_training_values(args, dataloader, *a, **k)
        # (num_train_epochs, num_update_steps_per_epoch, num_examples, num_train_samples, total_train_batch_size,
        #  steps_in_epoch, max_steps): the loop bounds of _inner_training_loop / _run_epoch
        self._hk_loop = dict(epochs=values[0], updates_per_epoch=values[1], steps_in_epoch=values[5],
                             max_steps=values[6])
        return values

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if self.hk_lookahead and resume_from_checkpoint is not None:
            raise ValueError(
                f"{type(self).__name__}: resume_from_checkpoint is not supported with humanline_reference="
                "'lookahead' (the checkpoint lacks the reference log-probs already computed for the coming steps, "
                "from a policy that no longer exists); train from the start or use humanline_reference='sync'")
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        self._hk_train_dataloader, self.hk_la, self.hk_la_syncs = train_dataloader, None, 0
        self._hk_loop_iterator = self._hk_loop_epoch = None
        return model, train_dataloader

    def _run_epoch(self, *args, **kwargs):
        # the epoch the loop runs, to check that the lookahead's stream is in the same one
        self._hk_loop_epoch = kwargs["epoch"] if "epoch" in kwargs else args[1]
        return super()._run_epoch(*args, **kwargs)

    def _hk_step_batches(self, first_iterator):
        """Every optimizer step's list of micro-batches from the current step to max_steps, as _run_epoch draws
        them: the epoch iterator it made, then, past the end of an epoch, the next epoch's, made as it would make it
        but earlier (the global torch RNG draws this makes are replayed at the step they belong to: _hk_draw)."""
        loop, accum = self._hk_loop, self.args.gradient_accumulation_steps
        remainder = loop["steps_in_epoch"] % accum or accum
        steps_left = loop["max_steps"] - self.state.global_step
        epoch, iterator = int(self.state.epoch or 0), first_iterator
        while steps_left > 0:
            for update in range(loop["updates_per_epoch"]):
                n = accum if update != loop["updates_per_epoch"] - 1 else remainder
                # what Trainer.get_batch_samples draws (n micro-batches), without its num_items count: that may be
                # a collective (average_tokens_across_devices); it is made for the step when it runs
                batches = _StepBatches(wanted=n, epoch=epoch, first=update == 0)
                for _ in range(n):
                    mb = self._hk_draw(iterator, batches)
                    if mb is _END:
                        break
                    batches.append(mb)
                yield batches
                steps_left -= 1
                if steps_left == 0:
                    return
            epoch += 1
            if epoch >= loop["epochs"]:
                return
            loader = self._hk_train_dataloader
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(epoch)
            inner = getattr(getattr(loader, "batch_sampler", None), "batch_sampler", None)
            if hasattr(inner, "set_epoch"):
                inner.set_epoch(epoch)
            iterator = iter(loader)  # _run_epoch's own iterator for this epoch is then never advanced

    def _hk_draw(self, iterator, step):
        """``next(iterator)`` (or _END), keeping the global CPU RNG as it was. The first draw of an epoch makes
        torch's DataLoader draw its base seed from that RNG (``_BaseDataLoaderIter.__init__``; a RandomSampler
        without a generator also draws its seed). The stream draws ahead, at a sync step, while the stock loop draws
        at the step itself, after the dropout masks of the steps in between: so the draws are undone here and
        replayed by get_batch_samples at that step (``step.rng_draws``), leaving the RNG stream of the training
        steps (dropout) the stock loop's."""
        before = torch.get_rng_state()
        try:
            mb = next(iterator)
        except StopIteration:
            mb = _END
        after = torch.get_rng_state()
        if not torch.equal(before, after):
            draws = _int64_draws(before, after)
            if draws is None:  # not a run of seed draws: leave the RNG as the draw left it
                warnings.warn("humanline_reference='lookahead': the data loader drew from the global torch RNG in a "
                              "way that cannot be replayed at its step; training is valid, but its random stream "
                              "(dropout masks) differs from the stock trainer's", RuntimeWarning, stacklevel=2)
            else:
                torch.set_rng_state(before)
                step.rng_draws += draws
        return mb

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        if not self.hk_lookahead:  # (the training loop is its only caller; the model may still be in eval mode)
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        name = type(self).__name__
        if self.hk_la is None:
            if getattr(self, "_hk_loop_epoch", None) is None or not hasattr(self, "_hk_loop"):
                raise RuntimeError(f"{name}: humanline_reference='lookahead' follows the training loop "
                                   "of transformers 5.x (set_initial_training_values, _prepare_for_training, "
                                   "_run_epoch); this transformers version does not call them")
            from ..sync._lookahead import LookaheadReference
            self.hk_la = LookaheadReference(self.model, self._hk_step_batches(epoch_iterator),
                                            self._hk_reference_of, every=self.hk_sync_every)
        new_epoch = epoch_iterator is not self._hk_loop_iterator
        self._hk_loop_iterator = epoch_iterator
        try:
            batches, refs = next(self.hk_la)
        except StopIteration:
            batches = None
        if batches is None or new_epoch != batches.first or (new_epoch and self._hk_loop_epoch != batches.epoch):
            where = ("asks for a step past the end of the lookahead's planned steps" if batches is None else
                     f"{'starts' if new_epoch else 'goes on with'} epoch {self._hk_loop_epoch} where the lookahead "
                     f"planned {'the first' if batches.first else 'a later'} step of epoch {batches.epoch}")
            raise RuntimeError(
                f"{name}: the training loop left the lookahead's data plan: it {where}. "
                "humanline_reference='lookahead' draws the data of the coming steps in advance, following "
                "transformers' epochs to the end (max_steps); leaving an epoch early (control.should_epoch_stop, "
                "e.g. from a callback) or another training loop is not supported. Use humanline_reference='sync'.")
        if not len(batches) == batches.wanted == num_batches:
            raise RuntimeError(
                f"{name}: the lookahead drew {len(batches)} of the {batches.wanted} micro-batches it planned for this "
                f"step, the training loop asks for {num_batches} (a data loader shorter than its length, or an "
                "unsupported transformers loop?)")
        # The window of the coming steps is computed now, at the start of the step rather than just before its
        # optimizer.step(): the parameters are θ_t either way (nothing changes them before the update), no gradient
        # or activation is alive yet (less memory), and it also holds under DeepSpeed, whose update runs inside
        # the backward.
        self.hk_la_syncs += int(self.hk_la.wait())
        for _ in range(batches.rng_draws):  # this step's data loader seed draws, where the stock loop makes them
            _seed_draw()
        batches = [dict(mb, hk_ref_logps=r) for mb, r in zip(batches, refs)]
        return batches, self._get_num_items_in_batch(batches, device)

    def _hk_lookahead_refs(self, inputs):
        if "hk_ref_logps" not in inputs:
            raise ValueError(f"{type(self).__name__}: with humanline_reference='lookahead' the reference log-probs "
                             "exist only for the training batches (no reference model); evaluation is not supported")
        return inputs["hk_ref_logps"]


_LOOKAHEAD_NEEDS_LENGTH = (
    "humanline_reference='lookahead' needs a training dataset with a length (not an IterableDataset): it draws "
    "the batches of the coming steps in advance along transformers' epochs, which a dataset without a length does "
    "not have (transformers restarts it whenever it runs out, with partial steps that get no optimizer step). "
    "Materialise the data (e.g. datasets.Dataset.from_generator, or a map-style dataset), or use "
    "humanline_reference='sync'.")

_END = object()  # the stream's iterator ran out


class _StepBatches(list):
    """One optimizer step's micro-batches (a list, as LookaheadReference takes them), with the plan they follow:
    how many were asked for (fewer come if the data runs out early), the epoch, whether the step is the epoch's
    first, and the global RNG draws the data loader made for them (replayed at the step)."""

    def __init__(self, *, wanted, epoch, first):
        super().__init__()
        self.wanted, self.epoch, self.first, self.rng_draws = wanted, epoch, first, 0


def _seed_draw():
    """One draw of the global CPU RNG as torch's DataLoader makes it for its base seed (and a RandomSampler for
    its seed)."""
    torch.empty((), dtype=torch.int64).random_()


def _int64_draws(before, after, limit=8):
    """How many :func:`_seed_draw` calls take the global CPU RNG from state ``before`` to ``after``; None if no
    such run does. Leaves the RNG at ``after``."""
    torch.set_rng_state(before)
    for n in range(1, limit + 1):
        _seed_draw()
        if torch.equal(torch.get_rng_state(), after):
            return n
    torch.set_rng_state(after)
    return None


def _hf_module(module):
    """The transformers model inside a DeepSpeed engine / FSDP1 wrapper (FSDP2 and plain modules are it)."""
    while not hasattr(module, "config") and hasattr(module, "module"):
        module = module.module
    return module


def _clip_counts(logps, ref_logps, mask, clip):
    with torch.no_grad():
        clipped, n_in, n = losses.clip_log_ratio(logps.detach(), ref_logps, mask, clip)
    return clipped, (n_in, n)


# ---------------------------------------------------------------------------------------------------------------
# DPO
# ---------------------------------------------------------------------------------------------------------------
_DPO_NON_MODEL = {"completion_mask", "ref_chosen_logps", "ref_rejected_logps", "hk_ref_logps"}


class HumanlineDPOTrainer(_HumanlineMixin, DPOTrainer):
    """``trl.DPOTrainer`` with humanline clipping and syncing (``loss_type=["sigmoid"]``)."""

    def __init__(self, model, ref_model=None, args=None, *posargs, peft_config=None, **kwargs):
        if args is None:
            args = HumanlineDPOConfig("humanline-dpo")
        self.hk_humanline, self.hk_clip, self.hk_sync_every, self.hk_fused = _hk_settings(args)
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


# ---------------------------------------------------------------------------------------------------------------
# KTO
# ---------------------------------------------------------------------------------------------------------------
_KTO_NON_MODEL = {"completion_mask", "KL_input_ids", "KL_attention_mask", "KL_completion_mask", "KL_token_type_ids",
                  "KL_mm_token_type_ids", "label", "ref_logps", "ref_KL_logps", "hk_ref_logps"}


class HumanlineKTOTrainer(_HumanlineMixin, KTOTrainer):
    """``trl.KTOTrainer`` with humanline clipping and syncing (``loss_type="kto"``; KL baseline as in HALOs)."""

    def __init__(self, model, ref_model=None, args=None, *posargs, peft_config=None, **kwargs):
        if args is None:
            args = HumanlineKTOConfig("humanline-kto")
        self.hk_humanline, self.hk_clip, self.hk_sync_every, self.hk_fused = _hk_settings(args)
        _precheck_common(type(self).__name__, args, model, peft_config, self.hk_humanline)
        _refuse(args.loss_type != "kto", f"HumanlineKTOTrainer supports loss_type='kto' only, got {args.loss_type!r}")
        with _lookahead_init(self, args, ref_model, _kto_module):
            super().__init__(model, ref_model, args, *posargs, peft_config=peft_config, **kwargs)
        self._hk_setup()

    def _hk_inputs(self, batch):
        """Model keyword arguments, labels and completion mask ``[B, T]`` of a micro-batch."""
        kw = {k: v for k, v in batch.items() if k not in _KTO_NON_MODEL}
        kw["use_cache"] = False
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
        kw.update(input_ids=batch["KL_input_ids"], attention_mask=batch["KL_attention_mask"], use_cache=False)
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
        out = model(**kw, labels=labels, fused_lm_head=True)
        logps = out.log_probs[:, -T:].float()
        loss, met = losses.kto(logps, ref_logps, mask, desirable, kl, kl_ref, kl_mask, clip=self.hk_clip,
                               beta=self.beta, desirable_weight=self.desirable_weight,
                               undesirable_weight=self.undesirable_weight)
        if self.aux_loss_enabled and out.aux_loss is not None:
            loss = loss + self.router_aux_loss_coef * out.aux_loss
        self._hk_log_kto(mode, out, logps, ref_logps, mask, desirable, met["kl"], batch["attention_mask"])
        if return_outputs:
            with torch.no_grad():
                return loss, model(**kw)
        return loss

    def _hk_log_kto(self, mode, out, logps, ref_logps, mask, desirable, z0, attention_mask):
        clipped, counts = _clip_counts(logps, ref_logps, mask, self.hk_clip)
        self._hk_log_common(mode, out, mask, attention_mask, counts)
        with torch.no_grad():
            r, lp, d = self.beta * clipped.sum(1), logps.detach().sum(1), desirable.float()
            s = torch.stack([(r * d).sum(), (lp * d).sum(), d.sum(), (r * (1 - d)).sum(), (lp * (1 - d)).sum(),
                             (1 - d).sum()])
            if out.mean_logits is not None:
                ml = out.mean_logits[:, -mask.size(1):] * mask
                md = mask & desirable[:, None]
                mu = mask & ~desirable[:, None]
                s = torch.cat([s, torch.stack([(ml * md).sum(), md.sum().float(), (ml * mu).sum(), mu.sum().float()])])
            s = self.accelerator.reduce(s, reduction="sum").tolist()
        m = self._metrics[mode]
        m["kl"].append(float(z0))
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


# ---------------------------------------------------------------------------------------------------------------
# GRPO
# ---------------------------------------------------------------------------------------------------------------
_GRPO_LOSS_TYPES = ("dapo", "bnpo", "grpo", "dr_grpo")


class HumanlineGRPOTrainer(_HumanlineMixin, GRPOTrainer):
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
        self.hk_humanline, self.hk_clip, self.hk_sync_every, self.hk_fused = _hk_settings(args)
        name = type(self).__name__
        _refuse(_hk_reference_mode(args, name) == "lookahead", f"{name}: {_GRPO_NO_LOOKAHEAD}")
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
