r"""The finalize folded into the row kernel: a fused loss's forward in one launch (a dense batch's).

Unfolded, the row kernel (:mod:`..token_terms.kernel`) is followed by one finalize program (:mod:`.kernel`) that
walks ``[B, T]`` alone (a packed batch, a fused-linear chunk). Here the row kernel's programs do the finalize's work
themselves, in two levels of fixed-order sums, so the result does not depend on which program finishes first:

1. Each token row ``q = (b, t)`` belongs to the tile ``(b, t // TILE)`` (tiles never cross a sequence). After
   writing its token's ``val``, ``coef``, ``lse`` and ``aux`` a program counts itself in on its tile's counter; the
   tile's last program sums the tile's tokens in index order (masked by the labels) into the partial-sum planes
   ``part [K, n_tiles]``: the terms, the in-band count, for GRPO the low/high clip counts and ``k3``, and the
   token count.
2. It then counts the tile in on the launch's counter; the last tile's program runs the loss's tail on the
   partial sums (:func:`.kernel._dpo_tail` / ``_kto_tail`` / ``_grpo_tail`` with ``PARTIAL``): per-row sums over
   the row's tiles in order, the loss, the metrics and the row weights ``w``, as the one-program finalize does.

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

import functools
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import tuning
from .._jit import COMPILED_DEVICES, custom_op, jit, launcher
from ..logprobs.kernel import _bt, device_guard, logits_rows, register_budget, rows_aligned, sweep_config
from ..token_terms.kernel import _f32, _grad_row, _terms
from .kernel import _dpo_tail, _grpo_tail, _kto_tail, _kto_z0, _outputs, _part, _valid


# ------------------------------------------------------------------ device functions
@jit
def _arrive(ctr_ptr, slot, count):
    """Count this program in on counter ``slot``; True for the ``count``-th arrival, which resets the counter to 0
    (no other program touches it again in this launch). The barrier first: every thread's stores of this program
    happen before the release."""
    tl.debug_barrier()
    last = tl.atomic_add(ctr_ptr + slot, 1, sem="acq_rel", scope="gpu") == count - 1
    if last:
        tl.atomic_xchg(ctr_ptr + slot, 0, sem="relaxed", scope="gpu")
    return last


@jit
def _tile_sums(val_ptr, aux_ptr, y_ptr, y_sb, y_st, part_ptr, b, j, T, plane, n_tiles, ignore_index,
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
    tl.store(part_ptr + tile, tl.sum(_part(val_ptr + off, m), 0))
    for k in tl.static_range(AUX):
        tl.store(part_ptr + (k + 1) * nt + tile, tl.sum(_part(aux_ptr + k * plane + off, m), 0))
    tl.store(part_ptr + (AUX + 1) * nt + tile, tl.sum(m.to(tl.float32), 0))


@jit
def _row_done(val_ptr, aux_ptr, y_ptr, y_sb, y_st, ctr_ptr, part_ptr, q, T, plane, n_tiles, ignore_index,
              AUX: tl.constexpr, TILE: tl.constexpr):
    """Token ``q``'s program is done with its stores: count it in on its tile; the tile's last program sums the tile
    and counts the tile in. True for the launch's last tile (its program runs the loss's tail)."""
    b, t = _bt(q, T)
    j = t // TILE
    n_tiles_row = tl.cdiv(T, TILE)
    last = False
    if _arrive(ctr_ptr, b * n_tiles_row + j, tl.minimum(T - j * TILE, TILE)):
        _tile_sums(val_ptr, aux_ptr, y_ptr, y_sb, y_st, part_ptr, b, j, T, plane, n_tiles, ignore_index, AUX, TILE)
        last = _arrive(ctr_ptr, n_tiles, n_tiles)
    return last


# ------------------------------------------------------------------ kernels: row terms + folded finalize
@jit
def _ratio_row(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, ref_ptr, val_ptr, coef_ptr, lse_ptr, aux_ptr, ctr_ptr, part_ptr,
               q, N, T, V, n_tiles, inv_t, ignore_index, clip_lo, clip_hi, BLOCK_V: tl.constexpr, TILE: tl.constexpr,
               CLIP: tl.constexpr):
    """One DPO / KTO token row: the clipped log-ratio terms (:func:`..token_terms.kernel._terms`, MODE 1) and the
    fold; True if this program counted the launch's last tile."""
    _terms(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, ref_ptr, ref_ptr, ref_ptr, 0, 0, val_ptr, coef_ptr, lse_ptr, aux_ptr,
           y_ptr, q, N, N, T, V, inv_t, ignore_index, clip_lo, clip_hi, 0.0, 0.0, 0.0, N, 0, 0, BLOCK_V, 1,
           CLIP, False, False, False)
    return _row_done(val_ptr, aux_ptr, y_ptr, y_sb, y_st, ctr_ptr, part_ptr, q, T, N.to(tl.int64), n_tiles,
                     ignore_index, 1, TILE)


