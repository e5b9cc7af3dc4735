"""``HumanlineSyncCallback``: humanline reference syncing for any ``transformers.Trainer``.

Humanline syncing copies the policy into the reference every ``every`` optimizer steps *after* the backward and
*before* ``optimizer.step()``, so during step t+1 the reference holds θ_t, the policy before step t's update.
transformers fires ``on_pre_optimizer_step`` exactly there (after gradient clipping, once per optimizer step
however many micro-batches are accumulated), which is where this callback calls
:meth:`humanline_kernels.ReferenceSyncer.wait`. TRL's ``SyncRefModelCallback`` runs in ``on_step_end``, after
the update: that gives reference == policy and is not humanline.

How the callback reaches the reference: callback events carry the policy (``model``) but not the reference, so
pass it to the constructor (``HumanlineSyncCallback(every=k, ref_model=trainer.ref_model)``) or use a callback
handler that adds ``ref_model=`` to every event, as TRL's experimental ``CallbackHandlerWithRefModel`` does. The
syncer is built at ``on_train_begin``, after accelerate has wrapped the models (DDP / FSDP).

Resume: every checkpoint gets the humanline state (the reference as of the last sync, the schedule), written
just before the trainer's own files, and a resumed run restores it in ``on_train_begin``, so it trains exactly as
the run that never stopped (:mod:`humanline_kernels.sync._state`).

Overlap: a trainer that knows when its last reference forward of the step is done calls
:meth:`HumanlineSyncCallback.reference_done`; the copy then runs on a side CUDA stream during the policy's
forward/backward. Without that call the copy runs, blocking, in ``on_pre_optimizer_step``.

DeepSpeed: accelerate runs the DeepSpeed optimizer step *inside* ``accelerator.backward``, so
``on_pre_optimizer_step`` comes after the update. A plain Trainer under DeepSpeed is refused; the humanline TRL
trainers call ``reference_done(blocking=True)`` before the backward instead.

:class:`LookaheadTrainerMixin` gives any ``transformers.Trainer`` the lookahead reference
(:class:`humanline_kernels.LookaheadReference`, docs/lookahead.md): no reference model; at each sync step the
policy computes the reference log-probs of the coming steps' micro-batches, which reach the training step as
``inputs["hk_ref_logps"]``.
"""
from __future__ import annotations

import os
import warnings

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, has_length

from ..sync._adapters import check_adapter_names
from ..sync._syncer import check_options

__all__ = ["HumanlineSyncCallback", "LookaheadTrainerMixin", "RUN_MARKER"]


