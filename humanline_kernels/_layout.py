"""Token layouts: padded rows ``[B, T]``, packed (padding-free) streams, and the supervised tokens only.

Every loss is defined on padded rows (:mod:`humanline_kernels.reference`). Two other layouts reach the same math
through a *token map*, never through a second copy of it:

* **Packed** (:class:`Packed`): ``S`` sequences laid end to end in one stream of ``N`` positions, as TRL's
  padding-free collators and flash-attn's varlen kernels lay them out (``cu_seqlens [S + 1]``: sequence ``s``
  holds positions ``cu[s]..cu[s+1]-1``; or transformers' ``position_ids`` that restart at 0). Per-token tensors
  are ``[N]`` (or ``[1, N]``), per-sequence ones ``[S]``; sequence ``s`` is row ``s`` of the padded batch (DPO:
  chosen sequences first, then their rejected partners in the same order, as for padded rows).
* **Supervised** (``supervised=``, fused-linear level): per row (or packed sequence) the one range
  ``[start, end)`` of positions that may carry a label, known on the host before the batch reaches the GPU
  (TRL's completion masks). The lm_head GEMMs and the row kernels run on those positions only; every other
  position counts as ignored and gets an exact 0 gradient.

A :class:`TokenMap` lists the positions to compute: ``plane[i]``, the position's flat index in the ``[S, T]``
per-token planes that the kernels and the finalize read (the padded layout), and ``source[i]``, its flat index in
the caller's token stream (the rows of ``logits`` / ``hidden``). Small per-token tensors move between the layouts
with :func:`unpack` (a scatter of ``N`` numbers); logits and hidden states never move: the row kernels read logits
row ``r`` and address token ``plane[r]`` (``ops.common.row_token``), the fused-linear driver gathers the
chunk's hidden rows for its GEMM.

No host sync: ``cu_seqlens`` as a tensor with ``max_seqlen`` given builds the map with a few tensor ops where the
tensors live, and checks the boundaries there (a device-side assert; a ``ValueError`` on CPU tensors, as every other
check); host-side boundaries (Python lists, CPU tensors without ``max_seqlen``, the ``supervised`` ranges) are
read and checked on the host and the maps copied to the device without waiting. ``cu_seqlens`` on the GPU without
``max_seqlen``, and ``position_ids`` on the GPU, cost one sync (the width ``T`` must be known on the host), and so
does the fused-linear level with ``cu_seqlens`` on the GPU: it chunks by rows on the host (TRL's collator makes
``cu_seq_lens`` on the CPU: pass that). The planes are ``max_seqlen`` wide when it is given (so "dr_grpo" without
``max_completion_length`` divides by it on either path), else as wide as the longest sequence.

Every map addresses only its planes, even unchecked (``validate=False``): a device map clamps each position into
its sequence's row, and the row kernels clamp each map entry into the ``[B, T]`` tensors
(``ops.common.row_token``). Broken boundaries then give an unspecified result, never a write outside a buffer.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from . import _validation

__all__ = ["Packed", "TokenMap", "packed_map", "check_bounds", "supervised_map", "flat", "unpack", "unpack_like",
           "pack"]

Ints = Union[Tensor, Sequence[int]]


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _int_dtype(x: Tensor, name):
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, got dtype {str(x.dtype).replace('torch.', '')}")


def _host(x, name) -> list:
    """Integers known on the host: a Python sequence, or a tensor read once (a CPU tensor costs no sync)."""
    if isinstance(x, Tensor):
        _int_dtype(x, name)
        return x.tolist()
    if not isinstance(x, (list, tuple)):
        raise ValueError(f"{name} must be a tensor or a list of ints, got {type(x).__name__}")
    return list(x)


@dataclass(frozen=True, eq=False)
class Packed:
    """A packed (padding-free) batch: ``cu_seqlens [S + 1]`` (int, ``cu[0] = 0``, non-decreasing, ``cu[S] = N``;
    flash-attn's varlen convention) and optionally ``max_seqlen`` (the longest sequence; needed to stay free of
    host syncs when ``cu_seqlens`` lives on the GPU). Sequence ``s`` of the stream is row ``s`` of the padded
    batch. :meth:`from_position_ids` reads transformers' restarting ``position_ids`` instead."""

    cu_seqlens: Ints
    max_seqlen: Optional[int] = None

    def __post_init__(self):
        cu = self.cu_seqlens
        if isinstance(cu, Tensor):
            if cu.dim() != 1 or cu.numel() < 1 or cu.is_floating_point() or cu.dtype == torch.bool:
                raise ValueError(f"cu_seqlens must be a 1-D integer tensor [S + 1], got {cu.dtype} {list(cu.shape)}")
        elif not isinstance(cu, (list, tuple)) or len(cu) < 1 or not all(map(_is_int, cu)):
            raise ValueError("cu_seqlens must be a 1-D integer tensor or a sequence of ints [S + 1], got "
                             f"{cu if not isinstance(cu, (list, tuple)) else _shown(list(cu))!r}")
        m = self.max_seqlen
        if m is not None and (not _is_int(m) or m < 0):
            raise ValueError(f"max_seqlen must be a non-negative int, got {m!r}")

    @property
    def num_sequences(self) -> int:
        return (self.cu_seqlens.numel() if isinstance(self.cu_seqlens, Tensor) else len(self.cu_seqlens)) - 1

    def on_host(self) -> bool:
        return not isinstance(self.cu_seqlens, Tensor) or self.cu_seqlens.device.type == "cpu"

    def host_cu(self) -> list:
        """The boundaries as Python ints (one device-to-host copy when they live on a GPU)."""
        return _host(self.cu_seqlens, "cu_seqlens")

    @classmethod
    def from_position_ids(cls, position_ids: Tensor) -> "Packed":
        """From ``position_ids [N]`` or ``[1, N]`` that count 0, 1, ... within each sequence (transformers'
        padding-free convention): a sequence starts wherever the position is 0. On a GPU this reads the starts on
        the host (one sync); TRL's collator passes ``cu_seq_lens_q`` on the CPU, which is free."""
        if not isinstance(position_ids, Tensor) or position_ids.dim() not in (1, 2) or (
                position_ids.dim() == 2 and position_ids.shape[0] != 1):
            raise ValueError("position_ids must be a tensor [N] or [1, N]")
        _int_dtype(position_ids, "position_ids")  # (a bool mask or float positions were read as starts at 0)
        pos = position_ids.reshape(-1)
        N = pos.numel()
        starts = (pos == 0).nonzero().flatten().tolist()
        if N and (not starts or starts[0] != 0):
            raise ValueError("position_ids must start a sequence (position 0) at the first token")
        cu = starts + [N]
        return cls(cu, max(b - a for a, b in zip(cu, cu[1:])) if N else 0)


