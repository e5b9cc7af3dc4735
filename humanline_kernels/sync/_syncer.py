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

With ``slices`` > 1 the parameter copy of ``start()`` goes in that many parts through the policy's forward and
backward instead of at once (:mod:`._pace` says how and why); the copy is the same, only when its bytes reach the
memory system changes.
"""
from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from types import SimpleNamespace

import torch
from torch import nn

from ._adapters import adapter_pairs, ensure_reference_adapter, local_data
from ._backends import Pairs, collect_pairs
from ._copy import CopyPlan
from ._pace import _Pace


def check_options(*, every=1, overlap=True, use_kernel=None, slices=1, copy_engine=True):
    """The schedule's options, checked before anything is built or written: by the syncer, its adapter form (before
    it adds the reference adapter) and ``HumanlineSyncCallback`` (at construction). A flag is a bool, not something
    ``bool()`` would turn into one (``overlap="no"`` is true)."""
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"every must be a positive int, got {every!r}")
    if not isinstance(overlap, bool):
        raise ValueError(f"overlap must be a bool, got {overlap!r}")
    if use_kernel is not None and not isinstance(use_kernel, bool):  # (1 in (None, True, False) holds)
        raise ValueError(f"use_kernel must be None, True or False, got {use_kernel!r}")
    if not isinstance(slices, int) or isinstance(slices, bool) or slices < 1:
        raise ValueError(f"slices must be a positive int, got {slices!r}")
    if not isinstance(copy_engine, bool):
        raise ValueError(f"copy_engine must be a bool, got {copy_engine!r}")


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
            ``True`` (require it) or ``False`` (always ``_foreach_copy_``; the extension is never built).
        copy_engine: on CUDA, same-device copies without a cast go to the copy engines (``True``, the default:
            they take no SMs from the compute the copy overlaps); ``False`` copies them with the kernel (or
            ``_foreach_copy_``) as the casting ones (docs/sync.md, "How the copy runs").
        slices: issue ``start()``'s copy in this many parts spread through the policy's forward and backward
            (hooks on its leaf modules; see the module docstring) instead of all at once. 1 (the default): at once.
            Eager models only: a compiled or graph-captured policy counts no point, so its copy goes at once.
    """

    def __init__(self, policy: nn.Module, reference: nn.Module, every: int = 1, overlap: bool = True,
                 use_kernel: bool | None = None, slices: int = 1, copy_engine: bool = True):
        check_options(every=every, overlap=overlap, use_kernel=use_kernel, slices=slices, copy_engine=copy_engine)
        for name, m in (("policy", policy), ("reference", reference)):
            if not isinstance(m, nn.Module):
                raise ValueError(f"{name} must be a torch.nn.Module (plain, DDP, FSDP or DeepSpeed-wrapped), got "
                                 f"{type(m).__name__}")
        if policy is reference:
            raise ValueError("policy and reference must be different modules")
        self.policy, self.reference = policy, reference
        self.every = every
        self.overlap = overlap
        self.use_kernel = use_kernel
        self.copy_engine = copy_engine
        self._step = 0
        self._started = False     # a copy was launched in the current step
        self._aborted = False     # a step failed after its copy was launched: see abort()
        self._pairs = None        # backend pair set, collected lazily and re-collected on structural change
        self._streams: dict = {}  # device -> side stream
        self._done: dict = {}     # device -> event recorded on the side stream after the copy
        self.slices = slices
        self._pace = _Pace(self) if slices > 1 else None

    # ---- counter -------------------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Optimizer steps counted so far (the index of the current step)."""
        return self._step

    @property
    def is_sync_step(self) -> bool:
        return self._step % self.every == 0

    def state_dict(self) -> dict:
        """``{"step", "every"}``: the schedule. The reference's weights are not in it: a resume that must train as
        the uninterrupted run saves them too, with :func:`humanline_kernels.save_humanline_state` (docs/sync.md,
        "Resume"). Between steps only (not between ``start()`` and ``wait()``)."""
        self._check_between_steps("state_dict()")
        return {"step": self._step, "every": self.every}

    def load_state_dict(self, state: dict) -> None:
        """Restore the step counter (for resume) and re-collect the parameter pairs on the next sync.

        ``every`` stays what this syncer was built with: a saved ``every`` that differs only warns (so a run can
        be resumed with a new sync period on purpose; step t syncs when ``t % every == 0`` with the new one).
        The reference's weights are restored by :func:`humanline_kernels.load_humanline_state`, not here.
        """
        if self._started:
            raise RuntimeError("load_state_dict() called between start() and wait()")
        if not isinstance(state, Mapping) or "step" not in state:
            raise ValueError(f"state must be a dict with 'step' (and 'every'), as state_dict() returns, got "
                             f"{type(state).__name__}{'' if not isinstance(state, Mapping) else ' without step'}")
        step = state["step"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"state['step'] must be a non-negative int, got {step!r}")
        saved_every = state.get("every")
        if saved_every is not None and (not isinstance(saved_every, int) or isinstance(saved_every, bool)
                                        or saved_every < 1):
            raise ValueError(f"state['every'] must be a positive int, got {saved_every!r}")
        if saved_every is not None and saved_every != self.every:
            warnings.warn(f"ReferenceSyncer.load_state_dict: the state was saved with every={saved_every!r}, this "
                          f"syncer has every={self.every}; keeping every={self.every} (build the syncer with "
                          f"every={saved_every!r} to resume the saved schedule)", UserWarning, stacklevel=2)
        self._step = step
        self._aborted = False
        self.refresh()

    def refresh(self) -> None:
        """Forget the collected parameter pairs (they are re-collected and re-checked on the next sync), and with
        ``slices`` > 1 the hooked modules (hooked again on the next sync)."""
        self._pairs = None
        if self._pace is not None:
            self._pace.unhook()

    # ---- the three calls -------------------------------------------------------------------------------------
    def start(self) -> bool:
        """After the last reference forward of the step: launch the copy if this is a sync step.

        Returns whether this step syncs. A second call in the same step is a no-op (the policy has not changed).
        """
        self._check_not_aborted()
        if not self.is_sync_step:
            return False
        if not self._started:
            if self._pace is not None:
                self._pace.begin(self._plan(late=False).split(self.slices))
            else:
                self._launch(side=self.overlap)
            self._started = True
        return True

    def wait(self) -> bool:
        """Before ``optimizer.step()``: complete this step's copy (copying now if not started), advance the step.

        Returns whether this step synced. Orders the current CUDA stream after the copy; no host synchronisation.
        """
        self._check_not_aborted()
        synced = self.is_sync_step
        if synced:
            if self._started:
                self._finish_started()
            else:
                self._launch(side=False)
            self._copy_late()
        self._started = False
        self._step += 1
        return synced

    def sync(self) -> bool:
        """``start()`` + ``wait()``: the copy (on a sync step) is ordered before anything queued afterwards."""
        self.start()
        return self.wait()

    def abort(self) -> bool:
        """Call when a step failed (an exception) after ``start()`` and before ``wait()``. Returns whether the
        reference was changed by that step.

        The copy that ``start()`` launched is never half-applied: it is completed here (a stream-ordered sequence
        of kernels on the side stream, finished on the current one), so the reference holds the whole policy of
        the failed step, θ_t, while that step's loss needed θ_s, s the sync before it. Retrying the step in place
        would therefore train against the wrong reference; so after a changed reference ``start()``, ``wait()``
        and ``state_dict()`` raise until the state is restored from the last checkpoint
        (:func:`humanline_kernels.load_humanline_state`, or ``load_state_dict`` after restoring the reference's
        weights yourself). A failure before ``start()`` changed nothing: the step can be retried as it is.
        """
        if not self._started:
            return False
        self._finish_started(learn=False)
        self._copy_late()  # the late pairs too: the reference is wholly θ_t
        self._started = False
        self._aborted = True
        return True

    def copy_now(self) -> None:
        """Copy the whole policy into the reference now, outside the schedule (the counter does not move): how a
        resume without saved reference weights starts (``save_reference=False``)."""
        self._check_between_steps("copy_now()")
        self._launch(side=False)
        self._copy_late()

    def _check_between_steps(self, what):
        if self._started:
            raise RuntimeError(f"ReferenceSyncer.{what} between start() and wait(): the reference is being "
                               "replaced by this step's policy; call it between steps")
        self._check_not_aborted()

    def _check_not_aborted(self):
        if self._aborted:
            raise RuntimeError(
                f"ReferenceSyncer: step {self._step} failed after its reference copy had started (abort()), so the "
                "reference now holds that step's policy instead of the one its loss needs; restore the last "
                "checkpoint (hk.load_humanline_state) before training on")

    # ---- internals -------------------------------------------------------------------------------------------
    def _launch(self, side: bool) -> None:
        self._issue(self._plan(late=False), side)

    def _copy_late(self) -> None:
        """Copy the late pairs (buffers, ZeRO-3 gathered data) on the current streams: in ``wait()``, ``abort()`` and
        ``copy_now()``, after the early copy (not through :meth:`_issue`, which runs the early copy or its parts)."""
        with torch.no_grad():
            plan = self._plan(late=True)
            for d in plan.devices():
                plan.run(d)

    def _issue(self, plan: CopyPlan, side: bool) -> None:
        """Run ``plan``: with ``side``, each CUDA device's groups on its side stream after what the device's current
        stream has queued (``self._done`` then holds the event that completes them); otherwise on the current
        streams."""
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

    def _finish_started(self, learn: bool = True) -> None:
        """Issue what a paced copy has left, then order the current streams after the side streams' copies."""
        if self._pace is not None:
            self._pace.end(learn)
        for d, ev in self._done.items():
            torch.cuda.current_stream(d).wait_event(ev)
        self._done = {}

    def _collect(self):
        return collect_pairs(self.policy, self.reference)

    def _persistent_pairs(self) -> SimpleNamespace:
        """The reference's rank-local storage, paired with the policy's (what a checkpoint saves): ``pairs`` (the
        backend's Pairs), ``entries`` ``[(name, reference tensor, policy tensor)]``, ``backend``, ``sharded``."""
        for _ in range(2):
            if self._pairs is None:
                self._pairs = self._collect()
            entries = self._pairs.persistent()
            if all(d is not None and s is not None and d.shape == s.shape for _, d, s in entries):
                p = self._pairs
                return SimpleNamespace(pairs=p, entries=entries, backend=p.backend, sharded=p.sharded)
            self._pairs = None  # structure changed: re-collect once
        raise RuntimeError("reference/policy parameter pairs changed while being collected")

    def _plan(self, late: bool) -> CopyPlan:
        if self._pairs is None:
            self._pairs = self._collect()
        got = self._pairs.resolve(late)
        if got is None:  # structure changed (load_state_dict(assign=True), .to(), a new layout): re-collect
            self._pairs = self._collect()
            got = self._pairs.resolve(late)
            if got is None:
                raise RuntimeError("reference/policy parameter pairs changed while being collected")
        return CopyPlan(*got, use_kernel=self.use_kernel, copy_engine=self.copy_engine)

    @classmethod
    def for_adapters(cls, peft_model: nn.Module, train: str = "default", reference: str = "reference",
                     every: int = 1, overlap: bool = True, use_kernel: bool | None = None, copy_engine: bool = True):
        """Humanline sync between two adapters of one PEFT model: the reference is a frozen copy of the trained
        adapter, so no second base model is held and a sync copies adapter weights only. See
        :mod:`humanline_kernels.sync._adapters`; run reference forwards under :func:`hk.reference_adapter`."""
        return AdapterSyncer(peft_model, train=train, reference=reference, every=every, overlap=overlap,
                             use_kernel=use_kernel, copy_engine=copy_engine)

    def __repr__(self) -> str:
        backend = self._pairs.backend if self._pairs is not None else "?"
        return (f"ReferenceSyncer(every={self.every}, overlap={self.overlap}, step={self._step}, "
                f"backend={backend})")


