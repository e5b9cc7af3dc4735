r"""DPO's kernels: the loss over pairs ``(j, P + j)`` of per-row clipped sums, as a launch of its own after the row
kernel (:func:`dpo_finalize`: a packed batch, a fused-linear chunk's pairs) or folded into the row kernel, the
forward in one launch (:func:`dpo_loss`: a dense batch, :mod:`.fold`). The math is :mod:`humanline_kernels.reference`'s
``dpo``: ``s = sum_t m val``, ``h_j = beta (s_j - s_{P+j})``, ``loss = mean_j[-(1 - ls) logsig(h_j) - ls
logsig(-h_j)]``, and the row weights ``w = d loss / d val`` that make the backward one launch.
"""
from __future__ import annotations

import triton.language as tl
from torch import Tensor

from ._jit import custom_op, jit, launcher
from .common import (
    as_f32,
    band,
    device_guard,
    frac,
    logits_rows,
    logsigmoid,
    loss_outputs,
    row_sums,
    sweep_config,
    tiles,
)
from .fold import fold_config, planes, ratio_row, reset_counters_if_interpreted, row_register_budget, workspace


# ------------------------------------------------------------------ device functions and kernels
@jit(do_not_specialize=["P", "T", "J0", "J1"])
def _dpo_finalize_kernel(val_ptr, aux_ptr, y_ptr, y_sb, y_st, loss_ptr, met_ptr, w_ptr, P, T, J0, J1, ignore_index,
                         beta, label_smoothing, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr):
    """:func:`_dpo_tail` as a launch of its own (one program): a packed batch's, and the fused-linear chunks'."""
    _dpo_tail(
        val_ptr=val_ptr, aux_ptr=aux_ptr, y_ptr=y_ptr, y_sb=y_sb, y_st=y_st, loss_ptr=loss_ptr,
        met_ptr=met_ptr, w_ptr=w_ptr, P=P, T=T, J0=J0, J1=J1, ignore_index=ignore_index, beta=beta,
        label_smoothing=label_smoothing, BLOCK_B=BLOCK_B, BLOCK_T=BLOCK_T, PARTIAL=False)


@jit
def _dpo_tail(val_ptr, aux_ptr, y_ptr, y_sb, y_st, loss_ptr, met_ptr, w_ptr, P, T, J0, J1, ignore_index, beta,
              label_smoothing, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr, PARTIAL: tl.constexpr):
    """DPO over pairs ``(j, P + j)``: ``s = sum_t m val``, ``h_j = beta (s_j - s_{P+j})``,
    ``loss = mean_j[-(1 - ls) logsig(h_j) - ls logsig(-h_j)]``;
    ``w_j = -w_{P+j} = beta / P * (-(1 - ls) sig(-h_j) + ls sig(h_j))``; metrics: means of ``rc = beta s_j``,
    ``rr = beta s_{P+j}``, ``rc - rr``, ``[rc > rr]``, and ``unclipped_frac = sum m inside / sum m``.
    Only the pairs ``J0 <= j < J1`` are read and get ``w`` (a fused-linear chunk; sums and means still over
    ``P``): the whole batch is ``(0, P)``. ``PARTIAL``: the row sums come from per-tile partial sums
    (:func:`row_sums`)."""
    acc_loss = tl.zeros([BLOCK_B], dtype=tl.float32)
    acc_rc = tl.zeros([BLOCK_B], dtype=tl.float32)
    acc_rr = tl.zeros([BLOCK_B], dtype=tl.float32)
    acc_margin = tl.zeros([BLOCK_B], dtype=tl.float32)
    acc_win = tl.zeros([BLOCK_B], dtype=tl.float32)
    acc_in = tl.zeros([BLOCK_B], dtype=tl.float32)
    acc_n = tl.zeros([BLOCK_B], dtype=tl.float32)
    for j0 in range(J0, J1, BLOCK_B):
        j = j0 + tl.arange(0, BLOCK_B)
        jm = j < J1
        s_c, in_c, n_c = row_sums(
            val_ptr=val_ptr, aux_ptr=aux_ptr, y_ptr=y_ptr, y_sb=y_sb, y_st=y_st, rows=j, rmask=jm, T=T,
            ignore_index=ignore_index, BLOCK_B=BLOCK_B, BLOCK_T=BLOCK_T, PARTIAL=PARTIAL)
        s_r, in_r, n_r = row_sums(
            val_ptr=val_ptr, aux_ptr=aux_ptr, y_ptr=y_ptr, y_sb=y_sb, y_st=y_st, rows=j + P, rmask=jm, T=T,
            ignore_index=ignore_index, BLOCK_B=BLOCK_B, BLOCK_T=BLOCK_T, PARTIAL=PARTIAL)
        h = beta * (s_c - s_r)
        ls_pos = logsigmoid(h)
        ls_neg = logsigmoid(-h)
        acc_loss += tl.where(jm, -(1.0 - label_smoothing) * ls_pos - label_smoothing * ls_neg, 0.0)
        w = beta / P * (-(1.0 - label_smoothing) * tl.exp(ls_neg) + label_smoothing * tl.exp(ls_pos))
        tl.store(w_ptr + j, w, mask=jm)
        tl.store(w_ptr + P + j, -w, mask=jm)
        rc = beta * s_c
        rr = beta * s_r
        acc_rc += rc
        acc_rr += rr
        acc_margin += rc - rr
        acc_win += tl.where(jm & (rc > rr), 1.0, 0.0)
        acc_in += in_c + in_r
        acc_n += n_c + n_r
    tl.store(loss_ptr, tl.sum(acc_loss, 0) / P)
    tl.store(met_ptr, tl.sum(acc_rc, 0) / P)
    tl.store(met_ptr + 1, tl.sum(acc_rr, 0) / P)
    tl.store(met_ptr + 2, tl.sum(acc_margin, 0) / P)
    tl.store(met_ptr + 3, tl.sum(acc_win, 0) / P)
    tl.store(met_ptr + 4, frac(tl.sum(acc_in, 0), tl.sum(acc_n, 0)))


