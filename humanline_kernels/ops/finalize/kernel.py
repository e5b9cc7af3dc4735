r"""Triton kernels for the ``[B, T]`` tail of the fused losses: one launch per loss after the row kernel.

The row kernel (:mod:`..token_terms.kernel`) leaves per token ``val`` (masked clipped log-ratio for DPO/KTO, masked
GRPO term for GRPO), ``coef = d val / d logp`` and ``aux [4, B, T]`` = (inside the band, GRPO low clip, high clip,
k3; GRPO's fifth plane, its log-prob, is not read here). A finalize kernel is one program that walks ``[B, T]`` in
``[BLOCK_B, BLOCK_T]`` tiles (fp32 sums, int64 offsets; ``m = [label != ignore_index]``) and writes

* ``loss`` (0-d), ``metrics [K]`` (the API's metric values, in the order of ``_params.METRICS``), and
* ``w [B]`` with ``d loss / d val[b, t] = w[b]`` for every masked token: the backward is then one launch,
  ``dlogits = grad_loss * w[b] * coef[b, t] * (onehot(y) - softmax(z / T)) / T`` (``logprobs._logprobs_bwd_kernel``
  with ``ROW_WEIGHT``).

Each launcher is a ``torch.library`` op writing into preallocated outputs
(``humanline::{dpo,kto,grpo}_finalize_out``); :func:`dpo_finalize`, :func:`kto_finalize` and :func:`grpo_finalize`
take the loss's params object and inputs, allocate, and call it (:data:`FINALIZE` maps a loss's name to them).

The math is :mod:`humanline_kernels.reference`'s (tests compare each kernel, and its eager twin in :mod:`.eager`,
against it). A single program keeps every reduction in a fixed order (deterministic, no
atomics). Sequence length and
hyperparameters are runtime arguments (``B``/``T`` not even specialised), so one compiled variant serves all.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton.language as tl
from torch import Tensor

from .._jit import COMPILED_DEVICES, custom_op, jit, launcher
from ..constants import N_METRICS
from ..logprobs.kernel import device_guard
from ..token_terms.kernel import _clamp


def tiles(t: torch.Tensor, block_t: int = 128, *, rows: int) -> tuple[int, int, int]:
    """``(BLOCK_B, BLOCK_T, num_warps)`` for a program that walks ``rows`` rows: ``4 x block_t`` tiles on GPU, 512
    elements by default (2 a thread: 1024 made the GRPO kernel spill under triton 3.6, 2048 under 3.9; the compile
    gate checks); with 1 or 2 rows the same elements as ``1 x 4 block_t`` or ``2 x 2 block_t``, since the loop is
    latency bound by its trip count (``4 x 64`` tiles over one row would leave 3/4 of each empty). In the
    interpreter ``2 x 4`` (one
    row: ``1 x 8``), so that the small test shapes cross tile boundaries in both dimensions."""
    bb = 1 if rows <= 1 else 2 if rows == 2 else 4
    if t.device.type in COMPILED_DEVICES:
        return bb, block_t * 4 // bb, 8
    return (1, 8, 1) if bb == 1 else (2, 4, 1)


@jit
def _tile(rows, T, t0, BLOCK_T: tl.constexpr):
    """Flat int64 offsets of a ``[rows, t0:t0+BLOCK_T]`` tile of a contiguous ``[B, T]`` tensor, and its t index."""
    t = t0 + tl.arange(0, BLOCK_T)
    return rows.to(tl.int64)[:, None] * T + t[None, :], t


@jit
def _valid(y_ptr, y_sb, y_st, rows, t, inb, ignore_index):
    """``m`` of a tile: label != ignore_index inside the bounds ``inb`` (labels may be a strided view)."""
    off = rows.to(tl.int64)[:, None] * y_sb + t.to(tl.int64)[None, :] * y_st
    return inb & (tl.load(y_ptr + off, mask=inb, other=0) != ignore_index)


@jit
def _row_sums(val_ptr, aux_ptr, y_ptr, y_sb, y_st, rows, rmask, T, ignore_index, BLOCK_B: tl.constexpr,
              BLOCK_T: tl.constexpr, PARTIAL: tl.constexpr):
    """Per-row ``(sum m*val, sum m*inside, sum m)`` of the rows ``rows`` (fp32 vectors). With ``PARTIAL`` the three
    are sums of partial sums: ``val_ptr``, ``aux_ptr`` and ``y_ptr`` are planes ``[B, T]`` of per-tile sums (``T``
    tiles a row; :mod:`.folded`), read past L1 (``.cg``: other programs wrote them during this launch)."""
    s = tl.zeros([BLOCK_B], dtype=tl.float32)
    n_in = tl.zeros([BLOCK_B], dtype=tl.float32)
    n = tl.zeros([BLOCK_B], dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        off, t = _tile(rows, T, t0, BLOCK_T)
        inb = rmask[:, None] & (t < T)[None, :]
        if PARTIAL:
            s += tl.sum(_part(val_ptr + off, inb), 1)
            n_in += tl.sum(_part(aux_ptr + off, inb), 1)
            n += tl.sum(_part(y_ptr + off, inb), 1)
        else:
            m = _valid(y_ptr, y_sb, y_st, rows, t, inb, ignore_index)
            s += tl.sum(tl.where(m, tl.load(val_ptr + off, mask=m, other=0.0), 0.0), 1)
            n_in += tl.sum(tl.where(m, tl.load(aux_ptr + off, mask=m, other=0.0), 0.0), 1)
            n += tl.sum(m.to(tl.float32), 1)
    return s, n_in, n


@jit
def _part(ptr, mask):
    """Partial sums another program wrote during this launch: read from L2 (``.cg``), 0 outside ``mask``. (The
    select keeps a load from feeding a sum in a loop directly: triton 3.6's thread-locality pass rewrites that
    pattern and asserts on an accumulator with two uses after the loop, as ``_grpo_tail``'s row sums have.)"""
    return tl.where(mask, tl.load(ptr, mask=mask, other=0.0, cache_modifier=".cg"), 0.0)


@jit
def _logsigmoid(x):
    # min(x, 0) - log(1 + exp(-|x|)): no overflow for either sign; NaN stays NaN
    return tl.where(x < 0, x, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(x)))


