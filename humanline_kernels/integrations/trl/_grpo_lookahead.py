"""GRPO's lookahead reference: humanline GRPO with no reference model, over TRL's generation buffer.

Why it is exact (see docs/lookahead.md for the offline case). With humanline syncing every ``k`` optimizer steps,
the reference of step ``t`` is θ_0 for ``t = 0`` and, for ``t >= 1``, θ_s with ``s = k·floor((t - 1) / k)``: the
policy just before the update of the last sync step ``s < t``. TRL samples a generation batch every ``N``
optimizer steps (``steps_per_generation * num_iterations = N * gradient_accumulation_steps``) and hands its
micro-batches out from a buffer, so at the sync step ``s`` the micro-batches of the steps ``s+1 .. s+k`` that
belong to the current generation already exist: the policy, which *is* θ_s until the update, computes their
reference log-probs there (no grad, eval mode, log-probs only), as a reference model holding θ_s would later.

The completions of a later generation do not exist at ``s``: they are sampled at the generation's first step,
after updates. When the window ``s+1 .. s+k`` reaches into such a generation, the trainable parameters θ_s are
kept in host memory, and when that generation is sampled they are swapped into the policy for the reference
forwards of its micro-batches up to step ``s+k`` (then the current parameters are put back, bit for bit). So
there is no reference model on the accelerator; the cost is one host copy of the trainable parameters, taken at
most once per sync step and only when the window crosses a generation, and two host-device copies per crossing.
With a generation per optimizer step (``N = 1``) nothing exists ahead and every step would cross: refused.

Step 0's reference is the policy before any update: its micro-batches are computed as they come.
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["BufferLookahead"]


class BufferLookahead:
    """Reference log-probs of every training micro-batch of a GRPO run, per micro-step index (TRL's ``_step``).

    Args:
        policy_logps: ``f(batch) -> [B, T]`` reference log-probs of a buffered micro-batch computed by the policy as
            it is now (no grad, eval mode).
        params: the trainable parameters (the only ones an update changes): what a crossing snapshot holds.
        every: ``k``, the sync interval.
        accum: micro-batches per optimizer step.
        steps_per_generation, num_iterations: TRL's buffer (``steps_per_generation`` micro-batches, each used
            ``num_iterations`` times); one generation spans ``steps_per_generation * num_iterations`` micro-steps.
        max_steps: optimizer steps of the run (nothing is computed past its end).
    """

    def __init__(self, policy_logps, params, *, every, accum, steps_per_generation, num_iterations, max_steps):
        self.policy_logps, self.params = policy_logps, list(params)
        self.every, self.accum, self.spg = every, accum, steps_per_generation
        self.span = steps_per_generation * num_iterations  # micro-steps per generation
        self.end = max_steps * accum                      # micro-steps of the run
        self.refs = {}           # micro-step -> reference log-probs, computed ahead
        self.snapshot = None     # (sync step s, host copies of θ_s's trainable parameters) across a crossing
        self.windows = 0         # sync steps whose window was computed (the "humanline/num_syncs" metric)

    def state_dict(self) -> dict:
        """What a checkpoint between optimizer steps needs: the log-probs computed ahead (none at a generation
        boundary: they belong to the generation being trained on), θ_s's host copy when the window crosses into a
        generation not sampled yet, and the window count."""
        snapshot = None if self.snapshot is None else [self.snapshot[0], self.snapshot[1]]
        return {"every": self.every, "refs": dict(self.refs), "snapshot": snapshot, "windows": self.windows}

    def load_state_dict(self, state) -> None:
        """Restore :meth:`state_dict`'s state, checked whole before anything is set (a refusal changes nothing)."""
        if not isinstance(state, dict) or not {"every", "refs", "snapshot", "windows"} <= state.keys():
            raise ValueError("the lookahead state must be a dict with every, refs, snapshot and windows, as "
                             "state_dict() returns")
        if state["every"] != self.every:
            raise ValueError(f"the lookahead state was saved with sync_every={state['every']}, this run has "
                             f"{self.every}")
        refs, snap, windows = state["refs"], state["snapshot"], state["windows"]
        if not isinstance(refs, dict) or not all(_is_count(i) and isinstance(t, torch.Tensor) for i, t in refs.items()):
            raise ValueError("the lookahead state's refs must map micro-step indices (ints >= 0) to tensors")
        if snap is not None:
            if not (isinstance(snap, (list, tuple)) and len(snap) == 2 and _is_count(snap[0])
                    and isinstance(snap[1], (list, tuple)) and all(isinstance(v, torch.Tensor) for v in snap[1])):
                raise ValueError("the lookahead state's snapshot must be None or [sync step, [tensors]]")
            if [tuple(v.shape) for v in snap[1]] != [tuple(p.shape) for p in self.params]:
                raise ValueError("the lookahead's saved parameters θ_s do not match this policy's trainable ones")
            snap = (snap[0], list(snap[1]))
        if not _is_count(windows):
            raise ValueError(f"the lookahead state's windows must be an int >= 0, got {windows!r}")
        device = self.params[0].device if self.params else torch.device("cpu")
        self.refs = {i: t.to(device) for i, t in refs.items()}
        self.snapshot, self.windows = snap, windows

    def reference(self, i, step, buffer, generated):
        """The reference log-probs of micro-step ``i`` (of optimizer step ``step``), called as TRL hands it out:
        ``buffer`` is TRL's buffer, ``generated`` whether this call sampled it. At the last micro-step of a sync
        step, the window of the next ``every`` steps is computed."""
        if step != i // self.accum:
            raise RuntimeError(f"humanline_reference='lookahead': micro-batch {i} arrived in optimizer step {step}, "
                               f"not {i // self.accum}: the training loop did not run whole steps of "
                               f"{self.accum} micro-batches (resuming, or a shorter last step of an epoch?)")
        if generated:
            self._crossing(i, buffer)
        if step == 0:  # θ_0 is the policy itself until the first update
            ref = self.policy_logps(buffer[i % self.spg])
        elif i in self.refs:
            ref = self.refs.pop(i)
        else:
            raise RuntimeError(f"humanline_reference='lookahead': no reference log-probs were computed for "
                               f"micro-batch {i} (step {step})")
        if i % self.accum == self.accum - 1 and step % self.every == 0:
            self._window(i, step, buffer)
        return ref

    def _window(self, i, s, buffer):
        """At sync step ``s`` (its last micro-step ``i``, before the update): the buffered micro-batches of steps
        ``s+1 .. s+k`` from the policy; keep θ_s if the window reaches into a generation not sampled yet."""
        first, last = (s + 1) * self.accum, min((s + self.every + 1) * self.accum, self.end)
        generation = i // self.span
        for j in range(first, last):
            if j // self.span == generation:
                self.refs[j] = self.policy_logps(buffer[j % self.spg])
        crosses = last > first and (last - 1) // self.span > generation
        self.snapshot = (s, [p.detach().to("cpu", copy=True) for p in self.params]) if crosses else None
        self.windows += 1

    def _crossing(self, i, buffer):
        """A generation was just sampled at micro-step ``i``: its micro-batches whose reference is the snapshot's
        θ_s (steps up to ``s + k``) get their log-probs from θ_s, swapped into the policy."""
        if self.snapshot is None:
            return
        s, values = self.snapshot
        window_end = min((s + self.every + 1) * self.accum, self.end)
        stop = min(i + self.span, window_end)
        if stop > i:
            with swapped_in(self.params, values):
                for j in range(i, stop):
                    self.refs[j] = self.policy_logps(buffer[j % self.spg])
        if window_end <= i + self.span:  # the window ends in this generation: θ_s is no longer needed
            self.snapshot = None


def _is_count(v):
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


@contextlib.contextmanager
def swapped_in(params, values):
    """Parameters ``params`` hold ``values`` (host copies) inside the block; their own values, saved to the host,
    are restored exactly afterwards."""
    with torch.no_grad():
        saved = [p.detach().to("cpu", copy=True) for p in params]
        for p, v in zip(params, values):
            p.copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, v in zip(params, saved):
                p.copy_(v)