@jit(do_not_specialize=["N", "B", "n_tiles"])
def _dpo_loss_kernel(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, ref_ptr, val_ptr, coef_ptr, lse_ptr, aux_ptr, ctr_ptr,
                     part_ptr, loss_ptr, met_ptr, w_ptr, N, B, T, V, n_tiles, inv_temperature, ignore_index, log_eps_p,
                     log_eps_r, beta, label_smoothing, BLOCK_V: tl.constexpr, TILE: tl.constexpr, BLOCK_B: tl.constexpr,
                     BLOCK_T: tl.constexpr, CLIP: tl.constexpr):
    """DPO: the row terms of logits row ``q`` (:func:`.common.row_terms`, MODE 1), then the fold; the last
    program runs :func:`_dpo_tail` on the partial sums (pairs ``(j, B / 2 + j)``)."""
    q = tl.program_id(0).to(tl.int64)
    if ratio_row(
        x_ptr=x_ptr, x_sb=x_sb, x_st=x_st, y_ptr=y_ptr, y_sb=y_sb, y_st=y_st, ref_ptr=ref_ptr,
        val_ptr=val_ptr, coef_ptr=coef_ptr, lse_ptr=lse_ptr, aux_ptr=aux_ptr, ctr_ptr=ctr_ptr, part_ptr=part_ptr, q=q,
        N=N, T=T, V=V, n_tiles=n_tiles, inv_temperature=inv_temperature, ignore_index=ignore_index, log_eps_p=log_eps_p,
        log_eps_r=log_eps_r, BLOCK_V=BLOCK_V, TILE=TILE, CLIP=CLIP):
        nt = n_tiles.to(tl.int64)
        P = B // 2
        _dpo_tail(
            val_ptr=part_ptr, aux_ptr=part_ptr + nt, y_ptr=part_ptr + 2 * nt, y_sb=0, y_st=0,
            loss_ptr=loss_ptr, met_ptr=met_ptr, w_ptr=w_ptr, P=P, T=tl.cdiv(T, TILE), J0=0, J1=P,
            ignore_index=ignore_index, beta=beta, label_smoothing=label_smoothing, BLOCK_B=BLOCK_B, BLOCK_T=BLOCK_T,
            PARTIAL=True)