class HumanlineSyncCallback(TrainerCallback):
    """Sync the trainer's reference model from the policy before every ``every``-th optimizer step.

    Args:
        every: sync every ``every`` optimizer steps (step t, counted from 0, syncs when ``t % every == 0``).
        ref_model: the reference model (as the trainer holds it). If None, the ``ref_model`` keyword of the
            callback events is used (TRL's ``CallbackHandlerWithRefModel`` pattern).
        overlap: let the copy run on a side CUDA stream (when :meth:`reference_done` is called).
        adapters: ``(train, reference)`` adapter names when the policy is a PEFT model whose reference is a frozen
            second adapter (:meth:`humanline_kernels.ReferenceSyncer.for_adapters`); then no reference model.
        save_reference: write the reference's weights into every checkpoint (``humanline_state.json`` and
            ``humanline_reference*.safetensors`` in ``checkpoint-N/``), so that a resumed run trains exactly as the
            uninterrupted one. ``False`` saves the schedule only: a resume then starts the reference from the
            resumed policy, with a warning.
        resume_from: the checkpoint folder a resumed run continues from, when it is not
            ``output_dir/checkpoint-<global_step>`` (nor ``args.resume_from_checkpoint``); the humanline TRL
            trainers set it themselves.

    Resume (docs/integrations.md): the state is saved when the trainer is about to save a checkpoint (the step's
    or epoch's end, where ``control.should_save`` is set; ``on_save`` as the fallback for a save decided later)
    into ``output_dir/checkpoint-<global_step>``, and restored in ``on_train_begin`` when the run resumes
    (``state.global_step > 0``): the reference's weights, the step counter and ``num_syncs``, checked first.
    Every checkpoint's ``trainer_state.json`` also marks the run as a humanline one (:data:`RUN_MARKER`). A
    checkpoint without humanline state is refused, except one written by a stock run (no marker, no humanline
    metric in its log history): humanline then starts at the resumed step with the reference as built, with a
    warning.
    """

    def __init__(self, every: int = 1, ref_model=None, overlap: bool = True, adapters=None, save_reference=True,
                 resume_from=None):
        # checked here, where the mistake is made, not at on_train_begin or the first sync
        check_options(every=every, overlap=overlap)
        if not isinstance(save_reference, bool):
            raise ValueError(f"save_reference must be a bool, got {save_reference!r}")
        if ref_model is not None and not isinstance(ref_model, torch.nn.Module):
            raise ValueError(f"ref_model must be a torch.nn.Module or None, got {type(ref_model).__name__}")
        if adapters is not None:
            if not isinstance(adapters, (tuple, list)) or len(adapters) != 2:
                raise ValueError(f"adapters must be a pair of adapter names (train, reference) or None, got "
                                 f"{adapters!r}")
            check_adapter_names(*adapters, what="adapters")
            if ref_model is not None:
                raise ValueError("adapters makes the reference a second adapter of the policy, with no reference "
                                 "model: pass adapters or ref_model, not both")
            adapters = tuple(adapters)
        if resume_from is not None and not isinstance(resume_from, (str, os.PathLike)):
            raise ValueError(f"resume_from must be a checkpoint folder (str or os.PathLike) or None, got "
                             f"{type(resume_from).__name__}")
        self.every = every
        self.ref_model = ref_model
        self.adapters = adapters  # (train, reference) adapter names of a PEFT policy: no reference model
        self.overlap = overlap
        self.save_reference = save_reference
        self.resume_from = resume_from
        self.syncer = None
        self.num_syncs = 0          # optimizer steps that synced, for logging and tests
        self.last_synced = False    # whether the latest optimizer step synced
        self._allow_deepspeed = False  # set by trainers that sync before the backward
        self._owner_saves = False   # set by trainers that save the state themselves (before their checkpoint)
        self._saved_step = None     # global step whose checkpoint got the state
        self._waited = False        # reference_done(blocking=True) already completed this step

    # -- set up ------------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, ref_model=None, **kwargs):
        if getattr(args, "deepspeed_plugin", None) is not None and not self._allow_deepspeed:
            raise ValueError(
                "HumanlineSyncCallback cannot sync before the update under DeepSpeed: accelerate runs the DeepSpeed "
                "optimizer step inside accelerator.backward, before on_pre_optimizer_step. Use the humanline TRL "
                "trainers (humanline_kernels.integrations.trl), which sync before the backward.")
        if model is None:
            raise ValueError("HumanlineSyncCallback: the trainer passed no model to on_train_begin")
        from .. import ReferenceSyncer
        if self.adapters is not None:
            train, ref_name = self.adapters
            self.syncer = ReferenceSyncer.for_adapters(_unwrap(model), train=train, reference=ref_name,
                                                       every=self.every, overlap=self.overlap)
        else:
            reference = self.ref_model if self.ref_model is not None else ref_model
            if reference is None:
                raise ValueError(
                    "HumanlineSyncCallback needs the reference model: pass HumanlineSyncCallback(ref_model=...) or use "
                    "a callback handler that passes ref_model= to the events")
            self.syncer = ReferenceSyncer(_unwrap(model), _unwrap(reference), every=self.every, overlap=self.overlap)
        self._waited = False
        self.num_syncs, self._saved_step = 0, None
        if state.global_step > 0:
            self._resume(args, state)  # (reads the resumed checkpoint's marker before this run's replaces it)
        _mark_run(state, "sync")

    def _resume(self, args, state):
        from ..sync._state import DamagedHumanlineState, MissingHumanlineState, read_humanline_state
        folder = self._resume_folder(args, state)
        try:
            loaded = read_humanline_state(folder, syncer=self.syncer)
            saved_step, num_syncs = loaded.counter("global_step"), loaded.counter("num_syncs")
        except MissingHumanlineState as e:
            marked = _marked_run(state)
            if marked is not None or any("humanline/num_syncs" in log for log in state.log_history):
                why = (f"its trainer_state.json marks a humanline run (humanline_reference={marked!r})"
                       if marked is not None else "its log history shows a humanline run")
                raise ValueError(f"HumanlineSyncCallback: {e}; but {why}, whose reference as of its last sync "
                                 f"cannot be rebuilt: resuming would train against another reference. "
                                 f"{_start_over(folder)}") from None
            warnings.warn(f"HumanlineSyncCallback: {e}. Resuming a stock run with humanline: syncing starts at step "
                          f"{state.global_step} (the first sync at the next multiple of every={self.every}) with the "
                          "reference as built (the initial model)", UserWarning, stacklevel=2)
            self.syncer.load_state_dict({"step": int(state.global_step)})
            return
        except DamagedHumanlineState as e:
            raise DamagedHumanlineState(f"HumanlineSyncCallback: {e}. {_start_over(folder)}") from None
        if saved_step != state.global_step:
            raise ValueError(f"HumanlineSyncCallback: {folder} holds the humanline state of global step "
                             f"{saved_step}, the run resumes at step {state.global_step}")
        loaded.apply()
        self.num_syncs = num_syncs

    def _resume_folder(self, args, state):
        candidates = [self.resume_from, getattr(args, "resume_from_checkpoint", None),
                      os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")]
        for c in candidates:
            if isinstance(c, (str, os.PathLike)) and os.path.isdir(c):
                return os.fspath(c)
        raise ValueError(
            f"HumanlineSyncCallback: the run resumes at global step {state.global_step}, but its checkpoint folder "
            f"is not {candidates[-1]}; pass HumanlineSyncCallback(resume_from=<the checkpoint folder>)")

    # -- checkpoints -----------------------------------------------------------------------------------------
    def save_state(self, folder, state) -> None:
        """Write the humanline state (reference weights, schedule, ``num_syncs``) into ``folder``, on every rank."""
        from ..sync._state import save_humanline_state
        if self.syncer is None:
            raise RuntimeError("HumanlineSyncCallback.save_state before on_train_begin")
        save_humanline_state(folder, syncer=self.syncer, save_reference=self.save_reference,
                             extra={"global_step": int(state.global_step), "num_syncs": self.num_syncs})
        self._saved_step = state.global_step

    def _save_if_due(self, args, state, control):
        # before the trainer writes checkpoint-N (and, with save_total_limit, deletes older ones): a process killed
        # meanwhile leaves the previous checkpoint whole
        if control.should_save and not self._owner_saves and self._saved_step != state.global_step:
            self.save_state(os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"), state)

    def on_step_end(self, args, state, control, **kwargs):
        self._save_if_due(args, state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._save_if_due(args, state, control)

    def on_save(self, args, state, control, **kwargs):
        # a save decided after on_step_end (save_strategy="best"): written after the trainer's own files
        if not self._owner_saves and self._saved_step != state.global_step:
            self.save_state(os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"), state)

    # -- per step ----------------------------------------------------------------------------------------------
    def reference_done(self, blocking: bool = False) -> None:
        """Called by a trainer after the last reference forward of the optimizer step (training only).

        Launches the copy on sync steps (overlapped on CUDA). ``blocking=True`` completes the copy and the step's
        sync at once (for DeepSpeed, where the update happens inside the backward).
        """
        if not isinstance(blocking, bool):
            raise ValueError(f"blocking must be a bool, got {blocking!r}")
        if self.syncer is None or self._waited:
            return
        if blocking:
            self._finish()
            self._waited = True
        else:
            self.syncer.start()

    def on_step_begin(self, args, state, control, **kwargs):
        self._waited = False  # in case the backend skipped on_pre_optimizer_step after a blocking sync

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.syncer is None:
            raise RuntimeError("HumanlineSyncCallback.on_pre_optimizer_step before on_train_begin")
        if self._waited:  # this step already synced before its backward
            self._waited = False
            return
        self._finish()

    def _finish(self) -> None:
        self.last_synced = bool(self.syncer.wait())
        self.num_syncs += int(self.last_synced)

    def state_dict(self) -> dict:
        return {} if self.syncer is None else self.syncer.state_dict()


# Our entry in the stateful_callbacks of trainer_state.json, which transformers writes into every checkpoint and
# reads back on resume: it marks a humanline run's checkpoints from the first one on, whether anything was logged
# before it or not, and it stays when the humanline files are lost. Set directly rather than through an
# ExportableState callback: transformers indexes those by class name at every save and fails on a resumed state
# that lacks the entry (a stock checkpoint resumed with humanline).
RUN_MARKER = "humanline_kernels"


def _mark_run(state, reference):
    callbacks = getattr(state, "stateful_callbacks", None)
    if isinstance(callbacks, dict):  # (always, in a TrainerState)
        callbacks[RUN_MARKER] = {"reference": reference}


def _marked_run(state):
    """The humanline reference mode the resumed checkpoint records, or None (a stock run's checkpoint, or one
    written before the marker)."""
    entry = (getattr(state, "stateful_callbacks", None) or {}).get(RUN_MARKER)
    if entry is None:
        return None
    return entry.get("reference", "unknown") if isinstance(entry, dict) else "unknown"


def _start_over(folder):
    return (f"Resume from a checkpoint whose humanline files are whole, or start over deliberately: a new run from "
            f"the weights in {folder} (the model loaded from that folder, without resume_from_checkpoint), whose "
            "reference starts as that policy")


def _refuse(cond, msg):
    if cond:
        raise ValueError(msg)


def _unwrap(module):
    """Strip a DDP / DataParallel wrapper: the reference is never DDP-wrapped (accelerate prepares it in evaluation
    mode), and the syncer wants both models wrapped alike. FSDP and DeepSpeed modules are left to the syncer."""
    name = type(module).__name__
    if name in ("DistributedDataParallel", "DataParallel") and hasattr(module, "module"):
        return module.module
    return module


class LookaheadTrainerMixin:
    """Mix into a ``transformers.Trainer`` (before it in the bases) for the lookahead reference.

    Set ``self.hk_lookahead = True`` and ``self.hk_sync_every = k`` in ``__init__`` and define
    ``_hk_reference_of(self, policy, inputs)``: the per-token reference log-probs of one micro-batch, computed by
    ``policy`` (in eval mode, no grad); ``compute_loss`` then finds them as ``inputs["hk_ref_logps"]``
    (:meth:`_hk_lookahead_refs`). The training data must have a length and the training loop must be transformers
    5's (it is followed step by step); each is refused with the reason. ``hk_la_syncs`` counts the windows computed
    so far. Resume: a checkpoint written with :meth:`_hk_save_lookahead` holds the window's reference log-probs
    (they came from a policy that no longer exists), restored when the lookahead is built again.
    """

    hk_lookahead = False
    hk_sync_every = 1
    hk_la = None
    hk_la_syncs = 0

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
        if self.hk_lookahead and resume_from_checkpoint is not None and self.args.ignore_data_skip:
            raise ValueError(
                f"{type(self).__name__}: resume_from_checkpoint with ignore_data_skip=True and humanline_reference="
                "'lookahead': the checkpoint's reference log-probs belong to the batches the run would have trained "
                "on next, which ignore_data_skip does not give it; set ignore_data_skip=False")
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        self._hk_train_dataloader, self.hk_la, self.hk_la_syncs = train_dataloader, None, 0
        self._hk_loop_iterator = self._hk_loop_epoch = None
        self._hk_resume_dir = resume_from_checkpoint  # the lookahead's state is restored when it is built
        if self.hk_lookahead:
            _mark_run(self.state, "lookahead")
        return model, train_dataloader

    def _hk_restore_lookahead(self, lookahead):
        """On resume: the lookahead's saved state (its window, its position) into ``lookahead``; returns the number
        of windows computed before the checkpoint (the ``humanline/num_syncs`` metric)."""
        from ..sync._state import DamagedHumanlineState, MissingHumanlineState, read_humanline_state
        folder = getattr(self, "_hk_resume_dir", None)
        if folder is None:
            return 0
        name = type(self).__name__
        try:
            loaded = read_humanline_state(folder, lookahead=lookahead)
            saved_step, num_syncs = loaded.counter("global_step"), loaded.counter("num_syncs")
        except MissingHumanlineState as e:
            raise ValueError(f"{name}: {e}. humanline_reference='lookahead' resumes only from its own checkpoints: "
                             "the reference log-probs of the coming steps came from a policy that no longer "
                             f"exists. {_start_over(folder)}") from None
        except DamagedHumanlineState as e:
            raise DamagedHumanlineState(f"{name}: {e}. {_start_over(folder)}") from None
        if saved_step != self.state.global_step:
            raise ValueError(f"{name}: {folder} holds the humanline state of global step {saved_step}, the run "
                             f"resumes at step {self.state.global_step}")
        loaded.apply()
        return num_syncs

    def _hk_save_lookahead(self, folder, lookahead, num_syncs):
        from ..sync._state import save_humanline_state
        save_humanline_state(folder, lookahead=lookahead,
                             extra={"global_step": int(self.state.global_step), "num_syncs": int(num_syncs)})

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
        # a resumed run starts inside an epoch, where transformers' _init_training_state puts it (the epoch
        # iterator it made skips the steps trained before the checkpoint)
        epoch, start = divmod(self.state.global_step, loop["updates_per_epoch"])
        iterator = first_iterator
        while steps_left > 0:
            for update in range(start, loop["updates_per_epoch"]):
                n = accum if update != loop["updates_per_epoch"] - 1 else remainder
                # what Trainer.get_batch_samples draws (n micro-batches), without its num_items count: that may be
                # a collective (average_tokens_across_devices); it is made for the step when it runs
                batches = _StepBatches(wanted=n, epoch=epoch, first=update == start)
                for _ in range(n):
                    mb = self._hk_draw(iterator, batches)
                    if mb is _END:
                        break
                    batches.append(mb)
                yield batches
                steps_left -= 1
                if steps_left == 0:
                    return
            epoch, start = epoch + 1, 0
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
            self.hk_la_syncs = self._hk_restore_lookahead(self.hk_la)
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

