"""``LookaheadReference``: humanline reference log-probs from the policy itself, with no reference model.

Why it is exact. With humanline syncing every ``k`` steps (``ReferenceSyncer``: step t syncs when t % k == 0,
before ``optimizer.step()``), the reference used in step t is θ_0 for t = 0 and, for t >= 1, θ_s with
s = k·floor((t - 1) / k): the policy as it was just before the update of the last sync step s < t. At the sync
step s the policy *is* θ_s between its backward and ``optimizer.step()``. With offline data the batches of steps
s+1 .. s+k are known then, so the policy can compute their reference log-probs right there (no grad, eval mode):
the same parameters, the same inputs, the same function as a reference model would apply later. Step 0's come
from the policy before any update (the reference starts as a copy of the policy).

Per optimizer step::

    lookahead = hk.LookaheadReference(policy, batches, logps_fn, every=k)
    for batch, ref_logps in lookahead:      # ref_logps: like batch (a list for gradient accumulation)
        ...loss(policy, batch, ref_logps).backward()...
        lookahead.wait()                    # right before optimizer.step(): sync steps compute the next window
        optimizer.step(); optimizer.zero_grad()

Calling ``wait()`` at the start of the step instead (before its forward) is equivalent when nothing changes the
parameters in between (they are θ_t at both points); the TRL trainers do that.

``batches`` yields one optimizer step's batch (any object; a tuple or dict is one batch), or a ``list`` of
micro-batches under gradient accumulation (then ``ref_logps`` is a list too);
``logps_fn(model, micro_batch)`` returns the per-token log-probs of a micro-batch (e.g. through
``hk.fused_linear.token_logprobs_nograd``). Under DDP / FSDP every rank must hold the same number of batches
(the window forwards are collective under FSDP).
"""
from __future__ import annotations

import collections

import torch
from torch import nn

from ._backends import reshard_fsdp2

__all__ = ["LookaheadReference"]


