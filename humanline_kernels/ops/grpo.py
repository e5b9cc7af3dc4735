r"""GRPO's kernels: the aggregation of the per-token terms by ``loss_type`` and, with the gradient in the forward, the
gradient of every row on a persistent grid.

* :func:`grpo_finalize`: the tail as a launch of its own after the row kernel (a packed batch, fused linear), or,
  without terms, only the row weights ``w = d loss / d val`` from the labels (needed before the row kernel by the
  gradient in the forward of ``loss_type="grpo"``).
* :func:`grpo_loss`: the forward in one launch (a dense batch), the tail folded into the row kernel
  (:mod:`.fold`); with ``grad_out`` the gradient for ``grad_output = 1`` too, on a persistent grid of
  :data:`GIF_PROGRAMS_PER_SM` programs an SM walking rows ``pid, pid + P, ...``: the rows in flight stay in L2 for
  the gradient's second sweep (the softmax sweep loads with ``evict_last``, the gradient sweep re-reads with
  ``evict_first`` and writes with streaming stores, ``.cs``). Each row is scaled by its weight from the
  weights-only finalize, or, for the loss types whose rows share one weight (dapo / bnpo: ``1 / sum m`` or the
  normalizer; dr_grpo), by that weight, found by each program before its rows.

The math is :mod:`humanline_kernels.reference`'s ``grpo`` for the four loss types the kernels aggregate.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import tuning
from ._jit import COMPILED_DEVICES, custom_op, jit, launcher
from .common import (
    as_f32,
    band,
    device_guard,
    frac,
    grad_row,
    logits_rows,
    loss_outputs,
    read_partial,
    register_budget,
    row_terms,
    rows_aligned,
    sweep_config,
    tile_mask,
    tile_offsets,
    tiles,
)
from .constants import Aggregation, GradInForward, Normalizer
from .fold import fold_config, planes, reset_counters_if_interpreted, row_done, row_register_budget, workspace

# the modes as the kernels compare them (a global a kernel reads is a constexpr)
AGG_TOKENS = tl.constexpr(int(Aggregation.TOKENS))
AGG_ROWS = tl.constexpr(int(Aggregation.ROWS))
NORM_NUMBER = tl.constexpr(int(Normalizer.NUMBER))
NORM_TENSOR = tl.constexpr(int(Normalizer.TENSOR))
GRAD_NONE = tl.constexpr(int(GradInForward.NONE))
GRAD_ROW_WEIGHTS = tl.constexpr(int(GradInForward.ROW_WEIGHTS))
GRAD_SHARED_WEIGHT = tl.constexpr(int(GradInForward.SHARED_WEIGHT))
# GRPO's gradient in the forward runs on a persistent grid of GIF_PROGRAMS_PER_SM programs an SM of GIF_WARPS warps
# (one program fills an SM's threads), each thread GIF_BYTES_PER_THREAD bytes of a row a trip: the rows in flight
# stay in L2 for the gradient's second sweep, and the 128 registers a thread has at 512 threads an SM hold it. (The
# tuned table's "gif" family overrides the block and warps on a tuned card.)
GIF_PROGRAMS_PER_SM = 1
GIF_WARPS = 16
GIF_BYTES_PER_THREAD = 32


# ------------------------------------------------------------------ device functions and kernels
@jit(do_not_specialize=["B", "T", "N"])
def _grpo_finalize_kernel(val_ptr, aux_ptr, y_ptr, y_sb, y_st, norm_ptr, loss_ptr, met_ptr, w_ptr, B, T, N,
                          ignore_index, aggregation, norm_kind, norm_value, dr_scale, BLOCK_B: tl.constexpr,
                          BLOCK_T: tl.constexpr, TERMS: tl.constexpr):
    """:func:`_grpo_tail` as a launch of its own (one program): a packed batch's, the gradient-in-forward's
    weights (without ``TERMS``) and the fused-linear chunks'."""
    _grpo_tail(
        val_ptr=val_ptr, aux_ptr=aux_ptr, y_ptr=y_ptr, y_sb=y_sb, y_st=y_st, norm_ptr=norm_ptr,
        loss_ptr=loss_ptr, met_ptr=met_ptr, w_ptr=w_ptr, B=B, T=T, N=N, ignore_index=ignore_index,
        aggregation=aggregation, norm_kind=norm_kind, norm_value=norm_value, dr_scale=dr_scale, BLOCK_B=BLOCK_B,
        BLOCK_T=BLOCK_T, TERMS=TERMS, PARTIAL=False)