@jit
def _frac(num, den):
    """``num / den``, 1.0 when there are no tokens (nothing was clipped)."""
    return tl.where(den > 0, num / tl.maximum(den, 1.0), 1.0)


@jit(do_not_specialize=["P", "T", "J0", "J1"])
def _dpo_finalize_kernel(val_ptr, aux_ptr, y_ptr, y_sb, y_st, loss_ptr, met_ptr, w_ptr, P, T, J0, J1, ignore_index,
                         beta, label_smoothing, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr):
    """:func:`_dpo_tail` as a launch of its own (one program): a packed batch's, and the fused-linear chunks'."""
    _dpo_tail(val_ptr, aux_ptr, y_ptr, y_sb, y_st, loss_ptr, met_ptr, w_ptr, P, T, J0, J1, ignore_index, beta,
              label_smoothing, BLOCK_B, BLOCK_T, False)


@jit
def _dpo_tail(val_ptr, aux_ptr, y_ptr, y_sb, y_st, loss_ptr, met_ptr, w_ptr, P, T, J0, J1, ignore_index, beta,
              label_smoothing, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr, PARTIAL: tl.constexpr):
    """DPO over pairs ``(j, P + j)``: ``s = sum_t m val``, ``h_j = beta (s_j - s_{P+j})``,
    ``loss = mean_j[-(1 - ls) logsig(h_j) - ls logsig(-h_j)]``;
    ``w_j = -w_{P+j} = beta / P * (-(1 - ls) sig(-h_j) + ls sig(h_j))``; metrics: means of ``rc = beta s_j``,
    ``rr = beta s_{P+j}``, ``rc - rr``, ``[rc > rr]``, and ``unclipped_frac = sum m inside / sum m``.
    Only the pairs ``J0 <= j < J1`` are read and get ``w`` (a fused-linear chunk; sums and means still over
    ``P``): the whole batch is ``(0, P)``. ``PARTIAL``: the row sums come from per-tile partial sums
    (:func:`_row_sums`)."""
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
        s_c, in_c, n_c = _row_sums(val_ptr, aux_ptr, y_ptr, y_sb, y_st, j, jm, T, ignore_index, BLOCK_B, BLOCK_T,
                                   PARTIAL)
        s_r, in_r, n_r = _row_sums(val_ptr, aux_ptr, y_ptr, y_sb, y_st, j + P, jm, T, ignore_index, BLOCK_B,
                                   BLOCK_T, PARTIAL)
        h = beta * (s_c - s_r)
        ls_pos = _logsigmoid(h)
        ls_neg = _logsigmoid(-h)
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
    tl.store(met_ptr + 4, _frac(tl.sum(acc_in, 0), tl.sum(acc_n, 0)))


