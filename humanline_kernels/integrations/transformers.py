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
syncer is built at ``on_train_begin``, after accelerate has wrapped the models (DDP / FSDP), and its step
counter starts at ``state.global_step`` (so resuming from a checkpoint keeps the sync phase).

Overlap: a trainer that knows when its last reference forward of the step is done calls
:meth:`HumanlineSyncCallback.reference_done`; the copy then runs on a side CUDA stream during the policy's
forward/backward. Without that call the copy runs, blocking, in ``on_pre_optimizer_step``.

DeepSpeed: accelerate runs the DeepSpeed optimizer step *inside* ``accelerator.backward``, so
``on_pre_optimizer_step`` comes after the update. A plain Trainer under DeepSpeed is refused; the humanline TRL
trainers call ``reference_done(blocking=True)`` before the backward instead.
"""
from __future__ import annotations

from transformers import TrainerCallback

__all__ = ["HumanlineSyncCallback"]


class HumanlineSyncCallback(TrainerCallback):
    """Sync the trainer's reference model from the policy before every ``every``-th optimizer step.

    Args:
        every: sync every ``every`` optimizer steps (step t, counted from 0, syncs when ``t % every == 0``).
        ref_model: the reference model (as the trainer holds it). If None, the ``ref_model`` keyword of the
            callback events is used (TRL's ``CallbackHandlerWithRefModel`` pattern).
        overlap: let the copy run on a side CUDA stream (when :meth:`reference_done` is called).
        adapters: ``(train, reference)`` adapter names when the policy is a PEFT model whose reference is a frozen
            second adapter (:meth:`humanline_kernels.ReferenceSyncer.for_adapters`); then no reference model.
    """

    def __init__(self, every: int = 1, ref_model=None, overlap: bool = True, adapters=None):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        self.every = every
        self.ref_model = ref_model
        self.adapters = adapters  # (train, reference) adapter names of a PEFT policy: no reference model
        self.overlap = bool(overlap)
        self.syncer = None
        self.num_syncs = 0          # optimizer steps that synced, for logging and tests
        self.last_synced = False    # whether the latest optimizer step synced
        self._allow_deepspeed = False  # set by trainers that sync before the backward
        self._waited = False        # reference_done(blocking=True) already completed this step

    # -- set up ------------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, ref_model=None, **kwargs):
        if getattr(args, "deepspeed_plugin", None) is not None and not self._allow_deepspeed:
            raise ValueError(
                "HumanlineSyncCallback cannot sync before the update under DeepSpeed: accelerate runs the DeepSpeed "
                "optimizer step inside accelerator.backward, before on_pre_optimizer_step. Use the humanline TRL "
                "trainers (humanline_kernels.integrations.trl), which sync before the backward.")
        if self.adapters is not None:
            if model is None:
                raise ValueError("HumanlineSyncCallback: the trainer passed no model to on_train_begin")
            from .. import ReferenceSyncer
            train, ref_name = self.adapters
            self.syncer = ReferenceSyncer.for_adapters(_unwrap(model), train=train, reference=ref_name,
                                                       every=self.every, overlap=self.overlap)
            self.syncer.load_state_dict({"step": int(state.global_step)})
            self._waited = False
            return
        reference = self.ref_model if self.ref_model is not None else ref_model
        if reference is None:
            raise ValueError(
                "HumanlineSyncCallback needs the reference model: pass HumanlineSyncCallback(ref_model=...) or use a "
                "callback handler that passes ref_model= to the events")
        if model is None:
            raise ValueError("HumanlineSyncCallback: the trainer passed no model to on_train_begin")
        from .. import ReferenceSyncer

        self.syncer = ReferenceSyncer(_unwrap(model), _unwrap(reference), every=self.every, overlap=self.overlap)
        self.syncer.load_state_dict({"step": int(state.global_step)})
        self._waited = False

    # -- per step ----------------------------------------------------------------------------------------------
    def reference_done(self, blocking: bool = False) -> None:
        """Called by a trainer after the last reference forward of the optimizer step (training only).

        Launches the copy on sync steps (overlapped on CUDA). ``blocking=True`` completes the copy and the step's
        sync at once (for DeepSpeed, where the update happens inside the backward).
        """
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


def _unwrap(module):
    """Strip a DDP / DataParallel wrapper: the reference is never DDP-wrapped (accelerate prepares it in evaluation
    mode), and the syncer wants both models wrapped alike. FSDP and DeepSpeed modules are left to the syncer."""
    name = type(module).__name__
    if name in ("DistributedDataParallel", "DataParallel") and hasattr(module, "module"):
        return module.module
    return module