@jit(do_not_specialize=["N", "B", "n_tiles"])
def _dpo_loss_kernel(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, ref_ptr, val_ptr, coef_ptr, lse_ptr, aux_ptr, ctr_ptr,
                     part_ptr, loss_ptr, met_ptr, w_ptr, N, B, T, V, n_tiles, inv_t, ignore_index, clip_lo, clip_hi,
                     beta, label_smoothing, BLOCK_V: tl.constexpr, TILE: tl.constexpr, BLOCK_B: tl.constexpr,
                     BLOCK_T: tl.constexpr, CLIP: tl.constexpr):
    """DPO: the row terms of logits row ``q`` (:func:`..token_terms.kernel._terms`, MODE 1), then the fold; the last
    program runs :func:`.kernel._dpo_tail` on the partial sums (pairs ``(j, B / 2 + j)``)."""
    q = tl.program_id(0).to(tl.int64)
    if _ratio_row(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, ref_ptr, val_ptr, coef_ptr, lse_ptr, aux_ptr, ctr_ptr, part_ptr,
                  q, N, T, V, n_tiles, inv_t, ignore_index, clip_lo, clip_hi, BLOCK_V, TILE, CLIP):
        nt = n_tiles.to(tl.int64)
        P = B // 2
        _dpo_tail(part_ptr, part_ptr + nt, part_ptr + 2 * nt, 0, 0, loss_ptr, met_ptr, w_ptr, P, tl.cdiv(T, TILE),
                  0, P, ignore_index, beta, label_smoothing, BLOCK_B, BLOCK_T, True)


@jit(do_not_specialize=["N", "B", "n_tiles", "BK", "TK", "z0_given"])
def _kto_loss_kernel(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, ref_ptr, des_ptr, kl_ptr, klref_ptr, klm_ptr, z0_ptr,
                     val_ptr, coef_ptr, lse_ptr, aux_ptr, ctr_ptr, part_ptr, loss_ptr, met_ptr, w_ptr, N, B, T, V,
                     n_tiles, BK, TK, inv_t, ignore_index, clip_lo, clip_hi, beta, lam_d, lam_u, z0_given,
                     BLOCK_V: tl.constexpr, TILE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
                     CLIP: tl.constexpr):
    """KTO: program 0 first finds the baseline ``z0`` (:func:`.kernel._kto_z0` over the KL rows, clipped like the
    rows, or ``*z0_ptr`` when ``z0_given``) and leaves it after the partial planes; then every program its row
    terms and the fold; the last runs :func:`.kernel._kto_tail`."""
    q = tl.program_id(0).to(tl.int64)
    nt = n_tiles.to(tl.int64)
    if q == 0:  # before this program's row: its tile's counter carries the store to the last program
        if z0_given != 0:
            z0 = tl.load(z0_ptr).to(tl.float32)
        else:
            z0 = _kto_z0(kl_ptr, klref_ptr, klm_ptr, BK, TK, CLIP, clip_lo, clip_hi, BLOCK_B, BLOCK_T)
        tl.store(part_ptr + 3 * nt, z0)
    if _ratio_row(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, ref_ptr, val_ptr, coef_ptr, lse_ptr, aux_ptr, ctr_ptr, part_ptr,
                  q, N, T, V, n_tiles, inv_t, ignore_index, clip_lo, clip_hi, BLOCK_V, TILE, CLIP):
        z0 = tl.load(part_ptr + 3 * nt, cache_modifier=".cg")
        _kto_tail(part_ptr, part_ptr + nt, part_ptr + 2 * nt, 0, 0, des_ptr, z0, loss_ptr, met_ptr, w_ptr, B,
                  tl.cdiv(T, TILE), 0, B, ignore_index, beta, lam_d, lam_u, BLOCK_B, BLOCK_T, True)