class AdapterSyncer(ReferenceSyncer):
    """``ReferenceSyncer`` whose reference is the adapter ``reference`` of ``peft_model`` and whose policy is the
    adapter ``train`` (same protocol: ``start()``, ``wait()``, ``sync()``, ``state_dict()``). Built by
    :meth:`ReferenceSyncer.for_adapters`, which calls :func:`ensure_reference_adapter` first."""

    def __init__(self, peft_model: nn.Module, train: str = "default", reference: str = "reference", every: int = 1,
                 overlap: bool = True, use_kernel: bool | None = None, copy_engine: bool = True):
        # before the adapter is added
        check_options(every=every, overlap=overlap, use_kernel=use_kernel, copy_engine=copy_engine)
        peft_model = ensure_reference_adapter(peft_model, train, reference)
        # the syncer's policy/reference are the same module: the pairs come from the adapter names instead
        super().__init__(peft_model, _Same(peft_model), every=every, overlap=overlap, use_kernel=use_kernel,
                         copy_engine=copy_engine)
        self.train_adapter, self.reference_adapter = train, reference

    def _collect(self):
        model = self.policy
        params = dict(model.named_parameters())
        pairs = Pairs("peft-adapters")
        for ref, src in adapter_pairs(model, self.train_adapter, self.reference_adapter):
            pairs.add(ref, functools.partial(local_data, params[ref]), functools.partial(local_data, params[src]))
            pairs.sharded |= hasattr(params[ref].data, "_local_tensor")  # FSDP2: the adapters are sharded too
        return pairs

    def __repr__(self) -> str:
        return (f"AdapterSyncer(train={self.train_adapter!r}, reference={self.reference_adapter!r}, "
                f"every={self.every}, overlap={self.overlap}, step={self._step})")


class _Same(nn.Module):
    """Placeholder reference (the base class refuses ``policy is reference``); holds no parameters."""

    def __init__(self, model):
        super().__init__()
        self.__dict__["target"] = model  # not a submodule

