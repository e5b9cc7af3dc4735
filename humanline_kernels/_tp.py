r"""Tensor parallelism over the vocabulary: ``process_group=`` at every level (docs/tensor_parallel.md).

Each rank of ``process_group`` holds a contiguous slice of the vocabulary, slices in rank order (Megatron's
column-parallel lm_head; sizes may differ): its logits ``[..., V_r]`` or weight ``[V_r, D]``. The labels are global
ids, the same on every rank. Per call:

1. :func:`shard`: one all-gather of three int64 a rank (``V_r``, the token count, a checksum of the labels) gives
   every rank its slice's first id ``start = sum of the lower ranks' V_r`` on the device (no host sync), and the
   labels as the kernels read them on this rank: ``y - start`` where the slice holds ``y``, ``ignore_index`` where
   ignored, else a value outside ``[0, V_r)`` (a column no row has: the target's logit is read on one rank only).
2. The unchanged log-prob kernel (or its eager twin) sweeps the local slice: per token the local ``lse_r``, the
   local log-prob ``z_y / T - lse_r`` on the rank that holds ``y`` (0 elsewhere) and, for the entropy, the local
   entropy ``H_r``.
3. :func:`combine`: one all-gather of those 2 (3) fp32 a token, then on every rank the same arithmetic:
   ``lse = logsumexp_r lse_r``, with ``log pi_r = lse_r - lse`` (the share of the slice in the softmax)
   ``logp = logp_owner + log pi_owner`` and ``H = sum_r pi_r (H_r - log pi_r)``.

The backward needs no collective: the upstream gradient of the log-probs (and the entropy) is the same on every
rank, and each rank writes its slice's ``dz = g (onehot_local - exp(z / T - lse)) / T`` (plus the entropy's term)
with the global ``lse`` and ``H`` through the unchanged backward kernel. Everything after the log-probs (the
token terms, the loss, its metrics) is the unsharded eager path's (:mod:`humanline_kernels.losses`), on the global
log-probs, identical on every rank.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from . import _validation

__all__ = ["Shard", "check_group", "shard", "combine"]


class Shard(NamedTuple):
    """One call's layout: ``labels`` as this rank's kernels read them (shaped like the global labels); ``starts``,
    ``ends`` ``[W]`` int64 on the device, each rank's slice ``[start, end)`` of the vocabulary."""

    group: object
    labels: Tensor
    starts: Tensor
    ends: Tensor


def check_group(group):
    """``process_group`` (None: not sharded): a ``torch.distributed.ProcessGroup`` that this rank is in; its size
    (1 is the unsharded call)."""
    if group is None:
        return 1
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("process_group is given but torch.distributed is not initialised "
                         "(init_process_group first, or process_group=None)")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup (the tensor-parallel group over "
                        f"which the vocabulary is split) or None, got {type(group).__name__}")
    if dist.get_rank(group) < 0:
        raise ValueError("process_group does not contain this rank")
    return dist.get_world_size(group)


def _gather(x: Tensor, group) -> Tensor:
    """``[W, *x.shape]``: every rank's ``x`` in rank order (one collective)."""
    W = torch.distributed.get_world_size(group)
    out = torch.empty((W * x.numel(),), dtype=x.dtype, device=x.device)
    fn = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
    fn(out, x.contiguous().reshape(-1), group=group)
    return out.view(W, *x.shape)


def shard(group, V, labels: Tensor, ignore_index: int, validate: bool) -> Shard:
    """The layout of a call whose vocabulary slice on this rank has ``V`` ids (:class:`Shard`). With ``validate``:
    the token counts and the labels equal on every rank, and the labels in ``[0, sum V_r)`` or ``ignore_index``
    (device-side checks, :func:`._validation.device_check`: no host sync on an accelerator)."""
    y = labels.reshape(-1)
    dev = labels.device
    # a checksum that tells labels apart by value and position (int64 arithmetic wraps alike on every rank)
    check = (y * torch.arange(1, y.numel() + 1, device=dev)).sum() + y.sum() if validate else y.new_zeros(())
    mine = torch.stack([y.new_full((), V), y.new_full((), y.numel()), check])  # (filled on the device: no copy)
    every = _gather(mine, group)
    ends = every[:, 0].cumsum(0)
    starts = ends - every[:, 0]
    rank = torch.distributed.get_rank(group)
    if validate:
        _validation.device_check((every[:, 1] == y.numel()).all(),
                                 "labels must have the same number of tokens on every rank of process_group "
                                 "(each rank holds all the tokens and a slice of the vocabulary)")
        _validation.device_check((every[:, 2] == check).all(),
                                 "labels must be equal on every rank of process_group (global token ids: each rank "
                                 "holds all the tokens and a slice of the vocabulary)")
        _validation.device_check((((labels >= 0) & (labels < ends[-1])) | (labels == ignore_index)).all(),
                                 f"labels must lie in [0, V) with V the whole vocabulary (the sum of the slices of "
                                 f"process_group's ranks) or equal ignore_index={ignore_index}")
    start, end = starts[rank], ends[rank]
    here = (labels >= start) & (labels < end)
    outside = -2 if ignore_index == -1 else -1  # a column no slice has, and not ignore_index
    local = torch.where(labels == ignore_index, ignore_index, torch.where(here, labels - start, outside))
    return Shard(group, local, starts, ends)


def combine(sh: Shard, labels: Tensor, ignore_index: int, logp: Tensor, lse: Tensor, ent):
    """``(logp, lse, entropy or None)`` of the whole vocabulary, shaped like ``labels`` (the global ids), from this
    rank's ``logp``, ``lse`` (and ``ent``) of its slice (its kernels' outputs for ``sh.labels``): one all-gather of
    2 (3) floats a token, then the same arithmetic on every rank (module docstring)."""
    local = sh.labels.reshape(labels.shape)
    mine_logp = torch.where((local >= 0) & (local != ignore_index), logp, 0.0)  # its kernel: NaN elsewhere
    parts = [lse, mine_logp] + ([] if ent is None else [ent])
    every = _gather(torch.stack(parts), sh.group)  # [W, K, *labels.shape]
    lse_r = every[:, 0]
    lse_all = torch.logsumexp(lse_r, 0)
    log_pi = lse_r - lse_all
    shape = (-1,) + (1,) * labels.dim()
    owner = (labels >= sh.starts.view(shape)) & (labels < sh.ends.view(shape))  # [W, *labels.shape]
    valid = labels != ignore_index
    known = owner.any(0)  # a label outside the vocabulary (validate=False): NaN, as the unsharded kernels give
    out = every[:, 1].sum(0) + torch.where(owner, log_pi, 0.0).sum(0)
    out = torch.where(valid, torch.where(known, out, float("nan")), 0.0)
    h = None
    if ent is not None:
        pi = torch.exp(log_pi)
        h = torch.where(pi > 0, pi * (every[:, 2] - log_pi), 0.0).sum(0)  # a slice of -inf logits adds 0
        h = torch.where(valid, h, 0.0)
    return out, lse_all, h
