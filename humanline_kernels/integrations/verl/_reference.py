"""``HumanlineReference``: humanline syncing of verl's reference engine from the actor, inside the actor update.

What k counts. verl's actor update (``TrainingWorker.train_mini_batch``) splits a verl step's batch into
mini-batches and runs ``ppo_epochs`` passes over them; each ``train_batch`` call is one optimizer step
(``BaseEngine.train_batch``: zero_grad, forward/backward over the micro-batches, ``optimizer_step``). k =
``policy_loss.sync_every`` counts those optimizer steps over the whole run, S = mini-batches x ``ppo_epochs`` of
them per verl step; step t (from 0) syncs when ``t % k == 0``, after its forward/backward and before its update,
so during step t+1 the reference holds theta_t (DESIGN.md's humanline syncing, the same counter as
``ReferenceSyncer``).

Exact also when a sync falls inside a verl step. verl computes ``ref_log_prob`` once per verl step, before the
update, with the reference as the previous verl steps left it. At optimizer step t of a verl step that starts at
step t0, the reference must hold theta_s, s = the last sync step before t:

* s < t0: verl's ``ref_log_prob`` is that reference's: kept;
* s == t0: theta_t0 is the actor as verl's ``old_log_prob`` saw it (computed by the actor before the update), so
  ``ref_log_prob`` is replaced by ``old_log_probs`` (no forward; the lookahead idea of ``hk.LookaheadReference``);
* t0 < s < t: ``ref_log_prob`` is recomputed for that mini-batch with the synced reference engine.

So with k a multiple of S (every sync at the first step of a verl step) nothing is recomputed; with k = 1 and S > 1
every mini-batch after the second of a verl step costs one reference forward.

The copy is ``ReferenceSyncer`` on the two FSDP engines' modules, shard to shard: the actor's shards (GPU) into
the reference's CPU-offloaded ones, on the side stream during the step's forward/backward, completed in the
engine's ``optimizer_step`` (wrapped) before the update.
"""
from __future__ import annotations

from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import no_padding_2_padding, response_from_nested

from ...sync import ReferenceSyncer

__all__ = ["HumanlineReference"]


class HumanlineReference:
    """Sync ``ref`` (a forward-only verl ``TrainingWorker``) from ``actor`` every ``every`` optimizer steps.

    Args:
        actor, ref: verl ``TrainingWorker`` objects in this process (``ActorRolloutRefWorker.actor`` / ``.ref``).
        every: k, in optimizer steps.
        sync: ``False`` for ``reference='frozen'``: nothing is synced or recomputed.
        save_reference: :meth:`save_state` writes the reference's shards (``False``: the counter only).
    """

    def __init__(self, actor, ref, every: int, sync: bool = True, save_reference: bool = True):
        self.actor, self.ref = actor, ref
        self.save_reference = save_reference
        self.syncer = ReferenceSyncer(actor.engine.module, ref.engine.module, every=every) if sync else None
        self.syncs = 0           # syncs completed so far
        self._last_sync = -1     # the optimizer step of the last sync (-1: none yet)
        self._update_start = 0   # the optimizer step the current verl step's update started at
        self.recomputed = 0      # mini-batches whose ref_log_prob was recomputed with the reference engine
        self.from_old = 0        # mini-batches whose ref_log_prob was taken from old_log_probs
        engine_step = actor.engine.optimizer_step

        def optimizer_step():
            self._before_update()
            return engine_step()
        actor.engine.optimizer_step = optimizer_step  # wait() before the update, whatever calls it

    @property
    def step(self) -> int:
        """Optimizer steps counted so far."""
        return 0 if self.syncer is None else self.syncer.step

    def begin_update(self) -> None:
        """At the start of a verl step's actor update (its ``ref_log_prob`` was computed just before)."""
        self._update_start = self.step

    def before_step(self, data) -> None:
        """Before one optimizer step on mini-batch ``data``: a stale ``ref_log_prob`` is replaced, the copy starts."""
        if self.syncer is None:
            return
        if "ref_log_prob" in data.keys() and self._last_sync >= self._update_start:
            if self._last_sync == self._update_start:
                data["ref_log_prob"] = data["old_log_probs"].to(data["ref_log_prob"].dtype)
                self.from_old += 1
            else:
                self._recompute(data)
        self.syncer.start()

    def _before_update(self) -> None:
        if self.syncer is None:
            return
        t = self.syncer.step
        if self.syncer.wait():
            self.syncs += 1
            self._last_sync = t

    def sync_now(self) -> None:
        """Copy the actor into the reference now, outside the schedule (a checkpoint without humanline state)."""
        if self.syncer is not None:
            self.syncer.copy_now()

    def save_state(self, folder) -> None:
        """The reference's shards (one file per rank), the counter and the counts into ``folder``, on every rank,
        between verl steps (:func:`humanline_kernels.save_humanline_state`). Nothing for ``reference='frozen'``:
        verl rebuilds that reference from the model path."""
        if self.syncer is None:
            return
        from ...sync._state import save_humanline_state
        save_humanline_state(folder, syncer=self.syncer, save_reference=self.save_reference, extra={
            "syncs": self.syncs, "last_sync": self._last_sync, "recomputed": self.recomputed,
            "from_old": self.from_old})

    def load_state(self, folder) -> None:
        """Restore :meth:`save_state`'s ``folder`` after verl restored the actor (checked first on every rank)."""
        if self.syncer is None:
            return
        from ...sync._state import read_humanline_state
        loaded = read_humanline_state(folder, syncer=self.syncer)
        counts = [loaded.counter("syncs"), loaded.counter("last_sync", minimum=-1), loaded.counter("recomputed"),
                  loaded.counter("from_old")]  # (checked before anything is restored)
        loaded.apply()
        self.syncs, self._last_sync, self.recomputed, self.from_old = counts
        self._update_start = self.step

    def _recompute(self, data) -> None:
        """``data['ref_log_prob']`` from the reference as it is now, in the layout the trainer gave it."""
        if self.ref.engine_config.get("ulysses_sequence_parallel_size", 1) > 1:
            raise ValueError("policy_loss.sync_every: a sync inside a verl step (sync_every not a multiple of the "
                             "optimizer steps per verl step) needs the reference log-probs recomputed on every rank, "
                             "which verl's ulysses sequence parallelism does not return; make sync_every a multiple "
                             "of ppo_epochs x mini-batches per step, or use ulysses_sequence_parallel_size=1")
        td = data.copy()  # infer_batch writes its own settings into the mini-batch it is given
        tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False)
        out = self.ref.infer_batch(td)
        log_probs = tu.get(out, "log_probs")
        old = data["ref_log_prob"]
        # the trainer's own conversion for each layout: v1 keeps responses nested, the legacy trainer pads them
        new = response_from_nested(log_probs, data["response_mask"]) if old.is_nested else \
            no_padding_2_padding(log_probs, data)
        data["ref_log_prob"] = new.to(old.dtype)
        self.recomputed += 1