class TokenMap(NamedTuple):
    """The positions one call computes (see the module docstring). ``S``, ``T``: the padded planes' shape.
    ``plane``: int64 ``[M]`` on the device. ``source``: int64 ``[M]`` on the device, or None for ``0..M-1``.
    ``rows``/``counts``: the row of each run of the map and its length, in map order (row by row), when known on the
    host (the fused-linear level chunks by them), else None. ``N``: positions in the caller's stream."""

    S: int
    T: int
    plane: Tensor
    source: Optional[Tensor]
    rows: Optional[list]
    counts: Optional[list]
    N: int

    @property
    def M(self) -> int:
        return self.plane.numel()

    def runs(self):
        """``[(row, start, end)]``: the map's runs of one row each, as slices of the map."""
        out, o = [], 0
        for r, c in zip(self.rows, self.counts):
            out.append((r, o, o + c))
            o += c
        return out


def _to(t: list, device) -> Tensor:
    """A host list as an int64 tensor on ``device``, copied without waiting for the device."""
    cpu = torch.tensor(t, dtype=torch.int64)
    return cpu if device.type == "cpu" else cpu.to(device, non_blocking=True)


def _shown(cu: list):
    return cu if len(cu) <= 12 else cu[:6] + ["..."] + cu[-3:]