@jit
def _shared_weight(y_ptr, y_sb, y_st, norm_ptr, B, T, ignore_index, loss_type, norm_kind, norm_value, dr_scale,
                   BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr):
    """The row weight every row shares when ``loss_type`` is not "grpo" (as :func:`.kernel._grpo_tail` writes it):
    ``dr_scale`` (dr_grpo), ``1 / normalizer``, or ``1 / max(sum m, 1)`` over every label (dapo / bnpo)."""
    w = dr_scale
    if loss_type == 0:
        if norm_kind == 1:
            w = 1.0 / norm_value
        elif norm_kind == 2:
            w = 1.0 / tl.load(norm_ptr).to(tl.float32)
        else:
            n = 0.0  # a scalar a trip (a vector carried through both loops crashed triton 3.6's thread-locality pass)
            for b0 in range(0, B, BLOCK_B):
                b = b0 + tl.arange(0, BLOCK_B)
                for t0 in range(0, T, BLOCK_T):
                    t = t0 + tl.arange(0, BLOCK_T)
                    inb = (b < B)[:, None] & (t < T)[None, :]
                    n += tl.sum(tl.sum(_valid(y_ptr, y_sb, y_st, b, t, inb, ignore_index).to(tl.float32), 1), 0)
            w = 1.0 / tl.maximum(n, 1.0)
    return w


@jit
def _grpo_row(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, ref_ptr, klref_ptr, adv_ptr, adv_sb, adv_st, wg_ptr, wg, g_ptr,
              g_sb, g_st, val_ptr, coef_ptr, lse_ptr, aux_ptr, ctr_ptr, part_ptr, q, N, T, V, n_tiles, inv_t,
              ignore_index, clip_lo, clip_hi, rho_lo, rho_hi, beta, BLOCK_V: tl.constexpr, TILE: tl.constexpr,
              CLIP: tl.constexpr, HAS_KL_REF: tl.constexpr, GRAD: tl.constexpr):
    """One GRPO token row: terms (on the persistent grid the softmax sweep keeps the row in L2), the gradient
    (``GRAD``, see :func:`_grpo_loss_kernel`) and the fold; True if this program counted the launch's last tile."""
    plane = N.to(tl.int64)
    base, q, y, valid, lse, coef = _terms(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, ref_ptr, klref_ptr, adv_ptr, adv_sb,
                                          adv_st, val_ptr, coef_ptr, lse_ptr, aux_ptr, y_ptr, q, N, N, T, V, inv_t,
                                          ignore_index, clip_lo, clip_hi, rho_lo, rho_hi, beta, N, 0, 0, BLOCK_V,
                                          2, CLIP, HAS_KL_REF, False, GRAD >= 2)
    if GRAD != 0:
        _grad_row(base, g_ptr, g_sb, g_st, wg_ptr, q, q, T, V, y, valid, lse, coef * wg, inv_t, BLOCK_V, GRAD >= 2,
                  GRAD != 3)
    return _row_done(val_ptr, aux_ptr, y_ptr, y_sb, y_st, ctr_ptr, part_ptr, q, T, plane, n_tiles, ignore_index, 4,
                     TILE)


