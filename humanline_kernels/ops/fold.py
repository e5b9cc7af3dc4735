r"""The finalize folded into the row kernel: a fused loss's forward in one launch (a dense batch's).

Unfolded, the row kernel (:mod:`.token_terms`) is followed by one program of the loss's tail (:mod:`.dpo`,
:mod:`.kto`, :mod:`.grpo`) that walks ``[B, T]`` alone (a packed batch, a fused-linear chunk). Here the row kernel's
programs do the tail's work themselves, in two levels of fixed-order sums, so the result does not depend on which
program finishes first:

1. Each token row ``q = (b, t)`` belongs to the tile ``(b, t // TILE)`` (tiles never cross a sequence). After
   writing its token's ``val``, ``coef``, ``lse`` and ``aux`` a program counts itself in on its tile's counter; the
   tile's last program sums the tile's tokens in index order (masked by the labels) into the partial-sum planes
   ``part [K, n_tiles]``: the terms, the in-band count, for GRPO the low/high clip counts and ``k3``, and the
   token count.
2. It then counts the tile in on the launch's counter; the last tile's program runs the loss's tail on the
   partial sums (the tails of :mod:`.dpo`, :mod:`.kto`, :mod:`.grpo` with ``PARTIAL``): per-row sums over the
   row's tiles in order, the loss, the metrics and the row weights ``w``, as the one-program finalize does.

No float atomics: the counters are int32 ``atomic_add`` (acq_rel, GPU scope) after a CTA barrier, so every
store a program made is visible to the program that counts last, which reads the planes past L1 (``.cg``). The
counters live in a buffer per (device, stream) that is zero before a launch and zero after it (each counter's
last arrival resets it), so a call launches no fill and a CUDA graph can replay it. Two launches must not share
a counter at the same time: launches on one stream are ordered, and each stream has its own buffer. The memory
ordering can be checked only on a GPU (the interpreter runs programs one after another): tests/test_fold.py's GPU
test.

KTO's baseline ``z0`` (a walk over the KL rows) is computed by program 0 before its own row, off the critical
path; the tile-0 and launch counters carry it to the last program.

GRPO with the gradient in the forward (``GRAD`` > 0) runs on a persistent grid: :data:`GIF_PROGRAMS_PER_SM`
programs an SM walk rows ``pid, pid + P, ...``, so that the rows in flight fit in L2 for the gradient's second
sweep (the softmax sweep loads with ``evict_last``, the gradient sweep re-reads with ``evict_first`` and writes with
streaming stores, ``.cs``). The row weights come from the weights-only finalize launch (needed by
``loss_type="grpo"``), or each program computes the one weight every row shares (dapo / bnpo: ``1 / sum m`` or the
normalizer; dr_grpo) before its rows.
"""
from __future__ import annotations

import torch
import triton.language as tl
from torch import Tensor

from ._jit import COMPILED_DEVICES, jit
from .common import read_partial, register_budget, row_terms, split_token


# ------------------------------------------------------------------ the fold's protocol (device)
@jit
def arrive(ctr_ptr, slot, count):
    """Count this program in on counter ``slot``; True for the ``count``-th arrival, which resets the counter to 0
    (no other program touches it again in this launch). The barrier first: every thread's stores of this program
    happen before the release."""
    tl.debug_barrier()
    last = tl.atomic_add(ctr_ptr + slot, 1, sem="acq_rel", scope="gpu") == count - 1
    if last:
        tl.atomic_xchg(ctr_ptr + slot, 0, sem="relaxed", scope="gpu")
    return last


@jit
def tile_sums(val_ptr, aux_ptr, y_ptr, y_sb, y_st, part_ptr, b, j, T, plane, n_tiles, ignore_index,
              AUX: tl.constexpr, TILE: tl.constexpr):
    """Partial sums of the tile ``(b, j)`` (tokens ``t`` in ``[j TILE, (j + 1) TILE)`` of row ``b``) in index order,
    into ``part`` (planes ``n_tiles`` apart): ``sum m val``, ``sum m aux[k]`` for the ``AUX`` first aux planes,
    ``sum m``."""
    t = j * TILE + tl.arange(0, TILE)
    inb = t < T
    b64 = b.to(tl.int64)
    off = b64 * T + t
    m = inb & (tl.load(y_ptr + b64 * y_sb + t.to(tl.int64) * y_st, mask=inb, other=0) != ignore_index)
    tile = b64 * tl.cdiv(T, TILE) + j
    nt = n_tiles.to(tl.int64)
    tl.store(part_ptr + tile, tl.sum(read_partial(val_ptr + off, m), 0))
    for k in tl.static_range(AUX):
        tl.store(part_ptr + (k + 1) * nt + tile, tl.sum(read_partial(aux_ptr + k * plane + off, m), 0))
    tl.store(part_ptr + (AUX + 1) * nt + tile, tl.sum(m.to(tl.float32), 0))


@jit
def row_done(val_ptr, aux_ptr, y_ptr, y_sb, y_st, ctr_ptr, part_ptr, q, T, plane, n_tiles, ignore_index,
             AUX: tl.constexpr, TILE: tl.constexpr):
    """Token ``q``'s program is done with its stores: count it in on its tile; the tile's last program sums the tile
    and counts the tile in. True for the launch's last tile (its program runs the loss's tail)."""
    b, t = split_token(q, T)
    j = t // TILE
    n_tiles_row = tl.cdiv(T, TILE)
    last = False
    if arrive(ctr_ptr, b * n_tiles_row + j, tl.minimum(T - j * TILE, TILE)):
        tile_sums(
            val_ptr=val_ptr, aux_ptr=aux_ptr, y_ptr=y_ptr, y_sb=y_sb, y_st=y_st, part_ptr=part_ptr, b=b, j=j,
            T=T, plane=plane, n_tiles=n_tiles, ignore_index=ignore_index, AUX=AUX, TILE=TILE)
        last = arrive(ctr_ptr, n_tiles, n_tiles)
    return last