@jit
def _grpo_tail(val_ptr, aux_ptr, y_ptr, y_sb, y_st, norm_ptr, loss_ptr, met_ptr, w_ptr, B, T, N, ignore_index,
               aggregation, norm_kind, norm_value, dr_scale, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
               TERMS: tl.constexpr, PARTIAL: tl.constexpr):
    """GRPO aggregation of ``val = m L`` (``n = sum m``, ``n_b = sum_t m``, ``E = #{b : n_b > 0}``):
    ``aggregation`` 0 (dapo/bnpo) ``sum val / den`` with ``den = max(n, 1)``, ``norm_value`` (``norm_kind`` 1) or
    ``*norm_ptr`` (2); 1 (grpo) ``sum_b (sum_t val / max(n_b, 1)) / max(E, 1)``; 2 (dr_grpo)
    ``sum val * dr_scale`` (``1 / (B * max_completion_length)``). ``w_b``: ``1 / den``,
    ``1 / (max(n_b, 1) max(E, 1))``, ``dr_scale``. Metrics over ``max(n, 1)``: ``unclipped_frac``, ``kl`` (sum k3),
    ``clip_frac_low``/``high``. Without ``TERMS`` only ``w`` is written (from the labels: the gradient-in-forward
    path needs it before the row kernel runs; loss and metrics are 0 then). ``PARTIAL`` (with ``TERMS``): every
    sum comes from per-tile partial sums, planes ``[B, T]`` ``N`` apart (``T`` tiles a row, :mod:`.fold`):
    ``val_ptr`` the terms, ``aux_ptr`` the four aux planes, ``y_ptr`` the token counts."""
    plane = N.to(tl.int64)  # aux's plane stride: 3 * N in int32 would wrap past ~716 M tokens
    acc_sum = tl.zeros([BLOCK_B], dtype=tl.float32)
    acc_mean = tl.zeros([BLOCK_B], dtype=tl.float32)
    acc_rows = tl.zeros([BLOCK_B], dtype=tl.float32)
    acc_n = tl.zeros([BLOCK_B], dtype=tl.float32)
    acc_in = tl.zeros([BLOCK_B], dtype=tl.float32)
    acc_low = tl.zeros([BLOCK_B], dtype=tl.float32)
    acc_high = tl.zeros([BLOCK_B], dtype=tl.float32)
    acc_k3 = tl.zeros([BLOCK_B], dtype=tl.float32)
    for b0 in range(0, B, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        bm = b < B
        s = tl.zeros([BLOCK_B], dtype=tl.float32)
        n = tl.zeros([BLOCK_B], dtype=tl.float32)
        for t0 in range(0, T, BLOCK_T):
            off, t = tile_offsets(b, T, t0, BLOCK_T)
            inb = bm[:, None] & (t < T)[None, :]
            if PARTIAL:
                n += tl.sum(read_partial(y_ptr + off, inb), 1)
                s += tl.sum(read_partial(val_ptr + off, inb), 1)
                acc_in += tl.sum(read_partial(aux_ptr + off, inb), 1)
                acc_low += tl.sum(read_partial(aux_ptr + plane + off, inb), 1)
                acc_high += tl.sum(read_partial(aux_ptr + 2 * plane + off, inb), 1)
                acc_k3 += tl.sum(read_partial(aux_ptr + 3 * plane + off, inb), 1)
            elif TERMS:
                m = tile_mask(y_ptr, y_sb, y_st, b, t, inb, ignore_index)
                n += tl.sum(m.to(tl.float32), 1)
                s += tl.sum(tl.where(m, tl.load(val_ptr + off, mask=m, other=0.0), 0.0), 1)
                acc_in += tl.sum(tl.where(m, tl.load(aux_ptr + off, mask=m, other=0.0), 0.0), 1)
                acc_low += tl.sum(tl.where(m, tl.load(aux_ptr + plane + off, mask=m, other=0.0), 0.0), 1)
                acc_high += tl.sum(tl.where(m, tl.load(aux_ptr + 2 * plane + off, mask=m, other=0.0), 0.0), 1)
                acc_k3 += tl.sum(tl.where(m, tl.load(aux_ptr + 3 * plane + off, mask=m, other=0.0), 0.0), 1)
            else:
                n += tl.sum(tile_mask(y_ptr, y_sb, y_st, b, t, inb, ignore_index).to(tl.float32), 1)
        acc_sum += s
        acc_mean += s / tl.maximum(n, 1.0)
        acc_rows += tl.where(n > 0, 1.0, 0.0)
        acc_n += n
    n_tok = tl.sum(acc_n, 0)
    rows = tl.maximum(tl.sum(acc_rows, 0), 1.0)
    den = tl.maximum(n_tok, 1.0)
    if norm_kind == NORM_NUMBER:
        den = norm_value
    if norm_kind == NORM_TENSOR:
        den = tl.load(norm_ptr).to(tl.float32)
    if TERMS:
        total = tl.sum(acc_sum, 0)
        loss = total * dr_scale
        if aggregation == AGG_TOKENS:
            loss = total / den
        if aggregation == AGG_ROWS:
            loss = tl.sum(acc_mean, 0) / rows
        tl.store(loss_ptr, loss)
        n1 = tl.maximum(n_tok, 1.0)
        tl.store(met_ptr, frac(tl.sum(acc_in, 0), n_tok))
        tl.store(met_ptr + 1, tl.sum(acc_k3, 0) / n1)
        tl.store(met_ptr + 2, tl.sum(acc_low, 0) / n1)
        tl.store(met_ptr + 3, tl.sum(acc_high, 0) / n1)
    else:  # defined outputs (zeros) rather than uninitialised memory
        tl.store(loss_ptr, 0.0)
        for i in range(4):
            tl.store(met_ptr + i, 0.0)
    # second sweep: the "grpo" weight needs E, known only now, and each row's n again (labels only); the other
    # loss types' weights are one scalar, so they skip re-reading the labels
    for b0 in range(0, B, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        bm = b < B
        n = tl.zeros([BLOCK_B], dtype=tl.float32)
        if aggregation == AGG_ROWS:
            for t0 in range(0, T, BLOCK_T):
                off, t = tile_offsets(b, T, t0, BLOCK_T)
                inb = bm[:, None] & (t < T)[None, :]
                if PARTIAL:
                    n += tl.sum(read_partial(y_ptr + off, inb), 1)
                else:
                    n += tl.sum(tile_mask(y_ptr, y_sb, y_st, b, t, inb, ignore_index).to(tl.float32), 1)
        w = tl.zeros([BLOCK_B], dtype=tl.float32) + dr_scale
        if aggregation == AGG_TOKENS:
            w = tl.zeros([BLOCK_B], dtype=tl.float32) + 1.0 / den
        if aggregation == AGG_ROWS:
            w = 1.0 / (tl.maximum(n, 1.0) * rows)
        tl.store(w_ptr + b, w, mask=bm)


@jit
def _shared_weight(y_ptr, y_sb, y_st, norm_ptr, B, T, ignore_index, aggregation, norm_kind, norm_value, dr_scale,
                   BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr):
    """The row weight every row shares when ``aggregation`` is not "grpo" (as :func:`_grpo_tail` writes it):
    ``dr_scale`` (dr_grpo), ``1 / normalizer``, or ``1 / max(sum m, 1)`` over every label (dapo / bnpo)."""
    w = dr_scale
    if aggregation == AGG_TOKENS:
        if norm_kind == NORM_NUMBER:
            w = 1.0 / norm_value
        elif norm_kind == NORM_TENSOR:
            w = 1.0 / tl.load(norm_ptr).to(tl.float32)
        else:
            n = 0.0  # a scalar a trip (a vector carried through both loops crashed triton 3.6's thread-locality pass)
            for b0 in range(0, B, BLOCK_B):
                b = b0 + tl.arange(0, BLOCK_B)
                for t0 in range(0, T, BLOCK_T):
                    t = t0 + tl.arange(0, BLOCK_T)
                    inb = (b < B)[:, None] & (t < T)[None, :]
                    n += tl.sum(tl.sum(tile_mask(y_ptr, y_sb, y_st, b, t, inb, ignore_index).to(tl.float32), 1), 0)
            w = 1.0 / tl.maximum(n, 1.0)
    return w


@jit
def _grpo_row(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, ref_ptr, klref_ptr, adv_ptr, adv_sb, adv_st, wg_ptr, wg, g_ptr,
              g_sb, g_st, val_ptr, coef_ptr, lse_ptr, aux_ptr, ctr_ptr, part_ptr, q, N, T, V, n_tiles, inv_temperature,
              ignore_index, log_eps_p, log_eps_r, ratio_low, ratio_high, beta, BLOCK_V: tl.constexpr,
              TILE: tl.constexpr, CLIP: tl.constexpr, HAS_KL_REF: tl.constexpr, GRAD: tl.constexpr):
    """One GRPO token row: terms (on the persistent grid the softmax sweep keeps the row in L2), the gradient
    (``GRAD``, see :func:`_grpo_loss_kernel`) and the fold; True if this program counted the launch's last tile."""
    plane = N.to(tl.int64)
    base, q, y, valid, lse, coef = row_terms(
        x_ptr=x_ptr, x_sb=x_sb, x_st=x_st, y_ptr=y_ptr, y_sb=y_sb, y_st=y_st, ref_ptr=ref_ptr,
        klref_ptr=klref_ptr, adv_ptr=adv_ptr, adv_sb=adv_sb, adv_st=adv_st, val_ptr=val_ptr, coef_ptr=coef_ptr,
        lse_ptr=lse_ptr, aux_ptr=aux_ptr, tok_ptr=y_ptr, r=q, N=N, Q=N, T=T, V=V, inv_temperature=inv_temperature,
        ignore_index=ignore_index, log_eps_p=log_eps_p, log_eps_r=log_eps_r, ratio_low=ratio_low, ratio_high=ratio_high,
        beta=beta, n0=N, off0=0, off1=0, BLOCK_V=BLOCK_V, MODE=2, CLIP=CLIP, HAS_KL_REF=HAS_KL_REF, TOKEN_MAP=False,
        EVICT_LAST=GRAD != GRAD_NONE)
    if GRAD != GRAD_NONE:
        grad_row(
            base=base, g_ptr=g_ptr, g_sb=g_sb, g_st=g_st, w_ptr=wg_ptr, r=q, q=q, T=T, V=V, y=y, valid=valid,
            lse=lse, g=coef * wg, inv_temperature=inv_temperature, BLOCK_V=BLOCK_V, STREAM=True,
            ROW_WEIGHT=GRAD == GRAD_ROW_WEIGHTS)
    return row_done(
        val_ptr=val_ptr, aux_ptr=aux_ptr, y_ptr=y_ptr, y_sb=y_sb, y_st=y_st, ctr_ptr=ctr_ptr,
        part_ptr=part_ptr, q=q, T=T, plane=plane, n_tiles=n_tiles, ignore_index=ignore_index, AUX=4, TILE=TILE)


@jit(do_not_specialize=["N", "B", "n_tiles", "adv_sb", "adv_st", "aggregation", "norm_kind"])
def _grpo_loss_kernel(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, ref_ptr, klref_ptr, adv_ptr, adv_sb, adv_st, wg_ptr, g_ptr,
                      g_sb, g_st, val_ptr, coef_ptr, lse_ptr, aux_ptr, ctr_ptr, part_ptr, norm_ptr, loss_ptr, met_ptr,
                      w_ptr, N, B, T, V, n_tiles, inv_temperature, ignore_index, log_eps_p, log_eps_r, ratio_low,
                      ratio_high, beta, aggregation, norm_kind, norm_value, dr_scale, BLOCK_V: tl.constexpr,
                      TILE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr, CLIP: tl.constexpr,
                      HAS_KL_REF: tl.constexpr, GRAD: tl.constexpr):
    """GRPO: the row terms (MODE 2), the fold, and :func:`_grpo_tail` in the last program (after its rows:
    nothing of the tail is live in the row loop). ``GRAD`` (the gradient in the forward): 0 none; 2 the persistent
    grid (rows ``pid, pid + P, ...``), each row scaled by ``w[b]`` (``wg_ptr``); 3 the persistent grid with the
    weight every row shares, found by each program first (:func:`_shared_weight`)."""
    wg = 1.0  # the shared row weight (ROW_WEIGHTS: read per row, w[b], from wg_ptr)
    if GRAD == GRAD_SHARED_WEIGHT:
        wg = _shared_weight(
            y_ptr=y_ptr, y_sb=y_sb, y_st=y_st, norm_ptr=norm_ptr, B=B, T=T, ignore_index=ignore_index,
            aggregation=aggregation, norm_kind=norm_kind, norm_value=norm_value, dr_scale=dr_scale, BLOCK_B=BLOCK_B,
            BLOCK_T=BLOCK_T)
    last = False
    if GRAD != GRAD_NONE:
        for r in range(tl.program_id(0), N, tl.num_programs(0)):
            last |= _grpo_row(
                x_ptr=x_ptr, x_sb=x_sb, x_st=x_st, y_ptr=y_ptr, y_sb=y_sb, y_st=y_st, ref_ptr=ref_ptr,
                klref_ptr=klref_ptr, adv_ptr=adv_ptr, adv_sb=adv_sb, adv_st=adv_st, wg_ptr=wg_ptr, wg=wg, g_ptr=g_ptr,
                g_sb=g_sb, g_st=g_st, val_ptr=val_ptr, coef_ptr=coef_ptr, lse_ptr=lse_ptr, aux_ptr=aux_ptr,
                ctr_ptr=ctr_ptr, part_ptr=part_ptr, q=tl.cast(r, tl.int64), N=N, T=T, V=V, n_tiles=n_tiles,
                inv_temperature=inv_temperature, ignore_index=ignore_index, log_eps_p=log_eps_p, log_eps_r=log_eps_r,
                ratio_low=ratio_low, ratio_high=ratio_high, beta=beta, BLOCK_V=BLOCK_V, TILE=TILE, CLIP=CLIP,
                HAS_KL_REF=HAS_KL_REF, GRAD=GRAD)
    else:
        last = _grpo_row(
            x_ptr=x_ptr, x_sb=x_sb, x_st=x_st, y_ptr=y_ptr, y_sb=y_sb, y_st=y_st, ref_ptr=ref_ptr,
            klref_ptr=klref_ptr, adv_ptr=adv_ptr, adv_sb=adv_sb, adv_st=adv_st, wg_ptr=wg_ptr, wg=wg, g_ptr=g_ptr,
            g_sb=g_sb, g_st=g_st, val_ptr=val_ptr, coef_ptr=coef_ptr, lse_ptr=lse_ptr, aux_ptr=aux_ptr, ctr_ptr=ctr_ptr,
            part_ptr=part_ptr, q=tl.program_id(0).to(tl.int64), N=N, T=T, V=V, n_tiles=n_tiles,
            inv_temperature=inv_temperature, ignore_index=ignore_index, log_eps_p=log_eps_p, log_eps_r=log_eps_r,
            ratio_low=ratio_low, ratio_high=ratio_high, beta=beta, BLOCK_V=BLOCK_V, TILE=TILE, CLIP=CLIP,
            HAS_KL_REF=HAS_KL_REF, GRAD=GRAD)
    if last:
        nt = n_tiles.to(tl.int64)
        _grpo_tail(
            val_ptr=part_ptr, aux_ptr=part_ptr + nt, y_ptr=part_ptr + 5 * nt, y_sb=0, y_st=0,
            norm_ptr=norm_ptr, loss_ptr=loss_ptr, met_ptr=met_ptr, w_ptr=w_ptr, B=B, T=tl.cdiv(T, TILE), N=nt,
            ignore_index=ignore_index, aggregation=aggregation, norm_kind=norm_kind, norm_value=norm_value,
            dr_scale=dr_scale, BLOCK_B=BLOCK_B, BLOCK_T=BLOCK_T, TERMS=True, PARTIAL=True)


# ------------------------------------------------------------------ launch configurations
def grpo_config(x: Tensor, grad_mode: int) -> tuple[int, int]:
    """``(BLOCK_V, num_warps)`` of the folded GRPO kernel for its ``GRAD`` mode: the persistent grid's
    (:func:`gif_config`), else the forward sweep's (:func:`.common.sweep_config`)."""
    if grad_mode != GradInForward.NONE:
        return gif_config(x)
    return sweep_config(x, family="terms")


def gif_config(x: Tensor) -> tuple[int, int]:
    """``(BLOCK_V, num_warps)`` of the persistent gradient-in-forward kernel: :data:`GIF_WARPS` warps
    (16: one program fills an SM's threads), each thread :data:`GIF_BYTES_PER_THREAD` bytes of the row a
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


_TRITON = tuple(int(p) for p in triton.__version__.split(".")[:2])


_OLD_TRITON = _TRITON < (3, 8)


def grpo_register_budget(x: Tensor, warps: int, grad: int = GradInForward.NONE) -> dict:
    """``maxnreg`` for the folded GRPO kernel in its ``GRAD`` mode: a program a row without a gradient sweep as every
    folded row kernel (:func:`.fold.row_register_budget`); the persistent grid the share of its programs an SM,
    except for sm_90 under triton < 3.8, whose ptxas fits in 128 registers by itself but spills 8-12 bytes when told
    128 (triton 3.8's ptxas, left to itself, spills at 64 registers for T = 1). The compile gate checks every
    variant on both version pairs and both architectures."""
    if grad == GradInForward.NONE:
        return row_register_budget(x, warps)
    if _OLD_TRITON and x.device.type in COMPILED_DEVICES and _arch(x.device) >= 90:
        return {}
    return register_budget(x, warps, max(GIF_PROGRAMS_PER_SM, 1))


def _sm_count(device: torch.device) -> int:
    """SMs of ``device``: a GPU's own; 132 (sm_90's) for ``meta`` (the compile gate); 3 in the interpreter, so that
    each program of a small test walks several rows."""
    if device.type == "cuda":
        return _cuda_sm_count(device)
    return 132 if device.type in COMPILED_DEVICES else 3


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# ------------------------------------------------------------------ launchers (torch.library ops) and their callers
@custom_op("grpo_finalize_out", mutates_args=("loss", "met", "w"))
def _grpo_finalize_out(val: Optional[Tensor], aux: Optional[Tensor], labels: Tensor, normalizer: Optional[Tensor],
                       loss: Tensor, met: Tensor, w: Tensor, aggregation: int, norm_value: float, length: int,
                       ignore_index: int) -> None:
    B, T = labels.shape
    terms = val is not None
    length = length or T
    # 256-element tiles: at 512, triton 3.6 spilled 4 bytes for sm_90 in the token-mean variant with terms
    bb, bt, warps = tiles(labels, 64, rows=B)
    with device_guard(labels):
        launcher(_grpo_finalize_kernel, labels)[(1,)](
            # data (absent ones point at w: no new variant)
            val_ptr=val if terms else w, aux_ptr=aux if terms else w, y_ptr=labels,
            norm_ptr=w if normalizer is None else normalizer, loss_ptr=loss, met_ptr=met, w_ptr=w,
            # shapes
            B=B, T=T, N=B * T,
            # strides
            y_sb=labels.stride(0), y_st=labels.stride(1),
            # the loss's options
            ignore_index=ignore_index, aggregation=aggregation,
            norm_kind=int(_normalizer_kind(normalizer, norm_value)), norm_value=norm_value,
            dr_scale=1.0 / (B * length) if B * length else 0.0,
            # constants
            BLOCK_B=bb, BLOCK_T=bt, TERMS=terms, num_warps=warps)


def _normalizer_kind(normalizer, norm_value) -> Normalizer:
    """What divides the tokens' sum: a tensor, a number (> 0 when given) or their count."""
    if normalizer is not None:
        return Normalizer.TENSOR
    return Normalizer.NUMBER if norm_value > 0 else Normalizer.COUNT


def _normalizer(p, inp):
    """GRPO's normalizer as a launch passes it: a 1-element fp32 tensor (read on the device) or None, and a number
    (0.0 when none is given)."""
    tensor = None if inp.normalizer is None else inp.normalizer.reshape(1).to(torch.float32)
    return tensor, 0.0 if p.normalizer is None else float(p.normalizer)


def grpo_finalize(val, aux, labels, p, inp, span=None):
    """``(loss, metrics [4], w [B])`` of GRPO; with ``val=None`` only ``w`` (from the labels), loss and metrics 0.
    The weights do not depend on the terms, so a fused-linear chunk needs no ``span`` (accepted and unused)."""
    B = labels.shape[0]
    loss, met, w = loss_outputs(labels, B, "grpo")
    normalizer, norm_value = _normalizer(p, inp)
    terms = val is not None
    _grpo_finalize_out(
        # data
        val=val.contiguous() if terms else None, aux=aux.contiguous() if terms else None, labels=labels,
        normalizer=normalizer, loss=loss, met=met, w=w,
        # the loss's options
        aggregation=int(p.aggregation), norm_value=norm_value, length=p.max_completion_length or 0,
        ignore_index=p.ignore_index)
    return loss, met, w


def _grpo_loss_launch(logits: Tensor, labels: Tensor, ref: Tensor, kl_ref: Optional[Tensor], advantages: Tensor,
                      row_weight: Optional[Tensor], grad: Optional[Tensor], grad_inplace: bool,
                      normalizer: Optional[Tensor], val: Tensor, coef: Tensor, lse: Tensor, aux: Tensor, loss: Tensor,
                      met: Tensor, w: Tensor, clip: bool, log_eps_p: float, log_eps_r: float, ratio_low: float,
                      ratio_high: float, beta: float, inv_temperature: float, ignore_index: int, aggregation: int,
                      norm_value: float, length: int) -> None:
    B, T = labels.shape
    rows, x_sb, x_st = logits_rows(logits, T)
    g = logits if grad_inplace or grad is None else grad
    _, g_sb, g_st = logits_rows(g, T)
    if grad_inplace or grad is not None:  # the gradient in the forward: on the persistent grid
        mode = GradInForward.SHARED_WEIGHT if row_weight is None else GradInForward.ROW_WEIGHTS
    else:
        mode = GradInForward.NONE
    block, warps = grpo_config(logits, mode)
    tile, bb, bt = fold_config(logits, B, warps)
    n_tiles, part, ctr = workspace(logits, B, T, tile, 6)
    length = length or T
    persistent = mode != GradInForward.NONE
    grid = (min(rows, _sm_count(logits.device) * GIF_PROGRAMS_PER_SM),) if persistent else (rows,)
    try:
        with device_guard(logits):
            launcher(_grpo_loss_kernel, logits)[grid](
                # data (unused pointers get ref: no variant of their own)
                x_ptr=logits, y_ptr=labels, ref_ptr=ref, klref_ptr=ref if kl_ref is None else kl_ref,
                adv_ptr=advantages, wg_ptr=ref if row_weight is None else row_weight, g_ptr=g, val_ptr=val,
                coef_ptr=coef, lse_ptr=lse, aux_ptr=aux, ctr_ptr=ctr, part_ptr=part,
                norm_ptr=w if normalizer is None else normalizer, loss_ptr=loss, met_ptr=met, w_ptr=w,
                # shapes
                N=rows, B=B, T=T, V=logits.shape[-1], n_tiles=n_tiles,
                # strides (advantages [B] have a zero token stride)
                x_sb=x_sb, x_st=x_st, y_sb=labels.stride(0), y_st=labels.stride(1), adv_sb=advantages.stride(0),
                adv_st=advantages.stride(1) if advantages.dim() == 2 else 0, g_sb=g_sb, g_st=g_st,
                # the loss's options
                log_eps_p=log_eps_p, log_eps_r=log_eps_r, ratio_low=ratio_low, ratio_high=ratio_high, beta=beta,
                inv_temperature=inv_temperature, ignore_index=ignore_index, aggregation=aggregation,
                norm_kind=int(_normalizer_kind(normalizer, norm_value)), norm_value=norm_value,
                dr_scale=1.0 / (B * length) if B * length else 0.0,
                # constants
                BLOCK_V=block, TILE=tile, BLOCK_B=bb, BLOCK_T=bt, CLIP=clip, HAS_KL_REF=kl_ref is not None,
                GRAD=int(mode), num_warps=warps, **grpo_register_budget(logits, warps, mode))
    except BaseException:  # an interpreted launch may stop half way: its counters are not zero
        reset_counters_if_interpreted(logits)
        raise


# one launcher, two ops: the gradient (if any) into a buffer of its own or over the logits
_grpo_loss_out = custom_op("grpo_loss_out", mutates_args=("grad", "val", "coef", "lse", "aux", "loss", "met", "w"))(
    _grpo_loss_launch)
_grpo_loss_inplace = custom_op("grpo_loss_inplace", mutates_args=("logits", "val", "coef", "lse", "aux", "loss", "met",
                                                                  "w"), bumps=("logits",))(_grpo_loss_launch)


def grpo_loss(logits, labels, ref_logps, p, inp, row_weight=None, grad_out=None):
    """``(val, coef, lse, aux, loss, metrics, w)`` of GRPO in one launch. With ``grad_out`` (a buffer shaped like
    ``logits``, or ``logits`` itself: in place) the gradient for ``grad_output = 1`` too, on the persistent grid,
    scaled per row by ``row_weight`` (the weights-only finalize's ``w``; needed by ``loss_type="grpo"``) or, without
    it, by the weight all rows share, found in the kernel."""
    B, T = labels.shape
    val, coef, lse, aux = planes(B, T, 5, logits)
    loss, met, w = loss_outputs(logits, B, "grpo")
    normalizer, norm_value = _normalizer(p, inp)
    inplace = grad_out is not None and grad_out is logits
    (_grpo_loss_inplace if inplace else _grpo_loss_out)(
        # data
        logits=logits, labels=labels, ref=as_f32(ref_logps), kl_ref=as_f32(inp.kl_ref_logps),
        advantages=inp.advantages.to(torch.float32), row_weight=as_f32(row_weight),
        grad=None if inplace else grad_out, grad_inplace=inplace, normalizer=normalizer, val=val, coef=coef, lse=lse,
        aux=aux, loss=loss, met=met, w=w,
        # the loss's options
        **band(p.clip), ratio_low=1.0 - float(p.epsilon_low), ratio_high=1.0 + float(p.epsilon_high),
        beta=float(p.beta), inv_temperature=1.0 / float(p.temperature), ignore_index=p.ignore_index,
        aggregation=int(p.aggregation), norm_value=norm_value, length=p.max_completion_length or 0)
    return val, coef, lse, aux, loss, met, w