class LookaheadReference:
    """Reference log-probs for humanline training computed by the policy itself; see the module docstring.

    Args:
        policy: the trained model (plain, DDP or FSDP-wrapped): it is put in eval mode for the window forwards and
            each submodule's train/eval mode is restored afterwards.
        batches: iterable of per-step batches (a micro-batch, or a list of them under gradient accumulation).
        logps_fn: ``logps_fn(model, micro_batch) -> Tensor`` of per-token log-probs (floating point); called under
            ``no_grad``.
        every: humanline sync interval ``k`` (the reference is refreshed every ``k`` optimizer steps).
    """

    def __init__(self, policy: nn.Module, batches, logps_fn, *, every: int = 1):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        if not isinstance(policy, nn.Module):
            raise ValueError(f"policy must be a torch.nn.Module, got {type(policy).__name__}")
        if not callable(logps_fn):
            raise ValueError(f"logps_fn must be callable as logps_fn(model, batch), got {type(logps_fn).__name__}")
        try:
            self._batches = iter(batches)
        except TypeError:
            raise ValueError(f"batches must be an iterable of per-step batches, got {type(batches).__name__}") from None
        self.policy, self.logps_fn, self.every = policy, logps_fn, every
        self._step = 0                       # optimizer steps completed (wait() calls)
        self._window = collections.deque()   # (batch, ref_logps) of the steps to come, oldest first
        self._yielded = False                # the current step's batch was handed out and wait() not yet called
        self._exhausted = False
        self._loaded_refs = None             # reference log-probs restored by load_state_dict, batches to re-draw

    # ----------------------------------------------------------------------------------------------- iteration
    def __iter__(self):
        return self

    def __next__(self):
        if self._yielded:
            raise RuntimeError("LookaheadReference: call wait() right before optimizer.step() of every step "
                               "(it was not called after the last batch)")
        if self._loaded_refs is not None:
            self._refill_loaded()
        if self._step == 0 and not self._window and not self._exhausted:
            self._fill(1)  # step 0: the policy before any update is the initial reference
        if not self._window:
            raise StopIteration
        self._yielded = True
        return self._window[0]

    def wait(self) -> bool:
        """Finish step t (call right before ``optimizer.step()``). On a sync step (t % every == 0) the policy, now
        θ_t, computes the reference log-probs of the next ``every`` steps' batches. Returns whether it did."""
        if not self._yielded:
            raise RuntimeError("LookaheadReference.wait(): no batch of this step was taken from the iterator")
        self._window.popleft()
        self._yielded = False
        sync = self._step % self.every == 0
        if sync:  # the window is empty here: the steps up to this one were fetched at the previous sync step
            self._fill(self.every)
        self._step += 1
        return sync

    @property
    def step(self) -> int:
        """Optimizer steps completed (``wait()`` calls)."""
        return self._step

    # ------------------------------------------------------------------------------------------------ internals
    def _next_batches(self, n):
        out = []
        while len(out) < n and not self._exhausted:
            try:
                out.append(next(self._batches))
            except StopIteration:
                self._exhausted = True
        return out

    @torch.no_grad()
    def _ref_logps(self, batch):
        modes = [(m, m.training) for m in self.policy.modules()]
        self.policy.eval()
        try:
            if isinstance(batch, list):  # micro-batches (a tuple is one batch, e.g. (input_ids, mask, labels))
                return [self._logps(mb) for mb in batch]
            return self._logps(batch)
        finally:
            for m, training in modes:
                m.training = training
            reshard_fsdp2(self.policy)  # the window forward had no backward: see reshard_fsdp2

    def _logps(self, batch):
        out = self.logps_fn(self.policy, batch)
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            got = f"a {out.dtype} tensor" if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"logps_fn(model, batch) must return a floating-point tensor of the batch's per-token "
                             f"log-probs, got {got}")
        return out.detach()

    def _fill(self, n):
        for batch in self._next_batches(n):
            self._window.append((batch, self._ref_logps(batch)))

    def _refill_loaded(self):
        refs, self._loaded_refs = self._loaded_refs, None
        batches = self._next_batches(len(refs))
        if len(batches) != len(refs):
            raise ValueError(f"LookaheadReference.load_state_dict: the batches iterable must yield the batches of "
                             f"the steps from {self._step} on; it ran out after {len(batches)} of {len(refs)}")
        for batch, ref in zip(batches, refs):
            _check_pairs(batch, ref, self._step)
            self._window.append((batch, ref))

    # ------------------------------------------------------------------------------------------------ resume
    def state_dict(self) -> dict:
        """Step counter, ``every`` and the reference log-probs already computed for the steps to come (the current
        window: they were computed from a policy that no longer exists, so they cannot be re-computed)."""
        if self._yielded:
            raise RuntimeError("LookaheadReference.state_dict(): call it between steps (after wait())")
        refs = list(self._loaded_refs or []) + [ref for _, ref in self._window]
        return {"step": self._step, "every": self.every, "window_refs": [_to_cpu(r) for r in refs],
                "exhausted": self._exhausted and not refs}

    def load_state_dict(self, state: dict) -> None:
        """Resume: give this object a ``batches`` iterable that yields the batches of the steps from
        ``state["step"]`` on (as a resumed data loader does). The stored reference log-probs of the current window
        are paired with its first batches (shapes are checked); the next sync step computes the next window from
        the restored policy, as the uninterrupted run would have."""
        if not isinstance(state, dict) or not {"step", "every", "window_refs"} <= state.keys():
            raise ValueError("LookaheadReference.load_state_dict: state must be a dict with step, every and "
                             f"window_refs, as state_dict() returns, got {type(state).__name__}")
        if state.get("every") != self.every:
            raise ValueError(f"LookaheadReference.load_state_dict: every={state.get('every')} was saved, this "
                             f"object has every={self.every}")
        if self._step or self._window or self._yielded:
            raise RuntimeError("LookaheadReference.load_state_dict: call it before taking the first batch")
        # everything checked before anything is set: a refused state leaves this object as it was
        step, refs, exhausted = state["step"], state["window_refs"], state.get("exhausted", False)
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"LookaheadReference.load_state_dict: step must be an int >= 0, got {step!r}")
        if not isinstance(refs, list) or not all(
                isinstance(r, torch.Tensor) or (isinstance(r, list) and all(isinstance(t, torch.Tensor) for t in r))
                for r in refs):
            raise ValueError("LookaheadReference.load_state_dict: window_refs must be a list of tensors (or of lists "
                             "of tensors, one per micro-batch)")
        if not isinstance(exhausted, bool):
            raise ValueError(f"LookaheadReference.load_state_dict: exhausted must be a bool, got {exhausted!r}")
        self._step = step
        dev = _device_of(self.policy)
        self._loaded_refs = [_to_device(r, dev) for r in state["window_refs"]]
        if not self._loaded_refs:  # saved before step 0, or after the data ran out
            self._loaded_refs = None
            self._exhausted = exhausted


def _check_pairs(batch, ref, step):
    mbs = batch if isinstance(batch, list) else [batch]
    refs = ref if isinstance(ref, list) else [ref]
    if len(mbs) != len(refs):
        raise ValueError(f"LookaheadReference.load_state_dict: step {step} has {len(mbs)} micro-batches but "
                         f"{len(refs)} stored reference tensors: the batches do not resume at the saved step")


def _to_cpu(r):
    return [t.detach().cpu() for t in r] if isinstance(r, list) else r.detach().cpu()


def _to_device(r, dev):
    return [t.to(dev) for t in r] if isinstance(r, list) else r.to(dev)


def _device_of(model):
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
