"""``ReferenceSyncer``: copy the policy's weights into the reference every ``every`` optimizer steps, before the step.

Step counting (docs/design.md, "Syncing"): ``step`` counts optimizer steps from 0 and advances by one in ``wait()``,
which is called exactly once per optimizer step, right before ``optimizer.step()``. Step t is a sync step when
``t % every == 0``. ``start()`` may be called at most once per step, after the *last* reference forward of
the step (with gradient accumulation: after all micro-batches' reference forwards); it launches the copy on
sync steps and never moves the counter. ``wait()`` completes a started copy (stream-ordered, no host sync),
or does the whole copy itself if ``start()`` was not called, then advances the counter. So with gradient
accumulation it syncs once per optimizer step however many micro-batches there are. After the sync of step t
the reference holds θ_t, the policy before step t's update.

Parameter shards/partitions are copied from ``start()`` (on a side stream when ``overlap``); buffers and the
gathered full data of ZeRO-3 params are copied in ``wait()`` on the current stream, because the policy forward
between the two may change them (BatchNorm running stats) or free and reuse their memory (a ZeRO-3 param the
policy held gathered at ``start()``): copying them concurrently would race, and after the forward they are what
the policy holds at the step.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from ._backends import collect_pairs
from ._copy import CopyPlan


class ReferenceSyncer:
    """Humanline sync of ``reference`` from ``policy`` (plain module, DDP, FSDP1, FSDP2, DeepSpeed ZeRO-1/2/3).

    Both models must be wrapped identically (same sharding, grouping/auto-wrap, mesh); the reference may keep a
    lower-precision copy of floating parameters (e.g. bf16 reference, fp32 policy): the copy casts. Its shards may
    live on the CPU while the policy's are on CUDA (FSDP1 ``CPUOffload``, FSDP2 ``CPUOffloadPolicy``, verl's
    reference): the device-to-host copy runs on the policy device's side stream, asynchronously into pinned
    memory, and the reference's own forward (whose host-to-device copies FSDP orders after the current stream) sees
    it; a host read of those CPU shards must synchronize the CUDA stream first.

    Per optimizer step: reference forward(s) -> ``start()`` -> policy forward/backward -> ``wait()`` ->
    ``optimizer.step()``. ``sync()`` is ``start()`` + ``wait()``.

    Args:
        policy: the trained model (possibly wrapped).
        reference: the reference model, wrapped the same way.
        every: sync every ``every`` optimizer steps (step t syncs when ``t % every == 0``).
        overlap: on CUDA, run the copy on a side stream ordered by events; otherwise on the current stream.
        use_kernel: ``None`` (auto: the csrc/ kernel when built or JIT-buildable, else ``torch._foreach_copy_``),
            ``True`` (require it) or ``False`` (always ``_foreach_copy_``).
    """

    def __init__(self, policy: nn.Module, reference: nn.Module, every: int = 1, overlap: bool = True,
                 use_kernel: bool | None = None):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        if policy is reference:
            raise ValueError("policy and reference must be different modules")
        self.policy, self.reference = policy, reference
        self.every = every
        self.overlap = bool(overlap)
        self.use_kernel = use_kernel
        self._step = 0
        self._started = False     # a copy was launched in the current step
        self._pairs = None        # backend pair set, collected lazily and re-collected on structural change
        self._streams: dict = {}  # device -> side stream
        self._done: dict = {}     # device -> event recorded on the side stream after the copy

    # ---- counter -------------------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Optimizer steps counted so far (the index of the current step)."""
        return self._step

    @property
    def is_sync_step(self) -> bool:
        return self._step % self.every == 0

    def state_dict(self) -> dict:
        return {"step": self._step, "every": self.every}

    def load_state_dict(self, state: dict) -> None:
        """Restore the step counter (for resume) and re-collect the parameter pairs on the next sync.

        ``every`` stays what this syncer was built with: a saved ``every`` that differs only warns (so a run can
        be resumed with a new sync period on purpose; step t syncs when ``t % every == 0`` with the new one).
        """
        if self._started:
            raise RuntimeError("load_state_dict() called between start() and wait()")
        step = state["step"]
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"state['step'] must be a non-negative int, got {step!r}")
        saved_every = state.get("every")
        if saved_every is not None and saved_every != self.every:
            warnings.warn(f"ReferenceSyncer.load_state_dict: the state was saved with every={saved_every!r}, this "
                          f"syncer has every={self.every}; keeping every={self.every} (build the syncer with "
                          f"every={saved_every!r} to resume the saved schedule)", UserWarning, stacklevel=2)
        self._step = step
        self.refresh()

    def refresh(self) -> None:
        """Forget the collected parameter pairs (they are re-collected and re-checked on the next sync)."""
        self._pairs = None

    # ---- the three calls -------------------------------------------------------------------------------------
    def start(self) -> bool:
        """After the last reference forward of the step: launch the copy if this is a sync step.

        Returns whether this step syncs. A second call in the same step is a no-op (the policy has not changed).
        """
        if not self.is_sync_step:
            return False
        if not self._started:
            self._launch(side=self.overlap)
            self._started = True
        return True

    def wait(self) -> bool:
        """Before ``optimizer.step()``: complete this step's copy (copying now if not started), advance the step.

        Returns whether this step synced. Orders the current CUDA stream after the copy; no host synchronisation.
        """
        synced = self.is_sync_step
        if synced:
            if self._started:
                for d, ev in self._done.items():
                    torch.cuda.current_stream(d).wait_event(ev)
                self._done = {}
            else:
                self._launch(side=False)
            with torch.no_grad():
                plan = self._plan(late=True)
                for d in plan.devices():
                    plan.run(d)
        self._started = False
        self._step += 1
        return synced

    def sync(self) -> bool:
        """``start()`` + ``wait()``: the copy (on a sync step) is ordered before anything queued afterwards."""
        self.start()
        return self.wait()

    # ---- internals -------------------------------------------------------------------------------------------
    def _launch(self, side: bool) -> None:
        plan = self._plan(late=False)
        with torch.no_grad():
            by_dev = plan.devices()
            cuda_devs = [d for d in by_dev if d.type == "cuda"]
            if side and cuda_devs:
                for d in cuda_devs:
                    stream = self._streams.get(d)
                    if stream is None:
                        stream = self._streams[d] = torch.cuda.Stream(device=d)
                    ready = torch.cuda.Event()
                    ready.record(torch.cuda.current_stream(d))
                    stream.wait_event(ready)
                    with torch.cuda.stream(stream):
                        plan.run(d)
                    done = torch.cuda.Event()
                    done.record(stream)
                    self._done[d] = done
                for d in by_dev:
                    if d.type != "cuda":
                        plan.run(d)
            else:
                for d in by_dev:
                    plan.run(d)

    def _collect(self):
        return collect_pairs(self.policy, self.reference)

    def _plan(self, late: bool) -> CopyPlan:
        if self._pairs is None:
            self._pairs = self._collect()
        got = self._pairs.resolve(late)
        if got is None:  # structure changed (load_state_dict(assign=True), .to(), a new layout): re-collect
            self._pairs = self._collect()
            got = self._pairs.resolve(late)
            if got is None:
                raise RuntimeError("reference/policy parameter pairs changed while being collected")
        return CopyPlan(*got, use_kernel=self.use_kernel)

    @classmethod
    def for_adapters(cls, peft_model: nn.Module, train: str = "default", reference: str = "reference",
                     every: int = 1, overlap: bool = True, use_kernel: bool | None = None):
        """Humanline sync between two adapters of one PEFT model: the reference is a frozen copy of the trained
        adapter, so no second base model is held and a sync copies adapter weights only. See
        :mod:`humanline_kernels.sync._adapters`; run reference forwards under :func:`hk.reference_adapter`."""
        from ._adapters import AdapterSyncer
        return AdapterSyncer(peft_model, train=train, reference=reference, every=every, overlap=overlap,
                             use_kernel=use_kernel)

    def __repr__(self) -> str:
        backend = self._pairs.backend if self._pairs is not None else "?"
        return (f"ReferenceSyncer(every={self.every}, overlap={self.overlap}, step={self._step}, "
                f"backend={backend})")