@jit
def ratio_row(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, ref_ptr, val_ptr, coef_ptr, lse_ptr, aux_ptr, ctr_ptr, part_ptr, q,
              N, T, V, n_tiles, inv_temperature, ignore_index, log_eps_p, log_eps_r, BLOCK_V: tl.constexpr,
              TILE: tl.constexpr, CLIP: tl.constexpr):
    """One DPO / KTO token row: the clipped log-ratio terms (:func:`.common.row_terms`, MODE 1) and the
    fold; True if this program counted the launch's last tile."""
    row_terms(
        x_ptr=x_ptr, x_sb=x_sb, x_st=x_st, y_ptr=y_ptr, y_sb=y_sb, y_st=y_st, ref_ptr=ref_ptr,
        klref_ptr=ref_ptr, adv_ptr=ref_ptr, adv_sb=0, adv_st=0, val_ptr=val_ptr, coef_ptr=coef_ptr, lse_ptr=lse_ptr,
        aux_ptr=aux_ptr, tok_ptr=y_ptr, r=q, N=N, Q=N, T=T, V=V, inv_temperature=inv_temperature,
        ignore_index=ignore_index, log_eps_p=log_eps_p, log_eps_r=log_eps_r, ratio_low=0.0, ratio_high=0.0, beta=0.0,
        n0=N, off0=0, off1=0, BLOCK_V=BLOCK_V, MODE=1, CLIP=CLIP, HAS_KL_REF=False, TOKEN_MAP=False, EVICT_LAST=False)
    return row_done(
        val_ptr=val_ptr, aux_ptr=aux_ptr, y_ptr=y_ptr, y_sb=y_sb, y_st=y_st, ctr_ptr=ctr_ptr,
        part_ptr=part_ptr, q=q, T=T, plane=N.to(tl.int64), n_tiles=n_tiles, ignore_index=ignore_index, AUX=1, TILE=TILE)


# ------------------------------------------------------------------ workspace, launch shapes, register budget (host)
# A folded row kernel without a gradient sweep is told the registers that leave room for this many warps an SM (7
# programs of 4 warps: 72 registers): its loss tail, run by one program, would otherwise set the whole kernel's
# register count and with it the programs an SM that keep the logits streaming.
ROW_WARPS_PER_SM = 28


_COUNTERS: dict = {}  # (device, stream) -> int32 counters, zero between launches


def counters(device: torch.device, n: int) -> Tensor:
    """At least ``n`` int32 counters for a launch on ``device``'s current stream: zero now, and zero again after the
    launch (each counter's last arrival resets it). Allocated (one fill) only the first time or to grow."""
    stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0
    key = (device, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096, 0 if buf is None else 2 * buf.numel()), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def reset_counters():
    """Zero every counter buffer (after a launch that did not finish, e.g. an interrupted interpreted one)."""
    for buf in _COUNTERS.values():
        buf.zero_()


def fold_config(x: Tensor, B: int, warps: int) -> tuple[int, int, int]:
    """``(TILE, BLOCK_B, BLOCK_T)``: tokens a tile (one partial sum each; 512 on GPU, 4 in the interpreter so that
    small rows have several tiles) and the tail's ``[BLOCK_B, BLOCK_T]`` walk over the ``[B, n_tiles / B]``
    partial sums, one element a thread (:func:`.common.tiles`' rule: 1, 2 or 4 rows a tile; at 2 a thread triton
    3.6's ptxas spilled 4-8 bytes in DPO's and KTO's)."""
    bb = 1 if B <= 1 else 2 if B == 2 else 4
    if x.device.type in COMPILED_DEVICES:
        return 512, bb, 32 * warps // bb
    return 4, *((1, 8) if bb == 1 else (2, 4))


def workspace(x: Tensor, B: int, T: int, tile: int, planes: int):
    """``(n_tiles, partial sums [planes * n_tiles + 1], counters)`` of a launch (the extra slot: KTO's ``z0``)."""
    n_tiles = B * -(-T // tile)
    part = torch.empty((planes * n_tiles + 1,), dtype=torch.float32, device=x.device)
    return n_tiles, part, counters(x.device, n_tiles + 1)


def reset_counters_if_interpreted(x):
    """After a folded launch on ``x``'s device raised: the counters zeroed if it was interpreted (it may have stopped
    half way, and the next launch relies on them being zero; a compiled launch cannot stop so)."""
    if x.device.type not in COMPILED_DEVICES:
        reset_counters()


def planes(B, T, n, like):
    f32 = dict(dtype=torch.float32, device=like.device)
    return (*(torch.empty((B, T), **f32) for _ in range(3)), torch.empty((n, B, T), **f32))


def row_register_budget(x: Tensor, warps: int) -> dict:
    """``maxnreg`` for a folded kernel's program a row without a gradient sweep (DPO, KTO, GRPO without the
    gradient in the forward): the share of :data:`ROW_WARPS_PER_SM` warps an SM (7 programs of 4 warps: 72
    registers), so that a loss tail run by one program does not set the whole kernel's registers and with them fewer
    programs an SM; told 72 these compile without spills from 16-bit logits. fp32 rows hold twice the registers an
    element: half the programs (at 72, KTO's spilled for sm_80)."""
    per_sm = ROW_WARPS_PER_SM // warps // (1 if x.element_size() <= 2 else 2)
    return register_budget(x, warps, max(per_sm, 1))