def _check_cu(cu: list, N: int, max_seqlen=None, name="packed"):
    """Host boundaries against a stream of ``N`` positions; ``name``: the argument that gave them (``packed``,
    KTO's ``kl_packed``), for the message."""
    if cu[0] != 0 or cu[-1] != N or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{name}.cu_seqlens must start at 0, never decrease and end at the {N} packed positions, "
                         f"got {_shown(cu)}")
    longest = max((b - a for a, b in zip(cu, cu[1:])), default=0)
    if max_seqlen is not None and longest > max_seqlen:
        raise ValueError(f"{name}.max_seqlen={max_seqlen} is shorter than the longest packed sequence ({longest} "
                         "positions)")


def _check_sizes(packed: Packed, N: int, name="packed"):
    """What the shapes alone refute (no value read): positions without a sequence, or wider than ``max_seqlen``."""
    if N and packed.num_sequences < 1:
        raise ValueError(f"{name}.cu_seqlens must hold at least one sequence ([0, N]) for {N} packed positions")
    if N and packed.max_seqlen == 0:
        raise ValueError(f"{name}.max_seqlen must be > 0 for {N} packed positions")


def _check_cu_device(cu: Tensor, N: int, T: int, name="packed"):
    """:func:`_check_cu` on the device, without a host sync: one device-side assert (a ``ValueError`` on the CPU).
    ``T``: the longest sequence allowed (``max_seqlen``; ``N`` bounds nothing more than the other rules do)."""
    d = torch.diff(cu, prepend=cu.new_zeros(1))  # d[0] = cu[0]: 0 when the first boundary is
    ok = ((d >= 0) & (d <= T)).all() & (d[0] == 0) & (cu[-1] == N)
    longest = f" and hold no sequence longer than max_seqlen={T}" if T < N else ""
    _validation.device_check(
        ok, f"{name}.cu_seqlens must start at 0, never decrease, end at the {N} packed positions{longest}",
        lambda: f", got {_shown(cu.tolist())}")


def check_bounds(packed: Packed, N: int, *, validate=True, name="packed"):
    """The rules of :func:`packed_map` for a call that needs no map (per-token log-probs of the stream are the
    stream's whatever its sequences): on the host when the boundaries are there, else, with ``validate``, on the
    device (no host sync)."""
    _check_sizes(packed, N, name)
    cu = packed.cu_seqlens
    if not isinstance(cu, Tensor) or cu.device.type == "cpu":
        _check_cu(packed.host_cu(), N, packed.max_seqlen, name)
    elif validate:
        _check_cu_device(cu.to(torch.int64), N, N if packed.max_seqlen is None else packed.max_seqlen, name)


def _order(S, pairs):
    """Row order of a map: ``0..S-1``, or with ``pairs`` (DPO) pair by pair: ``j, P + j`` for each ``j``."""
    if not pairs:
        return list(range(S))
    P = S // 2
    return [r for j in range(P) for r in (j, P + j)]