# ------------------------------------------------------------------ launchers (torch.library ops) and their callers
@custom_op("dpo_finalize_out", mutates_args=("loss", "met", "w"))
def _dpo_finalize_out(val: Tensor, aux: Tensor, labels: Tensor, loss: Tensor, met: Tensor, w: Tensor, beta: float,
                      label_smoothing: float, ignore_index: int, j0: int, j1: int) -> None:
    B, T = labels.shape
    bb, bt, warps = tiles(val, rows=j1 - j0)
    with device_guard(val):
        launcher(_dpo_finalize_kernel, val)[(1,)](
            # data
            val_ptr=val, aux_ptr=aux, y_ptr=labels, loss_ptr=loss, met_ptr=met, w_ptr=w,
            # shapes and the pairs to read
            P=B // 2, T=T, J0=j0, J1=j1,
            # strides
            y_sb=labels.stride(0), y_st=labels.stride(1),
            # the loss's options
            ignore_index=ignore_index, beta=beta, label_smoothing=label_smoothing,
            # constants
            BLOCK_B=bb, BLOCK_T=bt, num_warps=warps)


def dpo_finalize(val, aux, labels, p, inp=None, span=None):
    """``(loss, metrics [5], w [2P])`` of DPO from the row kernel's ``val``/``aux`` (see the kernel). ``span =
    (j0, j1)``: only those pairs (a fused-linear chunk; ``w`` of the other rows is left unwritten, loss and metrics
    are then partial)."""
    B = labels.shape[0]
    loss, met, w = loss_outputs(val, B, "dpo")
    j0, j1 = (0, B // 2) if span is None else span
    _dpo_finalize_out(
        # data, read with unit strides (free when already contiguous)
        val=val.contiguous(), aux=aux.contiguous(), labels=labels, loss=loss, met=met, w=w,
        # the loss's options and the pairs to read
        beta=float(p.beta), label_smoothing=float(p.label_smoothing), ignore_index=p.ignore_index, j0=j0, j1=j1)
    return loss, met, w


@custom_op("dpo_loss_out", mutates_args=("val", "coef", "lse", "aux", "loss", "met", "w"))
def _dpo_loss_out(logits: Tensor, labels: Tensor, ref: Tensor, val: Tensor, coef: Tensor, lse: Tensor, aux: Tensor,
                  loss: Tensor, met: Tensor, w: Tensor, clip: bool, log_eps_p: float, log_eps_r: float,
                  inv_temperature: float, ignore_index: int, beta: float, label_smoothing: float) -> None:
    B, T = labels.shape
    rows, x_sb, x_st = logits_rows(logits, T)
    block, warps = sweep_config(logits, family="terms")
    tile, bb, bt = fold_config(logits, B, warps)
    n_tiles, part, ctr = workspace(logits, B, T, tile, 3)
    try:
        with device_guard(logits):
            launcher(_dpo_loss_kernel, logits)[(rows,)](
                # data
                x_ptr=logits, y_ptr=labels, ref_ptr=ref, val_ptr=val, coef_ptr=coef, lse_ptr=lse, aux_ptr=aux,
                ctr_ptr=ctr, part_ptr=part, loss_ptr=loss, met_ptr=met, w_ptr=w,
                # shapes
                N=rows, B=B, T=T, V=logits.shape[-1], n_tiles=n_tiles,
                # strides
                x_sb=x_sb, x_st=x_st, y_sb=labels.stride(0), y_st=labels.stride(1),
                # the loss's options
                log_eps_p=log_eps_p, log_eps_r=log_eps_r, inv_temperature=inv_temperature, ignore_index=ignore_index,
                beta=beta, label_smoothing=label_smoothing,
                # constants
                BLOCK_V=block, TILE=tile, BLOCK_B=bb, BLOCK_T=bt, CLIP=clip, num_warps=warps,
                **row_register_budget(logits, warps))
    except BaseException:  # an interpreted launch may stop half way: its counters are not zero
        reset_counters_if_interpreted(logits)
        raise


def dpo_loss(logits, labels, ref_logps, p, inp=None):
    """``(val, coef, lse, aux, loss, metrics, w)`` of DPO in one launch: :func:`.token_terms.token_terms`'
    outputs and :func:`dpo_finalize`'s."""
    B, T = labels.shape
    val, coef, lse, aux = planes(B, T, 4, logits)
    loss, met, w = loss_outputs(logits, B, "dpo")
    _dpo_loss_out(
        # data
        logits=logits, labels=labels, ref=as_f32(ref_logps), val=val, coef=coef, lse=lse, aux=aux, loss=loss,
        met=met, w=w,
        # the loss's options
        **band(p.clip), inv_temperature=1.0 / float(p.temperature), ignore_index=p.ignore_index,
        beta=float(p.beta), label_smoothing=float(p.label_smoothing))
    return val, coef, lse, aux, loss, met, w
