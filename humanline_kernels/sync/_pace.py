"""A sync's copy issued in slices through the step: ``ReferenceSyncer(..., slices=n)``.

Between ``start()`` and ``wait()`` the policy's parameters do not change (its forward and backward read them; the
update comes after ``wait()``), so any part of the copy may be issued at any point of that window. ``_Pace`` cuts the
copy into ``n`` parts of about equal bytes (``CopyPlan.split``) and issues them at *points*: each call of one of the
policy's leaf modules in the forward, and the gradient of its output in the backward (a hook on that tensor). On
CUDA a part goes to the side stream after an event recorded on the stream computing at that point, so it starts on
the GPU when the step's kernels reach that point, not when the host gets there.

Where the parts go: part 0 at ``start()``, part k at point ``k * P // n``, what is left at ``wait()``. ``P`` is the
number of points the previous paced step saw (2 per leaf module before the first: one forward call, one gradient),
so gradient accumulation, activation checkpointing (forwards run twice) and modules a forward skips are learned
after one step. A step that sees fewer than ``n - 1`` points warns once (``sync()``, a compiled policy): its parts
are issued together.

Why: a copy beside compute-bound GEMMs costs them most of the copy's own time, whoever copies (the memory
system's, not the SMs'), and spread through the step it costs them less. It is not the default (``slices=1``): the
runs that timed it through a policy's hooks found no gain (docs/sync.md; bench/NOTES.md has their numbers).
"""
from __future__ import annotations

import threading
import warnings
import weakref

import torch
from torch import nn


class _Pace:
    """The paced copy of one ``ReferenceSyncer`` (its ``_issue`` runs a part; ``overlap`` picks the stream)."""

    def __init__(self, syncer):
        self._syncer = weakref.ref(syncer)  # no cycle: a dropped syncer takes its hooks with it at once
        self.lock = threading.Lock()  # backward hooks run on autograd's device threads
        self.handles: list | None = None  # the forward hooks on the policy's leaf modules
        self._finalizer = None
        self.leaves = 0
        self.pending: list = []  # parts not yet issued, in order: part k is due at point k * spacing // slices
        self.spacing = 0  # the points this step is expected to have
        self.active = False  # between begin() and end(): the hooks count points
        self.points = 0  # points seen since begin()
        self.expect: int | None = None  # points the previous paced step saw
        self.issued = {"start": 0, "points": 0, "wait": 0}  # where the last paced step's parts went
        self.warned = False

    @property
    def syncer(self):
        return self._syncer()

    # ---- the step ---------------------------------------------------------------------------------------------
    def begin(self, parts: list) -> None:
        """At ``start()``: issue part 0 (and any part due at point 0) and schedule the rest."""
        if self.handles is None:
            self.hook(self.syncer.policy)
        with self.lock:
            self.points, self.issued = 0, {"start": 0, "points": 0, "wait": 0}
            self.pending = list(parts)
            self.spacing = self.expect if self.expect is not None else 2 * self.leaves
            try:
                self._release("start")
            except BaseException:  # nothing armed when start() fails: a later step must not issue stale parts
                self.pending = []
                raise
            self.active = True

    def end(self, learn: bool = True) -> None:
        """At ``wait()``: issue what is left and learn how many points a step has (``learn=False``: ``abort()``,
        a step cut short). A part that fails stays pending, so ``abort()`` can still complete the copy."""
        with self.lock:
            self.active = False
            seen = self.points
            self._release("wait", every=True)
        if not learn:
            return
        self.expect = seen
        if seen < self.syncer.slices - 1 and not self.warned:
            self.warned = True
            warnings.warn(
                f"ReferenceSyncer(slices={self.syncer.slices}): {seen} hook points between start() and wait() (calls "
                f"of the policy's {self.leaves} leaf modules and their gradients), fewer than the slices, so the copy "
                "goes in fewer parts; the policy's forward must run between start() and wait(), eager (not compiled, "
                "not captured in a CUDA graph)", RuntimeWarning, stacklevel=4)

    def tick(self) -> None:
        with self.lock:
            if not self.active or self.syncer is None:
                return
            self.points += 1
            self._release("points")

    def _release(self, where: str, every: bool = False) -> None:
        """Issue the pending parts that are due (``every``: all of them)."""
        syncer = self.syncer
        n = syncer.slices  # CopyPlan.split(slices) made the parts
        while self.pending and (every or self.points >= (n - len(self.pending)) * self.spacing // n):
            syncer._issue(self.pending[0], syncer.overlap)
            self.pending.pop(0)  # only once issued: a part whose copy raised is still to do
            self.issued[where] += 1

    # ---- hooks ------------------------------------------------------------------------------------------------
    def hook(self, policy: nn.Module) -> None:
        leaves = [m for m in policy.modules() if next(m.children(), None) is None]
        ref = weakref.ref(self)
        self.handles = [m.register_forward_hook(_forward_hook(ref)) for m in leaves]
        self.leaves = len(leaves)
        self._finalizer = weakref.finalize(self, _remove, self.handles)  # a dropped syncer leaves no hook behind

    def unhook(self) -> None:
        if self.handles is not None:
            self._finalizer.detach()
            _remove(self.handles)
            self.handles = None

    def grad_hook(self, grad):
        if not _traced():
            self.tick()


def _forward_hook(ref):
    def hook(module, args, output):
        pace = ref()
        if pace is None or not pace.active or _traced():
            return None
        pace.tick()
        if torch.is_grad_enabled():
            t = _grad_tensor(output)
            if t is not None:
                t.register_hook(pace.grad_hook)
        return None
    return hook


def _traced() -> bool:
    """Inside ``torch.compile``'s tracing or a CUDA-graph capture: a point there would be baked into a graph (a copy
    issued once at capture, or a graph break a leaf), so none is counted and the step warns with fewer points."""
    return torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _grad_tensor(output):
    """The first tensor of a leaf module's output that will get a gradient, or ``None``."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, (tuple, list)):
        for o in output:
            if isinstance(o, torch.Tensor) and o.requires_grad:
                return o
    return None


def _remove(handles) -> None:
    for h in handles:
        h.remove()
    handles.clear()