@jit(do_not_specialize=["N", "B", "n_tiles", "adv_sb", "adv_st", "loss_type", "norm_kind"])
def _grpo_loss_kernel(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, ref_ptr, klref_ptr, adv_ptr, adv_sb, adv_st, wg_ptr,
                      g_ptr, g_sb, g_st, val_ptr, coef_ptr, lse_ptr, aux_ptr, ctr_ptr, part_ptr, norm_ptr, loss_ptr,
                      met_ptr, w_ptr, N, B, T, V, n_tiles, inv_t, ignore_index, clip_lo, clip_hi, rho_lo, rho_hi,
                      beta, loss_type, norm_kind, norm_value, dr_scale, BLOCK_V: tl.constexpr, TILE: tl.constexpr,
                      BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr, CLIP: tl.constexpr, HAS_KL_REF: tl.constexpr,
                      GRAD: tl.constexpr):
    """GRPO: the row terms (MODE 2), the fold, and :func:`.kernel._grpo_tail` in the last program (after its rows:
    nothing of the tail is live in the row loop). ``GRAD`` (the gradient in the forward): 0 none; 2 the persistent
    grid (rows ``pid, pid + P, ...``), each row scaled by ``w[b]`` (``wg_ptr``); 3 the persistent grid with the
    weight every row shares, found by each program first (:func:`_shared_weight`)."""
    wg = 1.0  # the shared row weight (ROW_WEIGHTS: read per row, w[b], from wg_ptr)
    if GRAD == 3:
        wg = _shared_weight(y_ptr, y_sb, y_st, norm_ptr, B, T, ignore_index, loss_type, norm_kind, norm_value,
                            dr_scale, BLOCK_B, BLOCK_T)
    last = False
    if GRAD >= 2:
        for r in range(tl.program_id(0), N, tl.num_programs(0)):
            last |= _grpo_row(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, ref_ptr, klref_ptr, adv_ptr, adv_sb, adv_st,
                              wg_ptr, wg, g_ptr, g_sb, g_st, val_ptr, coef_ptr, lse_ptr, aux_ptr, ctr_ptr, part_ptr,
                              tl.cast(r, tl.int64), N, T, V, n_tiles, inv_t, ignore_index, clip_lo, clip_hi, rho_lo,
                              rho_hi, beta, BLOCK_V, TILE, CLIP, HAS_KL_REF, GRAD)
    else:
        last = _grpo_row(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, ref_ptr, klref_ptr, adv_ptr, adv_sb, adv_st, wg_ptr,
                         wg, g_ptr, g_sb, g_st, val_ptr, coef_ptr, lse_ptr, aux_ptr, ctr_ptr, part_ptr,
                         tl.program_id(0).to(tl.int64), N, T, V, n_tiles, inv_t, ignore_index, clip_lo, clip_hi,
                         rho_lo, rho_hi, beta, BLOCK_V, TILE, CLIP, HAS_KL_REF, GRAD)
    if last:
        nt = n_tiles.to(tl.int64)
        _grpo_tail(part_ptr, part_ptr + nt, part_ptr + 5 * nt, 0, 0, norm_ptr, loss_ptr, met_ptr, w_ptr, B,
                   tl.cdiv(T, TILE), nt, ignore_index, loss_type, norm_kind, norm_value, dr_scale, BLOCK_B, BLOCK_T,
                   True, True)


# ------------------------------------------------------------------ workspace and launch shapes
# A folded row kernel without a gradient sweep is told the registers that leave room for this many warps an SM (7
# programs of 4 warps: 72 registers): its loss tail, run by one program, would otherwise set the whole kernel's
# register count and with it the programs an SM that keep the logits streaming.
ROW_WARPS_PER_SM = 28
# GRPO's gradient in the forward runs on a persistent grid of GIF_PROGRAMS_PER_SM programs an SM of GIF_WARPS warps
# (one program fills an SM's threads), each thread GIF_BYTES_PER_THREAD bytes of a row a trip: the rows in flight
# stay in L2 for the gradient's second sweep, and the 128 registers a thread has at 512 threads an SM hold it.
GIF_PROGRAMS_PER_SM = 1
GIF_WARPS = 16
GIF_BYTES_PER_THREAD = 32

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


def _sm_count(device: torch.device) -> int:
    """SMs of ``device``: a GPU's own; 132 (sm_90's) for ``meta`` (the compile gate); 3 in the interpreter, so that
    each program of a small test walks several rows."""
    if device.type == "cuda":
        return _cuda_sm_count(device)
    return 132 if device.type in COMPILED_DEVICES else 3


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def fold_config(x: Tensor, B: int, warps: int) -> tuple[int, int, int]:
    """``(TILE, BLOCK_B, BLOCK_T)``: tokens a tile (one partial sum each; 512 on GPU, 4 in the interpreter so that
    small rows have several tiles) and the tail's ``[BLOCK_B, BLOCK_T]`` walk over the ``[B, n_tiles / B]``
    partial sums, one element a thread (:func:`.kernel.tiles`' rule: 1, 2 or 4 rows a tile; at 2 a thread triton
    3.6's ptxas spilled 4-8 bytes in DPO's and KTO's)."""
    bb = 1 if B <= 1 else 2 if B == 2 else 4
    if x.device.type in COMPILED_DEVICES:
        return 512, bb, 32 * warps // bb
    return 4, *((1, 8) if bb == 1 else (2, 4))