@jit(do_not_specialize=["B", "T", "BK", "TK", "B0", "B1"])
def _kto_finalize_kernel(val_ptr, aux_ptr, y_ptr, y_sb, y_st, des_ptr, kl_ptr, klref_ptr, klm_ptr, z0_ptr,
                         loss_ptr, met_ptr, w_ptr, B, T, BK, TK, B0, B1, ignore_index, beta, lam_d, lam_u, clip_on,
                         clip_lo, clip_hi, z0_given, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr):
    """KTO in one program (a packed batch's, and the fused-linear chunks'): the baseline ``z0`` of the KL rows
    (:func:`_kto_z0`; read from ``z0_ptr`` when ``z0_given``, e.g. all-reduced across ranks), then
    :func:`_kto_tail`."""
    z0 = _kto_z0(kl_ptr, klref_ptr, klm_ptr, BK, TK, clip_on, clip_lo, clip_hi, BLOCK_B, BLOCK_T)
    if z0_given != 0:
        z0 = tl.load(z0_ptr).to(tl.float32)
    _kto_tail(val_ptr, aux_ptr, y_ptr, y_sb, y_st, des_ptr, z0, loss_ptr, met_ptr, w_ptr, B, T, B0, B1, ignore_index,
              beta, lam_d, lam_u, BLOCK_B, BLOCK_T, False)