def packed_map(packed: Packed, N: int, device, *, pairs=False, host=False, validate=True, name="packed") -> TokenMap:
    """The map of every position of a packed stream of ``N`` positions (``host``: the row runs are needed on the
    host, so device boundaries are copied there once). The planes are ``max_seqlen`` wide when it is given, else as
    wide as the longest sequence. ``validate=False`` skips the device-side check of tensor boundaries. ``name``: the
    argument that gave ``packed``, for the messages."""
    S = packed.num_sequences
    _check_sizes(packed, N, name)
    if host or not isinstance(packed.cu_seqlens, Tensor) or packed.max_seqlen is None:
        cu = packed.host_cu()
        _check_cu(cu, N, packed.max_seqlen, name)
        T = packed.max_seqlen if packed.max_seqlen is not None else max((b - a for a, b in zip(cu, cu[1:])), default=0)
        order = _order(S, pairs)
        plane, source = [], []
        for r in order:
            plane += range(r * T, r * T + cu[r + 1] - cu[r])
            source += range(cu[r], cu[r + 1])
        counts = [cu[r + 1] - cu[r] for r in order]
        src = None if not pairs else _to(source, device)
        return TokenMap(S, T, _to(plane, device), src, order, counts, N)
    # on the device, no sync: sequence of each position by a search over the boundaries
    cu = packed.cu_seqlens.to(device=device, dtype=torch.int64)
    T = packed.max_seqlen
    if validate:
        _check_cu_device(cu, N, T, name)
    pos = torch.arange(N, device=device)
    seq = torch.searchsorted(cu[1:], pos, right=True).clamp(max=max(S - 1, 0))
    # clamped into the sequence's row even when checked: a device-side assert fails after the launches queued
    # behind it, and unchecked boundaries (validate=False) are a promise; broken ones then give an unspecified
    # result (positions share a plane entry), never an address outside the planes
    t = (pos - cu[seq]).clamp(min=0, max=max(T - 1, 0))
    return TokenMap(S, T, seq * T + t, None, None, None, N)


def supervised_map(ranges: Ints, B: int, T: int, device, *, packed: Optional[Packed] = None, N=None,
                   pairs=False) -> TokenMap:
    """The map of the supervised positions: ``ranges [R, 2]`` (host ints or a tensor read once), row ``b``'s (or
    packed sequence ``b``'s) positions ``[start, end)`` in row coordinates. Padded rows: ``B`` rows of width ``T``;
    packed: ``packed`` gives the sequences (``B``, ``T`` unused) in a stream of ``N`` positions."""
    rng = _host(ranges, "supervised")
    if packed is not None:
        _check_sizes(packed, N)
        cu = packed.host_cu()
        _check_cu(cu, N, packed.max_seqlen)
        S = len(cu) - 1
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        width = packed.max_seqlen if packed.max_seqlen is not None else max(lengths, default=0)
        starts = cu[:-1]
    else:
        S, width, lengths, starts = B, T, [T] * B, [b * T for b in range(B)]
        N = B * T
    if len(rng) != S or any(not isinstance(r, (list, tuple)) or len(r) != 2 or not all(map(_is_int, r)) for r in rng):
        raise ValueError(f"supervised must give one [start, end) range per row ({S} rows), shape [{S}, 2]")
    for b, (s, e) in enumerate(rng):
        if not (0 <= s <= e <= lengths[b]):
            raise ValueError(f"supervised range of row {b} must satisfy 0 <= start <= end <= {lengths[b]} (the "
                             f"row's length), got [{s}, {e})")
    order = _order(S, pairs)
    plane, source, counts = [], [], []
    for r in order:
        s, e = rng[r]
        plane += range(r * width + s, r * width + e)
        source += range(starts[r] + s, starts[r] + e)
        counts.append(e - s)
    return TokenMap(S, width, _to(plane, device), _to(source, device), order, counts, N)


def flat(tm: TokenMap) -> TokenMap:
    """The map addressed in the caller's own layout (per-token outputs such as plain log-probs): ``plane`` is
    ``source``, one row of ``N``."""
    src = tm.source if tm.source is not None else torch.arange(tm.M, device=tm.plane.device)
    return tm._replace(S=1, T=tm.N, plane=src, source=src)


def unpack(x: Tensor, tm: TokenMap, fill) -> Tensor:
    """A per-token tensor of the caller's stream (``[N]``, ``[1, N]`` or ``[B, T]``) as the ``[S, T]`` plane of the
    map's positions, ``fill`` elsewhere (differentiable: a scatter)."""
    flat = x.reshape(-1)
    vals = flat if tm.source is None else flat.index_select(0, tm.source)
    out = flat.new_full((tm.S * tm.T,), fill)
    return out.index_put((tm.plane,), vals).view(tm.S, tm.T)