def _workspace(x: Tensor, B: int, T: int, tile: int, planes: int):
    """``(n_tiles, partial sums [planes * n_tiles + 1], counters)`` of a launch (the extra slot: KTO's ``z0``)."""
    n_tiles = B * -(-T // tile)
    part = torch.empty((planes * n_tiles + 1,), dtype=torch.float32, device=x.device)
    return n_tiles, part, counters(x.device, n_tiles + 1)


def _launch(kernel, x, grid, **kwargs):
    """Launch, and zero the counters if an interpreted launch stops half way (a compiled one cannot)."""
    try:
        with device_guard(x):
            launcher(kernel, x)[grid](**kwargs)
    except BaseException:
        if x.device.type not in COMPILED_DEVICES:
            reset_counters()
        raise


def _planes(B, T, n, like):
    f32 = dict(dtype=torch.float32, device=like.device)
    return (*(torch.empty((B, T), **f32) for _ in range(3)), torch.empty((n, B, T), **f32))


# ------------------------------------------------------------------ launchers (torch.library ops) and their callers
@custom_op("dpo_loss_out", mutates_args=("val", "coef", "lse", "aux", "loss", "met", "w"))
def _dpo_out(logits: Tensor, labels: Tensor, ref: Tensor, val: Tensor, coef: Tensor, lse: Tensor, aux: Tensor,
             loss: Tensor, met: Tensor, w: Tensor, clip_on: bool, clip_lo: float, clip_hi: float, inv_t: float,
             ignore_index: int, beta: float, label_smoothing: float) -> None:
    B, T = labels.shape
    rows, x_sb, x_st = logits_rows(logits, T)
    block, warps = sweep_config(logits, family="terms")
    tile, bb, bt = fold_config(logits, B, warps)
    n_tiles, part, ctr = _workspace(logits, B, T, tile, 3)
    _launch(_dpo_loss_kernel, logits, (rows,),
            # data
            x_ptr=logits, y_ptr=labels, ref_ptr=ref, val_ptr=val, coef_ptr=coef, lse_ptr=lse, aux_ptr=aux,
            ctr_ptr=ctr, part_ptr=part, loss_ptr=loss, met_ptr=met, w_ptr=w,
            # strides
            x_sb=x_sb, x_st=x_st, y_sb=labels.stride(0), y_st=labels.stride(1),
            # sizes and scalars
            N=rows, B=B, T=T, V=logits.shape[-1], n_tiles=n_tiles, inv_t=inv_t, ignore_index=ignore_index,
            clip_lo=clip_lo, clip_hi=clip_hi, beta=beta, label_smoothing=label_smoothing,
            # constants
            BLOCK_V=block, TILE=tile, BLOCK_B=bb, BLOCK_T=bt, CLIP=clip_on, num_warps=warps,
            **_register_budget(logits, warps))


@custom_op("kto_loss_out", mutates_args=("val", "coef", "lse", "aux", "loss", "met", "w"))
def _kto_out(logits: Tensor, labels: Tensor, ref: Tensor, desirable: Tensor, kl: Optional[Tensor],
             kl_ref: Optional[Tensor], kl_mask: Optional[Tensor], z0: Optional[Tensor], val: Tensor, coef: Tensor,
             lse: Tensor, aux: Tensor, loss: Tensor, met: Tensor, w: Tensor, clip_on: bool, clip_lo: float,
             clip_hi: float, inv_t: float, ignore_index: int, beta: float, lam_d: float, lam_u: float) -> None:
    B, T = labels.shape
    rows, x_sb, x_st = logits_rows(logits, T)
    block, warps = sweep_config(logits, family="terms")
    has_kl = kl is not None
    BK, TK = kl.shape if has_kl else (0, 0)
    tile, bb, bt = fold_config(logits, min(B, BK) if has_kl else B, warps)
    n_tiles, part, ctr = _workspace(logits, B, T, tile, 3)
    _launch(_kto_loss_kernel, logits, (rows,),
            # data (absent KL rows and z0 point at val, and desirable stands in for a bool mask: no new variant)
            x_ptr=logits, y_ptr=labels, ref_ptr=ref, des_ptr=desirable, kl_ptr=kl if has_kl else val,
            klref_ptr=kl_ref if has_kl else val, klm_ptr=kl_mask if has_kl else desirable,
            z0_ptr=val if z0 is None else z0, val_ptr=val, coef_ptr=coef, lse_ptr=lse, aux_ptr=aux, ctr_ptr=ctr,
            part_ptr=part, loss_ptr=loss, met_ptr=met, w_ptr=w,
            # strides
            x_sb=x_sb, x_st=x_st, y_sb=labels.stride(0), y_st=labels.stride(1),
            # sizes and scalars
            N=rows, B=B, T=T, V=logits.shape[-1], n_tiles=n_tiles, BK=BK, TK=TK, inv_t=inv_t,
            ignore_index=ignore_index, clip_lo=clip_lo, clip_hi=clip_hi, beta=beta, lam_d=lam_d, lam_u=lam_u,
            z0_given=int(z0 is not None),
            # constants
            BLOCK_V=block, TILE=tile, BLOCK_B=bb, BLOCK_T=bt, CLIP=clip_on, num_warps=warps,
            **_register_budget(logits, warps))


def _grpo_launch(logits: Tensor, labels: Tensor, ref: Tensor, klref: Optional[Tensor], adv: Tensor,
                 wg: Optional[Tensor], grad: Optional[Tensor], grad_inplace: bool, norm: Optional[Tensor], val: Tensor,
                 coef: Tensor, lse: Tensor, aux: Tensor, loss: Tensor, met: Tensor, w: Tensor, clip_on: bool,
                 clip_lo: float, clip_hi: float, rho_lo: float, rho_hi: float, beta: float, inv_t: float,
                 ignore_index: int, aggregation: int, norm_value: float, length: int) -> None:
    B, T = labels.shape
    rows, x_sb, x_st = logits_rows(logits, T)
    g = logits if grad_inplace or grad is None else grad
    _, g_sb, g_st = logits_rows(g, T)
    gif = grad_inplace or grad is not None
    mode = (3 if wg is None else 2) if gif else 0  # the gradient in the forward: on the persistent grid
    block, warps = grpo_config(logits, mode)
    tile, bb, bt = fold_config(logits, B, warps)
    n_tiles, part, ctr = _workspace(logits, B, T, tile, 6)
    length = length or T
    grid = (min(rows, _sm_count(logits.device) * GIF_PROGRAMS_PER_SM),) if gif else (rows,)
    _launch(_grpo_loss_kernel, logits, grid,
            # data (unused pointers get ref: no variant of their own)
            x_ptr=logits, y_ptr=labels, ref_ptr=ref, klref_ptr=ref if klref is None else klref, adv_ptr=adv,
            wg_ptr=ref if wg is None else wg, g_ptr=g, val_ptr=val, coef_ptr=coef, lse_ptr=lse, aux_ptr=aux,
            ctr_ptr=ctr, part_ptr=part, norm_ptr=w if norm is None else norm, loss_ptr=loss, met_ptr=met, w_ptr=w,
            # strides (advantages [B] have a zero token stride)
            x_sb=x_sb, x_st=x_st, y_sb=labels.stride(0), y_st=labels.stride(1), adv_sb=adv.stride(0),
            adv_st=adv.stride(1) if adv.dim() == 2 else 0, g_sb=g_sb, g_st=g_st,
            # sizes and scalars
            N=rows, B=B, T=T, V=logits.shape[-1], n_tiles=n_tiles, inv_t=inv_t, ignore_index=ignore_index,
            clip_lo=clip_lo, clip_hi=clip_hi, rho_lo=rho_lo, rho_hi=rho_hi, beta=beta, loss_type=aggregation,
            norm_kind=2 if norm is not None else int(norm_value > 0), norm_value=norm_value,
            dr_scale=1.0 / (B * length) if B * length else 0.0,
            # constants
            BLOCK_V=block, TILE=tile, BLOCK_B=bb, BLOCK_T=bt, CLIP=clip_on, HAS_KL_REF=klref is not None, GRAD=mode,
            num_warps=warps, **_register_budget(logits, warps, mode))


# one launcher, two ops: the gradient (if any) into a buffer of its own or over the logits
_grpo_out = custom_op("grpo_loss_out", mutates_args=("grad", "val", "coef", "lse", "aux", "loss", "met", "w"))(
    _grpo_launch)
_grpo_inplace = custom_op("grpo_loss_inplace", mutates_args=("logits", "val", "coef", "lse", "aux", "loss", "met",
                                                            "w"), bumps=(0,))(_grpo_launch)


def grpo_config(x: Tensor, grad_mode: int) -> tuple[int, int]:
    """``(BLOCK_V, num_warps)`` of the folded GRPO kernel for its ``GRAD`` mode: the persistent grid's
    (:func:`gif_config`), else the forward sweep's (:func:`..logprobs.kernel.sweep_config`)."""
    if grad_mode >= 2:
        return gif_config(x)
    return sweep_config(x, family="terms")


def gif_config(x: Tensor) -> tuple[int, int]:
    """``(BLOCK_V, num_warps)`` of the persistent gradient-in-forward kernel: :data:`..constants.GIF_WARPS` warps
    (16: one program fills an SM's threads), each thread :data:`..constants.GIF_BYTES_PER_THREAD` bytes of the row a
    trip (32: 16 bf16 or 8 fp32 elements, 16 KiB in flight an SM; half for sm_80; 8 elements when the rows are not
    16-byte aligned), which the 128 registers a thread has at 512 threads an SM hold without spills on both
    version pairs. (At 64 bytes triton 3.9 compiles every variant for sm_90 in 85 registers, triton 3.6 spills up to
    0.6 KB; at 8 warps and 64 bytes both grow to 250 registers: the row loop keeps its blocks' offsets live across
    rows.) The interpreter's small blocks."""
    if x.device.type in COMPILED_DEVICES:
        aligned = rows_aligned(x)
        card = tuning.device_name(x.device) if aligned and x.is_cuda else None
        return _gif_config(x.shape[-1], x.element_size(), aligned, _arch(x.device), card, x.dtype,
                           GIF_BYTES_PER_THREAD, GIF_WARPS)
    tuned = tuning.lookup("gif", None, None, x.shape[-1])  # (a forced candidate: bench tune's CPU check)
    return tuning.clamp(tuned, x.shape[-1]) if tuned else sweep_config(x, family="terms")


@functools.lru_cache(maxsize=None)
def _gif_config(V, element_size, aligned, arch, card, dtype, bytes_per_thread, warps):
    tuned = tuning.lookup("gif", card, tuning.DTYPES.get(dtype), V)
    if tuned:  # (a table entry names the block in elements: no halving for sm_80, which compiles it as it is)
        return tuning.clamp(tuned, V)
    # halved for sm_80, and for sm_90 under triton 3.8, whose ptxas needs more than the 128 registers a thread has
    # at 16 warps for 32 bytes (8-12 bytes spilled; 16 bytes fit)
    per_thread = bytes_per_thread >> (arch < 90 or _TRITON == (3, 8))
    per_thread = per_thread // element_size if aligned else 8
    return max(min(triton.next_power_of_2(V), per_thread * 32 * warps), 8), warps


tuning.CLEARS.append(_gif_config.cache_clear)


def _arch(device: torch.device) -> int:
    """The compute capability the launch compiles for (``major * 10 + minor``; off CUDA the active driver's target,
    e.g. the compile gate's stand-in, or 90 where no driver is active: the host proxy's stubbed
    launches and the live-bytes count compile nothing)."""
    if device.type == "cuda":
        return _cuda_arch(device)
    from triton.runtime import driver
    active = driver._active  # set by the stand-ins; not `.active`, which would make the default driver (none on CPU)
    if active is None:
        return 90
    if _DRIVER_ARCH[0] is not active:  # a real CUDA driver's target is ~18 Python calls: asked once a driver
        _DRIVER_ARCH[:] = [active, active.get_current_target().arch]
    return _DRIVER_ARCH[1]


_DRIVER_ARCH = [None, 90]  # (the active driver last asked, its target's arch)


@functools.lru_cache(maxsize=None)
def _cuda_arch(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def _register_budget(x: Tensor, warps: int, grad: int = 0) -> dict:
    """``maxnreg`` for a folded kernel (:func:`..logprobs.kernel.register_budget`); ``grad``: GRPO's ``GRAD`` mode.
    A program a row without a gradient sweep (DPO, KTO, GRPO's ``GRAD`` 0): the share of :data:`ROW_WARPS_PER_SM`
    warps an SM (7 programs of 4 warps: 72 registers), so that a loss tail run by one program does not set the whole
    kernel's registers and with them fewer programs an SM; told 72 these compile without spills from 16-bit logits
    (fp32 rows: half the programs). The persistent grid (``GRAD`` >= 2): its programs an SM, except for sm_90 under
    triton < 3.8, whose ptxas fits in 128 registers by itself but spills 8-12 bytes when told 128; triton 3.8's
    ptxas, left to itself, spills at 64 registers for T = 1. The compile gate checks every variant on both version
    pairs and both architectures."""
    persistent = grad >= 2
    if persistent and _OLD_TRITON and x.device.type in COMPILED_DEVICES and _arch(x.device) >= 90:
        return {}
    if persistent:
        per_sm = GIF_PROGRAMS_PER_SM
    else:  # fp32 rows hold twice the registers an element: half the programs (at 72, KTO's spilled for sm_80)
        per_sm = ROW_WARPS_PER_SM // warps // (1 if x.element_size() <= 2 else 2)
    return register_budget(x, warps, max(per_sm, 1))


_TRITON = tuple(int(p) for p in triton.__version__.split(".")[:2])
_OLD_TRITON = _TRITON < (3, 8)


def dpo_loss(logits, labels, ref_logps, p, inp=None):
    """``(val, coef, lse, aux, loss, metrics, w)`` of DPO in one launch: :func:`..token_terms.kernel.token_terms`'
    outputs and :func:`.kernel.dpo_finalize`'s."""
    B, T = labels.shape
    val, coef, lse, aux = _planes(B, T, 4, logits)
    loss, met, w = _outputs(logits, B, "dpo")
    _, clip_on, lo, hi, _, _, _, inv_t, ignore_index = p.terms
    _dpo_out(logits, labels, _f32(ref_logps), val, coef, lse, aux, loss, met, w, clip_on, lo, hi, inv_t, ignore_index,
             float(p.beta), float(p.label_smoothing))
    return val, coef, lse, aux, loss, met, w


def kto_loss(logits, labels, ref_logps, p, inp):
    """``(val, coef, lse, aux, loss, metrics, w)`` of KTO in one launch (the baseline from ``inp.z0`` or the KL rows
    ``inp.kl_*``, as :func:`.kernel.kto_finalize`)."""
    B, T = labels.shape
    val, coef, lse, aux = _planes(B, T, 4, logits)
    loss, met, w = _outputs(logits, B, "kto")
    has_kl = inp.kl_logps is not None and inp.z0 is None
    kl = tuple(t.contiguous() for t in (inp.kl_logps, inp.kl_ref_logps, inp.kl_mask)) if has_kl else (None,) * 3
    z0 = None if inp.z0 is None else inp.z0.reshape(1).to(torch.float32)
    _, clip_on, lo, hi, _, _, _, inv_t, ignore_index = p.terms
    _kto_out(logits, labels, _f32(ref_logps), inp.desirable.contiguous(), *kl, z0, val, coef, lse, aux, loss, met, w,
             clip_on, lo, hi, inv_t, ignore_index, float(p.beta), float(p.desirable_weight),
             float(p.undesirable_weight))
    return val, coef, lse, aux, loss, met, w


def grpo_loss(logits, labels, ref_logps, p, inp, row_weight=None, grad_out=None):
    """``(val, coef, lse, aux, loss, metrics, w)`` of GRPO in one launch. With ``grad_out`` (a buffer shaped like
    ``logits``, or ``logits`` itself: in place) the gradient for ``grad_output = 1`` too, on the persistent grid,
    scaled per row by ``row_weight`` (the weights-only finalize's ``w``; needed by ``loss_type="grpo"``) or, without
    it, by the weight all rows share, found in the kernel."""
    B, T = labels.shape
    val, coef, lse, aux = _planes(B, T, 5, logits)
    loss, met, w = _outputs(logits, B, "grpo")
    norm = None if inp.normalizer is None else inp.normalizer.reshape(1).to(torch.float32)
    inplace = grad_out is not None and grad_out is logits
    (_grpo_inplace if inplace else _grpo_out)(
        logits, labels, _f32(ref_logps), _f32(inp.kl_ref_logps), inp.advantages.to(torch.float32), _f32(row_weight),
        None if inplace else grad_out, inplace, norm, val, coef, lse, aux, loss, met, w, *p.terms[1:],
        p.aggregation, 0.0 if p.normalizer is None else float(p.normalizer),
        p.max_completion_length or 0)
    return val, coef, lse, aux, loss, met, w


FUSED = {"dpo": dpo_loss, "kto": kto_loss, "grpo": grpo_loss}
