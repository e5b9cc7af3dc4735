r"""KTO's kernels: the baseline ``z0`` of the KL rows and the loss of per-row clipped sums against it, as a launch of
its own after the row kernel (:func:`kto_finalize`: a packed batch, a fused-linear chunk's rows) or folded into the
row kernel, the forward in one launch (:func:`kto_loss`: a dense batch, :mod:`.fold`). The math is
:mod:`humanline_kernels.reference`'s ``kto``: ``z0 = max(0, sum s_kl / #{s_kl != 0})``, desirable rows
``desirable_weight (1 - sig(beta (s - z0)))``, undesirable ``undesirable_weight (1 - sig(beta (z0 - s)))``, and the
row weights ``w = d loss / d val`` that make the backward one launch.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton.language as tl
from torch import Tensor

from ._jit import custom_op, jit, launcher
from .common import (
    as_f32,
    band,
    clamp,
    device_guard,
    frac,
    logits_rows,
    loss_outputs,
    row_sums,
    sweep_config,
    tile_offsets,
    tiles,
)
from .fold import fold_config, planes, ratio_row, reset_counters_if_interpreted, row_register_budget, workspace


# ------------------------------------------------------------------ device functions and kernels
@jit(do_not_specialize=["B", "T", "BK", "TK", "B0", "B1"])
def _kto_finalize_kernel(val_ptr, aux_ptr, y_ptr, y_sb, y_st, des_ptr, kl_ptr, klref_ptr, klm_ptr, z0_ptr, loss_ptr,
                         met_ptr, w_ptr, B, T, BK, TK, B0, B1, ignore_index, beta, desirable_weight, undesirable_weight,
                         clip, log_eps_p, log_eps_r, z0_given, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr):
    """KTO in one program (a packed batch's, and the fused-linear chunks'): the baseline ``z0`` of the KL rows
    (:func:`_kto_z0`; read from ``z0_ptr`` when ``z0_given``, e.g. all-reduced across ranks), then
    :func:`_kto_tail`."""
    z0 = _kto_z0(
        kl_ptr=kl_ptr, klref_ptr=klref_ptr, klm_ptr=klm_ptr, BK=BK, TK=TK, clip=clip, log_eps_p=log_eps_p,
        log_eps_r=log_eps_r, BLOCK_B=BLOCK_B, BLOCK_T=BLOCK_T)
    if z0_given != 0:
        z0 = tl.load(z0_ptr).to(tl.float32)
    _kto_tail(
        val_ptr=val_ptr, aux_ptr=aux_ptr, y_ptr=y_ptr, y_sb=y_sb, y_st=y_st, des_ptr=des_ptr, z0=z0,
        loss_ptr=loss_ptr, met_ptr=met_ptr, w_ptr=w_ptr, B=B, T=T, B0=B0, B1=B1, ignore_index=ignore_index, beta=beta,
        desirable_weight=desirable_weight, undesirable_weight=undesirable_weight, BLOCK_B=BLOCK_B, BLOCK_T=BLOCK_T,
        PARTIAL=False)


@jit
def _kto_z0(kl_ptr, klref_ptr, klm_ptr, BK, TK, clip, log_eps_p, log_eps_r, BLOCK_B: tl.constexpr,
            BLOCK_T: tl.constexpr):
    """KTO's baseline from the KL rows (contiguous ``[BK, TK]``): ``s_kl = sum_t m_kl clamp(kl - kl_ref)``,
    ``z0 = max(0, sum s_kl / #{s_kl != 0})`` (0 without such rows)."""
    acc_tot = tl.zeros([BLOCK_B], dtype=tl.float32)
    acc_cnt = tl.zeros([BLOCK_B], dtype=tl.float32)
    for k0 in range(0, BK, BLOCK_B):
        k = k0 + tl.arange(0, BLOCK_B)
        km = k < BK
        s_kl = tl.zeros([BLOCK_B], dtype=tl.float32)
        for t0 in range(0, TK, BLOCK_T):
            off, t = tile_offsets(k, TK, t0, BLOCK_T)
            inb = km[:, None] & (t < TK)[None, :]
            m = inb & (tl.load(klm_ptr + off, mask=inb, other=0) != 0)
            d = tl.load(kl_ptr + off, mask=m, other=0.0) - tl.load(klref_ptr + off, mask=m, other=0.0)
            if clip != 0:
                d = clamp(d, log_eps_p, log_eps_r)
            s_kl += tl.sum(tl.where(m, d, 0.0), 1)
        acc_tot += s_kl
        acc_cnt += tl.where(s_kl != 0.0, 1.0, 0.0)
    tot = tl.sum(acc_tot, 0)
    cnt = tl.sum(acc_cnt, 0)
    return tl.maximum(tl.where(cnt > 0, tot / tl.maximum(cnt, 1.0), 0.0), 0.0, propagate_nan=tl.PropagateNan.ALL)


@jit
def _kto_tail(val_ptr, aux_ptr, y_ptr, y_sb, y_st, des_ptr, z0, loss_ptr, met_ptr, w_ptr, B, T, B0, B1, ignore_index,
              beta, desirable_weight, undesirable_weight, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
              PARTIAL: tl.constexpr):
    """KTO with the baseline ``z0``. Rows: ``s = sum_t m val``, ``x = beta (s - z0)``; desirable
    ``desirable_weight (1 - sig(x))``, undesirable ``undesirable_weight (1 - sig(-x))``; ``loss = mean_i``;
    ``w_i = beta sig(x) sig(-x) (-desirable_weight or undesirable_weight) / B``. Metrics: ``z0``, mean of ``beta s``
    over desirable and over undesirable rows (0 when none), ``unclipped_frac``. Only the rows ``B0 <= b < B1`` are
    read and get ``w`` (a fused-linear chunk; the loss still divides by ``B``): the whole batch is ``(0, B)``.
    ``PARTIAL``: the row sums come from per-tile partial sums (:func:`row_sums`)."""
    acc_loss = tl.zeros([BLOCK_B], dtype=tl.float32)
    acc_rd = tl.zeros([BLOCK_B], dtype=tl.float32)
    acc_ru = tl.zeros([BLOCK_B], dtype=tl.float32)
    acc_nd = tl.zeros([BLOCK_B], dtype=tl.float32)
    acc_nu = tl.zeros([BLOCK_B], dtype=tl.float32)
    acc_in = tl.zeros([BLOCK_B], dtype=tl.float32)
    acc_n = tl.zeros([BLOCK_B], dtype=tl.float32)
    for b0 in range(B0, B1, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        bm = b < B1
        s, n_in, n = row_sums(
            val_ptr=val_ptr, aux_ptr=aux_ptr, y_ptr=y_ptr, y_sb=y_sb, y_st=y_st, rows=b, rmask=bm, T=T,
            ignore_index=ignore_index, BLOCK_B=BLOCK_B, BLOCK_T=BLOCK_T, PARTIAL=PARTIAL)
        d_raw = tl.load(des_ptr + b, mask=bm, other=0)
        des = bm & (d_raw != 0)
        und = bm & (d_raw == 0)
        x = beta * (s - z0)
        sig_p = 1.0 / (1.0 + tl.exp(-x))
        sig_n = 1.0 / (1.0 + tl.exp(x))
        acc_loss += tl.where(des, desirable_weight * (1.0 - sig_p),
                             tl.where(und, undesirable_weight * (1.0 - sig_n), 0.0))
        tl.store(w_ptr + b, beta * sig_p * sig_n * tl.where(des, -desirable_weight, undesirable_weight) / B, mask=bm)
        r = beta * s
        acc_rd += tl.where(des, r, 0.0)
        acc_ru += tl.where(und, r, 0.0)
        acc_nd += des.to(tl.float32)
        acc_nu += und.to(tl.float32)
        acc_in += n_in
        acc_n += n
    tl.store(loss_ptr, tl.sum(acc_loss, 0) / B)
    tl.store(met_ptr, z0)
    tl.store(met_ptr + 1, tl.sum(acc_rd, 0) / tl.maximum(tl.sum(acc_nd, 0), 1.0))
    tl.store(met_ptr + 2, tl.sum(acc_ru, 0) / tl.maximum(tl.sum(acc_nu, 0), 1.0))
    tl.store(met_ptr + 3, frac(tl.sum(acc_in, 0), tl.sum(acc_n, 0)))


@jit(do_not_specialize=["N", "B", "n_tiles", "BK", "TK", "z0_given"])
def _kto_loss_kernel(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, ref_ptr, des_ptr, kl_ptr, klref_ptr, klm_ptr, z0_ptr,
                     val_ptr, coef_ptr, lse_ptr, aux_ptr, ctr_ptr, part_ptr, loss_ptr, met_ptr, w_ptr, N, B, T, V,
                     n_tiles, BK, TK, inv_temperature, ignore_index, log_eps_p, log_eps_r, beta, desirable_weight,
                     undesirable_weight, z0_given, BLOCK_V: tl.constexpr, TILE: tl.constexpr, BLOCK_B: tl.constexpr,
                     BLOCK_T: tl.constexpr, CLIP: tl.constexpr):
    """KTO: program 0 first finds the baseline ``z0`` (:func:`_kto_z0` over the KL rows, clipped like the
    rows, or ``*z0_ptr`` when ``z0_given``) and leaves it after the partial planes; then every program its row
    terms and the fold; the last runs :func:`_kto_tail`."""
    q = tl.program_id(0).to(tl.int64)
    nt = n_tiles.to(tl.int64)
    if q == 0:  # before this program's row: its tile's counter carries the store to the last program
        if z0_given != 0:
            z0 = tl.load(z0_ptr).to(tl.float32)
        else:
            z0 = _kto_z0(
                kl_ptr=kl_ptr, klref_ptr=klref_ptr, klm_ptr=klm_ptr, BK=BK, TK=TK, clip=CLIP,
                log_eps_p=log_eps_p, log_eps_r=log_eps_r, BLOCK_B=BLOCK_B, BLOCK_T=BLOCK_T)
        tl.store(part_ptr + 3 * nt, z0)
    if ratio_row(
        x_ptr=x_ptr, x_sb=x_sb, x_st=x_st, y_ptr=y_ptr, y_sb=y_sb, y_st=y_st, ref_ptr=ref_ptr,
        val_ptr=val_ptr, coef_ptr=coef_ptr, lse_ptr=lse_ptr, aux_ptr=aux_ptr, ctr_ptr=ctr_ptr, part_ptr=part_ptr, q=q,
        N=N, T=T, V=V, n_tiles=n_tiles, inv_temperature=inv_temperature, ignore_index=ignore_index, log_eps_p=log_eps_p,
        log_eps_r=log_eps_r, BLOCK_V=BLOCK_V, TILE=TILE, CLIP=CLIP):
        z0 = tl.load(part_ptr + 3 * nt, cache_modifier=".cg")
        _kto_tail(
            val_ptr=part_ptr, aux_ptr=part_ptr + nt, y_ptr=part_ptr + 2 * nt, y_sb=0, y_st=0,
            des_ptr=des_ptr, z0=z0, loss_ptr=loss_ptr, met_ptr=met_ptr, w_ptr=w_ptr, B=B, T=tl.cdiv(T, TILE), B0=0,
            B1=B, ignore_index=ignore_index, beta=beta, desirable_weight=desirable_weight,
            undesirable_weight=undesirable_weight, BLOCK_B=BLOCK_B, BLOCK_T=BLOCK_T, PARTIAL=True)


# ------------------------------------------------------------------ launchers (torch.library ops) and their callers
@custom_op("kto_finalize_out", mutates_args=("loss", "met", "w"))
def _kto_finalize_out(val: Tensor, aux: Tensor, labels: Tensor, desirable: Tensor, kl: Optional[Tensor],
                      kl_ref: Optional[Tensor], kl_mask: Optional[Tensor], z0: Optional[Tensor], loss: Tensor,
                      met: Tensor, w: Tensor, beta: float, desirable_weight: float, undesirable_weight: float,
                      clip: bool, log_eps_p: float, log_eps_r: float, ignore_index: int, b0: int, b1: int) -> None:
    B, T = labels.shape
    has_kl = kl is not None
    BK, TK = kl.shape if has_kl else (0, 0)
    # 256-element tiles: at 512, triton 3.6 spilled 4 bytes for sm_80 with contiguous labels and KL rows
    bb, bt, warps = tiles(val, 64, rows=min(b1 - b0, BK) if has_kl else b1 - b0)
    with device_guard(val):
        launcher(_kto_finalize_kernel, val)[(1,)](
            # data (absent KL rows and z0 point at val, and desirable stands in for a bool mask: no new variant)
            val_ptr=val, aux_ptr=aux, y_ptr=labels, des_ptr=desirable, kl_ptr=kl if has_kl else val,
            klref_ptr=kl_ref if has_kl else val, klm_ptr=kl_mask if has_kl else desirable,
            z0_ptr=val if z0 is None else z0, loss_ptr=loss, met_ptr=met, w_ptr=w,
            # shapes and the rows to read
            B=B, T=T, BK=BK, TK=TK, B0=b0, B1=b1,
            # strides
            y_sb=labels.stride(0), y_st=labels.stride(1),
            # the loss's options
            ignore_index=ignore_index, beta=beta, desirable_weight=desirable_weight,
            undesirable_weight=undesirable_weight, clip=int(clip), log_eps_p=log_eps_p, log_eps_r=log_eps_r,
            z0_given=int(z0 is not None),
            # constants
            BLOCK_B=bb, BLOCK_T=bt, num_warps=warps)


def _kl_rows(inp):
    """The KL rows ``(kl_logps, kl_ref_logps, kl_mask)`` as the kernels read them (contiguous), or Nones when the
    baseline is given (``inp.z0``) or there are none; and ``z0`` as a 1-element fp32 tensor, or None."""
    has_kl = inp.kl_logps is not None and inp.z0 is None
    kl = tuple(t.contiguous() for t in (inp.kl_logps, inp.kl_ref_logps, inp.kl_mask)) if has_kl else (None,) * 3
    return kl, None if inp.z0 is None else inp.z0.reshape(1).to(torch.float32)


def kto_finalize(val, aux, labels, p, inp, span=None):
    """``(loss, metrics [4], w [B])`` of KTO; the baseline from ``inp.z0`` or else from the KL rows ``inp.kl_*``
    (clipped with ``p.clip``; none: ``z0 = 0``). ``span = (b0, b1)``: only those rows (a fused-linear chunk;
    partial loss and metrics, ``w`` of the others unwritten)."""
    B = labels.shape[0]
    loss, met, w = loss_outputs(val, B, "kto")
    (kl, kl_ref, kl_mask), z0 = _kl_rows(inp)
    b0, b1 = (0, B) if span is None else span
    _kto_finalize_out(
        # data, read with unit strides (validation accepts strided views; free when already contiguous)
        val=val.contiguous(), aux=aux.contiguous(), labels=labels, desirable=inp.desirable.contiguous(), kl=kl,
        kl_ref=kl_ref, kl_mask=kl_mask, z0=z0, loss=loss, met=met, w=w,
        # the loss's options and the rows to read
        beta=float(p.beta), desirable_weight=float(p.desirable_weight),
        undesirable_weight=float(p.undesirable_weight), **band(p.clip), ignore_index=p.ignore_index, b0=b0, b1=b1)
    return loss, met, w


@custom_op("kto_loss_out", mutates_args=("val", "coef", "lse", "aux", "loss", "met", "w"))
def _kto_loss_out(logits: Tensor, labels: Tensor, ref: Tensor, desirable: Tensor, kl: Optional[Tensor],
                  kl_ref: Optional[Tensor], kl_mask: Optional[Tensor], z0: Optional[Tensor], val: Tensor,
                  coef: Tensor, lse: Tensor, aux: Tensor, loss: Tensor, met: Tensor, w: Tensor, clip: bool,
                  log_eps_p: float, log_eps_r: float, inv_temperature: float, ignore_index: int, beta: float,
                  desirable_weight: float, undesirable_weight: float) -> None:
    B, T = labels.shape
    rows, x_sb, x_st = logits_rows(logits, T)
    block, warps = sweep_config(logits, family="terms")
    has_kl = kl is not None
    BK, TK = kl.shape if has_kl else (0, 0)
    tile, bb, bt = fold_config(logits, min(B, BK) if has_kl else B, warps)
    n_tiles, part, ctr = workspace(logits, B, T, tile, 3)
    try:
        with device_guard(logits):
            launcher(_kto_loss_kernel, logits)[(rows,)](
                # data (absent KL rows and z0 point at val, and desirable stands in for a bool mask: no new variant)
                x_ptr=logits, y_ptr=labels, ref_ptr=ref, des_ptr=desirable, kl_ptr=kl if has_kl else val,
                klref_ptr=kl_ref if has_kl else val, klm_ptr=kl_mask if has_kl else desirable,
                z0_ptr=val if z0 is None else z0, val_ptr=val, coef_ptr=coef, lse_ptr=lse, aux_ptr=aux, ctr_ptr=ctr,
                part_ptr=part, loss_ptr=loss, met_ptr=met, w_ptr=w,
                # shapes
                N=rows, B=B, T=T, V=logits.shape[-1], n_tiles=n_tiles, BK=BK, TK=TK,
                # strides
                x_sb=x_sb, x_st=x_st, y_sb=labels.stride(0), y_st=labels.stride(1),
                # the loss's options
                log_eps_p=log_eps_p, log_eps_r=log_eps_r, inv_temperature=inv_temperature, ignore_index=ignore_index,
                beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
                z0_given=int(z0 is not None),
                # constants
                BLOCK_V=block, TILE=tile, BLOCK_B=bb, BLOCK_T=bt, CLIP=clip, num_warps=warps,
                **row_register_budget(logits, warps))
    except BaseException:  # an interpreted launch may stop half way: its counters are not zero
        reset_counters_if_interpreted(logits)
        raise


def kto_loss(logits, labels, ref_logps, p, inp):
    """``(val, coef, lse, aux, loss, metrics, w)`` of KTO in one launch (the baseline from ``inp.z0`` or the KL rows
    ``inp.kl_*``, as :func:`kto_finalize`)."""
    B, T = labels.shape
    val, coef, lse, aux = planes(B, T, 4, logits)
    loss, met, w = loss_outputs(logits, B, "kto")
    (kl, kl_ref, kl_mask), z0 = _kl_rows(inp)
    _kto_loss_out(
        # data
        logits=logits, labels=labels, ref=as_f32(ref_logps), desirable=inp.desirable.contiguous(), kl=kl,
        kl_ref=kl_ref, kl_mask=kl_mask, z0=z0, val=val, coef=coef, lse=lse, aux=aux, loss=loss, met=met, w=w,
        # the loss's options
        **band(p.clip), inv_temperature=1.0 / float(p.temperature), ignore_index=p.ignore_index, beta=float(p.beta),
        desirable_weight=float(p.desirable_weight), undesirable_weight=float(p.undesirable_weight))
    return val, coef, lse, aux, loss, met, w