def unpack_like(t: Optional[Tensor], tm: Optional[TokenMap], like: Tensor, per_sequence=False) -> Optional[Tensor]:
    """:func:`unpack` for an input of a loss call: a per-token tensor (shaped like ``like``, the caller's labels or
    log-probs; a stream's ``[N]`` and ``[1, N]`` alike) on the map's planes, ``False`` / 0 elsewhere; anything else
    (None, one value per sequence) and every input without a map as given. ``per_sequence``: the input may hold one
    value per sequence (GRPO's advantages, the vLLM importance weight); a 1-D one of ``S`` values is that, also
    when the stream has ``S`` positions (per token it is then ``[1, N]``)."""
    if tm is None or not isinstance(t, Tensor) or t.device != like.device:
        return t  # (a malformed one too: the loss's own check names it)
    if per_sequence and t.dim() == 1 and t.shape[0] == tm.S:
        return t
    stream = like.dim() == 1 or (like.dim() == 2 and like.shape[0] == 1)  # [N] or [1, N]
    if tuple(t.shape) != tuple(like.shape) and not (
            stream and t.numel() == like.numel() and (t.dim() == 1 or (t.dim() == 2 and t.shape[0] == 1))):
        return t
    return unpack(t.reshape(like.shape), tm, False if t.dtype == torch.bool else 0.0)


def pack(y: Tensor, tm: TokenMap, shape) -> Tensor:
    """The inverse of :func:`unpack` for an ``[S, T]`` per-token output: the caller's stream ``shape``, 0 at
    positions the map does not compute."""
    vals = y.reshape(-1).index_select(0, tm.plane)
    if tm.source is None and tm.M == tm.N:
        return vals.view(shape)
    out = y.new_zeros(tm.N)
    return out.index_put((tm.source if tm.source is not None else torch.arange(tm.M, device=y.device),),
                         vals).view(shape)


def check_packed(name, x, labels, ref_logps, packed, p=None, *, packed_name="packed"):
    """A packed batch (:class:`~humanline_kernels.Packed`, given as ``packed_name``): ``x`` (``logits``, ``hidden``
    or ``logps``; KTO's ``kl_logps``) is ``[N, ...]`` or ``[1, N, ...]`` with per-token tensors ``[N]`` / ``[1, N]``
    (``labels`` is checked against ``x`` by the level's own check; ``ref_logps`` shaped like it,
    :func:`._validation.check_ref` for the loss ``p``)."""
    if not isinstance(packed, Packed):
        raise ValueError(f"{packed_name} must be a humanline_kernels.Packed (cu_seqlens, max_seqlen), got "
                         f"{type(packed).__name__}")
    per_token = name.endswith("logps")
    if not isinstance(x, torch.Tensor) or x.dim() not in ((1, 2) if per_token else (2, 3)) or (
            x.dim() == (2 if per_token else 3) and x.shape[0] != 1):
        want = "[N] or [1, N]" if per_token else "[N, V] or [1, N, V]" if name == "logits" else "[N, D] or [1, N, D]"
        got = _validation.shape_of(x) if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"
        raise ValueError(f"{name} must have shape {want} (a tensor) for a packed batch, got {got}")
    if p is not None:
        _validation.check_tensor("labels", labels, dtypes=(torch.int64,), device=x.device)
        if tuple(labels.shape) != tuple(x.shape[:-1]):
            raise ValueError(f"labels must have shape {list(x.shape[:-1])} ({name} without its last dimension), "
                             f"got {_validation.shape_of(labels)}")
        _validation.check_ref(p, ref_logps, labels)
    elif ref_logps is not None:
        _validation.check_tensor("ref_logps", ref_logps, shape=labels.shape, dtypes=_validation.LOGP_DTYPES,
                                 device=labels.device)