@jit
def _kto_z0(kl_ptr, klref_ptr, klm_ptr, BK, TK, clip_on, clip_lo, clip_hi, BLOCK_B: tl.constexpr,
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
            off, t = _tile(k, TK, t0, BLOCK_T)
            inb = km[:, None] & (t < TK)[None, :]
            m = inb & (tl.load(klm_ptr + off, mask=inb, other=0) != 0)
            d = tl.load(kl_ptr + off, mask=m, other=0.0) - tl.load(klref_ptr + off, mask=m, other=0.0)
            if clip_on != 0:
                d = _clamp(d, clip_lo, clip_hi)
            s_kl += tl.sum(tl.where(m, d, 0.0), 1)
        acc_tot += s_kl
        acc_cnt += tl.where(s_kl != 0.0, 1.0, 0.0)
    tot = tl.sum(acc_tot, 0)
    cnt = tl.sum(acc_cnt, 0)
    return tl.maximum(tl.where(cnt > 0, tot / tl.maximum(cnt, 1.0), 0.0), 0.0, propagate_nan=tl.PropagateNan.ALL)


@jit
def _kto_tail(val_ptr, aux_ptr, y_ptr, y_sb, y_st, des_ptr, z0, loss_ptr, met_ptr, w_ptr, B, T, B0, B1, ignore_index,
              beta, lam_d, lam_u, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr, PARTIAL: tl.constexpr):
    """KTO with the baseline ``z0``. Rows: ``s = sum_t m val``, ``x = beta (s - z0)``; desirable
    ``lam_d (1 - sig(x))``, undesirable ``lam_u (1 - sig(-x))``; ``loss = mean_i``;
    ``w_i = beta sig(x) sig(-x) (-lam_d or lam_u) / B``. Metrics: ``z0``, mean of ``beta s`` over desirable and
    over undesirable rows (0 when none), ``unclipped_frac``. Only the rows ``B0 <= b < B1`` are read and get ``w``
    (a fused-linear chunk; the loss still divides by ``B``): the whole batch is ``(0, B)``. ``PARTIAL``: the row
    sums come from per-tile partial sums (:func:`_row_sums`)."""
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
        s, n_in, n = _row_sums(val_ptr, aux_ptr, y_ptr, y_sb, y_st, b, bm, T, ignore_index, BLOCK_B, BLOCK_T,
                               PARTIAL)
        d_raw = tl.load(des_ptr + b, mask=bm, other=0)
        des = bm & (d_raw != 0)
        und = bm & (d_raw == 0)
        x = beta * (s - z0)
        sig_p = 1.0 / (1.0 + tl.exp(-x))
        sig_n = 1.0 / (1.0 + tl.exp(x))
        acc_loss += tl.where(des, lam_d * (1.0 - sig_p), tl.where(und, lam_u * (1.0 - sig_n), 0.0))
        tl.store(w_ptr + b, beta * sig_p * sig_n * tl.where(des, -lam_d, lam_u) / B, mask=bm)
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
    tl.store(met_ptr + 3, _frac(tl.sum(acc_in, 0), tl.sum(acc_n, 0)))


@jit(do_not_specialize=["B", "T", "N"])
def _grpo_finalize_kernel(val_ptr, aux_ptr, y_ptr, y_sb, y_st, norm_ptr, loss_ptr, met_ptr, w_ptr, B, T, N,
                          ignore_index, loss_type, norm_kind, norm_value, dr_scale, BLOCK_B: tl.constexpr,
                          BLOCK_T: tl.constexpr, TERMS: tl.constexpr):
    """:func:`_grpo_tail` as a launch of its own (one program): a packed batch's, the gradient-in-forward's
    weights (without ``TERMS``) and the fused-linear chunks'."""
    _grpo_tail(val_ptr, aux_ptr, y_ptr, y_sb, y_st, norm_ptr, loss_ptr, met_ptr, w_ptr, B, T, N, ignore_index,
               loss_type, norm_kind, norm_value, dr_scale, BLOCK_B, BLOCK_T, TERMS, False)


@jit
def _grpo_tail(val_ptr, aux_ptr, y_ptr, y_sb, y_st, norm_ptr, loss_ptr, met_ptr, w_ptr, B, T, N, ignore_index,
               loss_type, norm_kind, norm_value, dr_scale, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
               TERMS: tl.constexpr, PARTIAL: tl.constexpr):
    """GRPO aggregation of ``val = m L`` (``n = sum m``, ``n_b = sum_t m``, ``E = #{b : n_b > 0}``):
    ``loss_type`` 0 (dapo/bnpo) ``sum val / den`` with ``den = max(n, 1)``, ``norm_value`` (``norm_kind`` 1) or
    ``*norm_ptr`` (2); 1 (grpo) ``sum_b (sum_t val / max(n_b, 1)) / max(E, 1)``; 2 (dr_grpo)
    ``sum val * dr_scale`` (``1 / (B * max_completion_length)``). ``w_b``: ``1 / den``,
    ``1 / (max(n_b, 1) max(E, 1))``, ``dr_scale``. Metrics over ``max(n, 1)``: ``unclipped_frac``, ``kl`` (sum k3),
    ``clip_frac_low``/``high``. Without ``TERMS`` only ``w`` is written (from the labels: the gradient-in-forward
    path needs it before the row kernel runs; loss and metrics are 0 then). ``PARTIAL`` (with ``TERMS``): every
    sum comes from per-tile partial sums, planes ``[B, T]`` ``N`` apart (``T`` tiles a row, :mod:`.folded`):
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
            off, t = _tile(b, T, t0, BLOCK_T)
            inb = bm[:, None] & (t < T)[None, :]
            if PARTIAL:
                n += tl.sum(_part(y_ptr + off, inb), 1)
                s += tl.sum(_part(val_ptr + off, inb), 1)
                acc_in += tl.sum(_part(aux_ptr + off, inb), 1)
                acc_low += tl.sum(_part(aux_ptr + plane + off, inb), 1)
                acc_high += tl.sum(_part(aux_ptr + 2 * plane + off, inb), 1)
                acc_k3 += tl.sum(_part(aux_ptr + 3 * plane + off, inb), 1)
            elif TERMS:
                m = _valid(y_ptr, y_sb, y_st, b, t, inb, ignore_index)
                n += tl.sum(m.to(tl.float32), 1)
                s += tl.sum(tl.where(m, tl.load(val_ptr + off, mask=m, other=0.0), 0.0), 1)
                acc_in += tl.sum(tl.where(m, tl.load(aux_ptr + off, mask=m, other=0.0), 0.0), 1)
                acc_low += tl.sum(tl.where(m, tl.load(aux_ptr + plane + off, mask=m, other=0.0), 0.0), 1)
                acc_high += tl.sum(tl.where(m, tl.load(aux_ptr + 2 * plane + off, mask=m, other=0.0), 0.0), 1)
                acc_k3 += tl.sum(tl.where(m, tl.load(aux_ptr + 3 * plane + off, mask=m, other=0.0), 0.0), 1)
            else:
                n += tl.sum(_valid(y_ptr, y_sb, y_st, b, t, inb, ignore_index).to(tl.float32), 1)
        acc_sum += s
        acc_mean += s / tl.maximum(n, 1.0)
        acc_rows += tl.where(n > 0, 1.0, 0.0)
        acc_n += n
    n_tok = tl.sum(acc_n, 0)
    rows = tl.maximum(tl.sum(acc_rows, 0), 1.0)
    den = tl.maximum(n_tok, 1.0)
    if norm_kind == 1:
        den = norm_value
    if norm_kind == 2:
        den = tl.load(norm_ptr).to(tl.float32)
    if TERMS:
        total = tl.sum(acc_sum, 0)
        loss = total * dr_scale
        if loss_type == 0:
            loss = total / den
        if loss_type == 1:
            loss = tl.sum(acc_mean, 0) / rows
        tl.store(loss_ptr, loss)
        n1 = tl.maximum(n_tok, 1.0)
        tl.store(met_ptr, _frac(tl.sum(acc_in, 0), n_tok))
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
        if loss_type == 1:
            for t0 in range(0, T, BLOCK_T):
                off, t = _tile(b, T, t0, BLOCK_T)
                inb = bm[:, None] & (t < T)[None, :]
                if PARTIAL:
                    n += tl.sum(_part(y_ptr + off, inb), 1)
                else:
                    n += tl.sum(_valid(y_ptr, y_sb, y_st, b, t, inb, ignore_index).to(tl.float32), 1)
        w = tl.zeros([BLOCK_B], dtype=tl.float32) + dr_scale
        if loss_type == 0:
            w = tl.zeros([BLOCK_B], dtype=tl.float32) + 1.0 / den
        if loss_type == 1:
            w = 1.0 / (tl.maximum(n, 1.0) * rows)
        tl.store(w_ptr + b, w, mask=bm)


@jit(do_not_specialize=["B", "T", "N"])
def _seq_finalize_kernel(val_ptr, aux_ptr, y_ptr, y_sb, y_st, tw_ptr, s_ptr, pol_ptr, n_ptr, met_ptr, B, T, N,
                         ignore_index, has_tw, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr):
    """The sequence-level primitive's sums, per row ``b``: ``s_b = sum_t m w val`` (``w`` the token weights when
    ``has_tw``, else 1; ``val`` the masked clipped log-ratio), ``pol_b = sum_t m l`` (the policy's log-probs, aux
    plane 1) and ``n_b = sum_t m``; metrics ``unclipped_frac``, ``n_tokens``, ``n_unclipped`` (aux plane 0)."""
    plane = N.to(tl.int64)
    acc_in = tl.zeros([BLOCK_B], dtype=tl.float32)
    acc_n = tl.zeros([BLOCK_B], dtype=tl.float32)
    for b0 in range(0, B, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        bm = b < B
        s = tl.zeros([BLOCK_B], dtype=tl.float32)
        pol = tl.zeros([BLOCK_B], dtype=tl.float32)
        n = tl.zeros([BLOCK_B], dtype=tl.float32)
        for t0 in range(0, T, BLOCK_T):
            off, t = _tile(b, T, t0, BLOCK_T)
            inb = bm[:, None] & (t < T)[None, :]
            m = _valid(y_ptr, y_sb, y_st, b, t, inb, ignore_index)
            v = tl.load(val_ptr + off, mask=m, other=0.0)
            if has_tw != 0:
                v = v * tl.load(tw_ptr + off, mask=m, other=0.0)
            s += tl.sum(tl.where(m, v, 0.0), 1)
            pol += tl.sum(tl.where(m, tl.load(aux_ptr + plane + off, mask=m, other=0.0), 0.0), 1)
            acc_in += tl.sum(tl.where(m, tl.load(aux_ptr + off, mask=m, other=0.0), 0.0), 1)
            n += tl.sum(m.to(tl.float32), 1)
        tl.store(s_ptr + b, s, mask=bm)
        tl.store(pol_ptr + b, pol, mask=bm)
        tl.store(n_ptr + b, n, mask=bm)
        acc_n += n
    n_tok = tl.sum(acc_n, 0)
    n_in = tl.sum(acc_in, 0)
    tl.store(met_ptr, _frac(n_in, n_tok))
    tl.store(met_ptr + 1, n_tok)
    tl.store(met_ptr + 2, n_in)


# ------------------------------------------------------------------ launchers (torch.library ops) and their callers
def _outputs(like, B, name):
    f32 = dict(dtype=torch.float32, device=like.device)
    return torch.empty((), **f32), torch.empty((N_METRICS[name],), **f32), torch.empty((B,), **f32)


@custom_op("dpo_finalize_out", mutates_args=("loss", "met", "w"))
def _dpo_out(val: Tensor, aux: Tensor, labels: Tensor, loss: Tensor, met: Tensor, w: Tensor, beta: float,
             label_smoothing: float, ignore_index: int, j0: int, j1: int) -> None:
    B, T = labels.shape
    bb, bt, warps = tiles(val, rows=j1 - j0)
    with device_guard(val):
        launcher(_dpo_finalize_kernel, val)[(1,)](
            # data
            val_ptr=val, aux_ptr=aux, y_ptr=labels, loss_ptr=loss, met_ptr=met, w_ptr=w,
            # strides
            y_sb=labels.stride(0), y_st=labels.stride(1),
            # sizes, the pairs to read, scalars
            P=B // 2, T=T, J0=j0, J1=j1, ignore_index=ignore_index, beta=beta, label_smoothing=label_smoothing,
            # constants
            BLOCK_B=bb, BLOCK_T=bt, num_warps=warps)


def dpo_finalize(val, aux, labels, p, inp=None, span=None):
    """``(loss, metrics [5], w [2P])`` of DPO from the row kernel's ``val``/``aux`` (see the kernel). ``span =
    (j0, j1)``: only those pairs (a fused-linear chunk; ``w`` of the other rows is left unwritten, loss and metrics
    are then partial)."""
    B = labels.shape[0]
    loss, met, w = _outputs(val, B, "dpo")
    j0, j1 = (0, B // 2) if span is None else span
    # read with unit strides (free when already contiguous)
    _dpo_out(val.contiguous(), aux.contiguous(), labels, loss, met, w, float(p.beta), float(p.label_smoothing),
             p.ignore_index, j0, j1)
    return loss, met, w


@custom_op("kto_finalize_out", mutates_args=("loss", "met", "w"))
def _kto_out(val: Tensor, aux: Tensor, labels: Tensor, desirable: Tensor, kl: Optional[Tensor],
             kl_ref: Optional[Tensor], kl_mask: Optional[Tensor], z0: Optional[Tensor], loss: Tensor, met: Tensor,
             w: Tensor, beta: float, lam_d: float, lam_u: float, clip_on: bool, clip_lo: float, clip_hi: float,
             ignore_index: int, b0: int, b1: int) -> None:
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
            # strides
            y_sb=labels.stride(0), y_st=labels.stride(1),
            # sizes, the rows to read, scalars
            B=B, T=T, BK=BK, TK=TK, B0=b0, B1=b1, ignore_index=ignore_index, beta=beta, lam_d=lam_d, lam_u=lam_u,
            clip_on=int(clip_on), clip_lo=clip_lo, clip_hi=clip_hi, z0_given=int(z0 is not None),
            # constants
            BLOCK_B=bb, BLOCK_T=bt, num_warps=warps)


def kto_finalize(val, aux, labels, p, inp, span=None):
    """``(loss, metrics [4], w [B])`` of KTO; the baseline from ``inp.z0`` or else from the KL rows ``inp.kl_*``
    (clipped with ``p.clip``; none: ``z0 = 0``). ``span = (b0, b1)``: only those rows (a fused-linear chunk;
    partial loss and metrics, ``w`` of the others unwritten)."""
    B = labels.shape[0]
    loss, met, w = _outputs(val, B, "kto")
    has_kl = inp.kl_logps is not None and inp.z0 is None
    kl = tuple(t.contiguous() for t in (inp.kl_logps, inp.kl_ref_logps, inp.kl_mask)) if has_kl else (None,) * 3
    z0 = None if inp.z0 is None else inp.z0.reshape(1).to(torch.float32)
    b0, b1 = (0, B) if span is None else span
    c = p.clip
    # the kernel reads these with unit strides; validation accepts strided views (free when already contiguous)
    _kto_out(val.contiguous(), aux.contiguous(), labels, inp.desirable.contiguous(), *kl, z0, loss, met, w,
             float(p.beta), float(p.desirable_weight), float(p.undesirable_weight), c is not None,
             float(c.log_eps_p) if c else 0.0, float(c.log_eps_r) if c else 0.0, p.ignore_index, b0, b1)
    return loss, met, w


@custom_op("grpo_finalize_out", mutates_args=("loss", "met", "w"))
def _grpo_out(val: Optional[Tensor], aux: Optional[Tensor], labels: Tensor, norm: Optional[Tensor], loss: Tensor,
              met: Tensor, w: Tensor, aggregation: int, norm_value: float, length: int, ignore_index: int) -> None:
    B, T = labels.shape
    terms = val is not None
    norm_kind = 2 if norm is not None else int(norm_value > 0)  # a tensor, a number (> 0 when given) or the count
    length = length or T
    # 256-element tiles: at 512, triton 3.6 spilled 4 bytes for sm_90 in the token-mean variant with terms
    bb, bt, warps = tiles(labels, 64, rows=B)
    with device_guard(labels):
        launcher(_grpo_finalize_kernel, labels)[(1,)](
            # data (absent ones point at w: no new variant)
            val_ptr=val if terms else w, aux_ptr=aux if terms else w, y_ptr=labels,
            norm_ptr=w if norm is None else norm, loss_ptr=loss, met_ptr=met, w_ptr=w,
            # strides
            y_sb=labels.stride(0), y_st=labels.stride(1),
            # sizes and scalars
            B=B, T=T, N=B * T, ignore_index=ignore_index, loss_type=aggregation, norm_kind=norm_kind,
            norm_value=norm_value, dr_scale=1.0 / (B * length) if B * length else 0.0,
            # constants
            BLOCK_B=bb, BLOCK_T=bt, TERMS=terms, num_warps=warps)


def grpo_finalize(val, aux, labels, p, inp, span=None):
    """``(loss, metrics [4], w [B])`` of GRPO; with ``val=None`` only ``w`` (from the labels), loss and metrics 0.
    The weights do not depend on the terms, so a fused-linear chunk needs no ``span`` (accepted and unused)."""
    B = labels.shape[0]
    loss, met, w = _outputs(labels, B, "grpo")
    norm = None if inp.normalizer is None else inp.normalizer.reshape(1).to(torch.float32)
    terms = val is not None
    _grpo_out(val.contiguous() if terms else None, aux.contiguous() if terms else None, labels, norm, loss, met, w,
              p.aggregation, 0.0 if p.normalizer is None else float(p.normalizer),
              p.max_completion_length or 0, p.ignore_index)
    return loss, met, w


FINALIZE = {"dpo": dpo_finalize, "kto": kto_finalize, "grpo": grpo_finalize}


@custom_op("seq_finalize_out", mutates_args=("s", "pol", "n", "met"))
def _seq_out(val: Tensor, aux: Tensor, labels: Tensor, tw: Optional[Tensor], s: Tensor, pol: Tensor, n: Tensor,
             met: Tensor, ignore_index: int) -> None:
    B, T = labels.shape
    # 256-element tiles: at 512, triton 3.6 spilled 12 bytes for sm_90 with a labels[:, 1:] view
    bb, bt, warps = tiles(val, 64, rows=B)
    with device_guard(val):
        launcher(_seq_finalize_kernel, val)[(1,)](
            # data (absent token weights point at val: no new variant)
            val_ptr=val, aux_ptr=aux, y_ptr=labels, tw_ptr=val if tw is None else tw, s_ptr=s, pol_ptr=pol,
            n_ptr=n, met_ptr=met,
            # strides
            y_sb=labels.stride(0), y_st=labels.stride(1),
            # sizes and scalars
            B=B, T=T, N=aux.stride(0), ignore_index=ignore_index, has_tw=int(tw is not None),
            # constants
            BLOCK_B=bb, BLOCK_T=bt, num_warps=warps)


def seq_finalize(val, aux, labels, p, token_weights=None):
    """``(s [B], policy_sums [B], counts [B], metrics [3])`` of the sequence-level primitive from the row kernel's
    ``val``/``aux`` (see the kernel); ``token_weights [B, T]`` weigh each token's clipped log-ratio in ``s``."""
    B = labels.shape[0]
    f32 = dict(dtype=torch.float32, device=val.device)
    s, pol, n = (torch.empty((B,), **f32) for _ in range(3))
    met = torch.empty((N_METRICS["sequence"],), **f32)
    tw = None if token_weights is None else token_weights.to(torch.float32).contiguous()
    _seq_out(val.contiguous(), aux.contiguous(), labels, tw, s, pol, n, met, p.ignore_index)
    return s, pol, n, met
