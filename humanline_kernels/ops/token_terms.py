r"""Triton kernel for the per-token humanline terms, computed in the same pass over the logits as the log-prob.

For each row ``r = (b, t)`` the kernel finds ``lse`` and ``l = z_y - lse`` (online softmax, see
:mod:`.logprobs`), then with ``m = [y != ignore_index]``, ``D = l - l_ref``, ``Dh = clamp(D, p, r)`` (or ``D``):

* ``MODE == 1`` (DPO/KTO): ``val = m * Dh``, ``coef = d val / d l = m * [p <= D <= r]``;
* ``MODE == 2`` (GRPO): ``rho = exp(Dh)``, ``u = -min(A rho, A clamp(rho, 1 - e_lo, 1 + e_hi))`` (``A`` the row's
  advantage, or the token's: advantages ``[B]`` are read with a zero token stride, ``[B, T]`` with their own),
  ``k3 = exp(x) - x - 1`` with ``x = l_kl - l``; ``val = m (u + beta k3)`` and
  ``coef = m (-A rho [A rho <= A clamp(rho)] [p <= D <= r] + beta (1 - exp(x)))``: both clamps pass the
  gradient at their bounds, as the eager paths' :func:`humanline_kernels._clip.clamp_band` does.

``aux [4, N]`` fp32 (planes ``N`` apart; ``[5, N]`` for GRPO) holds ``[p < D < r]``, then for GRPO the low/high
clip indicators, ``k3`` (metrics only) and the log-prob ``m * l``, for ``MODE == 1`` the masked log-prob ``m * l``
and two zero planes (the log-prob: what the other ``[B, T]`` inputs' gradients are taken at,
:func:`humanline_kernels.losses.input_grads`).
With ``GRAD`` (GRPO) the same program also writes ``dz = w_b * coef * (onehot(y) - softmax(z)) / T`` into
``grad``, where ``w_b = d loss / d val`` is the aggregation weight of row ``b``: the row is read once for the
softmax statistics and once more while the gradient is written (on chip only while the rows in flight fit: with a
program a row and a large vocabulary that read mostly goes to HBM; the persistent grid of
:mod:`.grpo` keeps it in L1/L2, see docs/kernels.md).

The launcher is the ``torch.library`` op ``humanline::token_terms_out`` (``humanline::token_terms_inplace`` when the
gradient overwrites the logits); :func:`token_terms` allocates its outputs and calls it.
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
    chunk_rows,
    device_guard,
    grad_row,
    logits_rows,
    register_budget,
    row_terms,
    sweep_config,
)
from .constants import AUX_PLANES, Terms


# ------------------------------------------------------------------ kernel
@jit(do_not_specialize=["N", "Q", "n0", "off0", "off1", "adv_sb", "adv_st"])
def _token_terms_kernel(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, ref_ptr, klref_ptr, adv_ptr, adv_sb, adv_st, w_ptr, g_ptr,
                        g_sb, g_st, val_ptr, coef_ptr, lse_ptr, aux_ptr, tok_ptr, N, Q, T, V, inv_temperature,
                        ignore_index, log_eps_p, log_eps_r, ratio_low, ratio_high, beta, n0, off0, off1,
                        BLOCK_V: tl.constexpr, MODE: tl.constexpr, CLIP: tl.constexpr, HAS_KL_REF: tl.constexpr,
                        GRAD: tl.constexpr, TOKEN_MAP: tl.constexpr):
    r = tl.program_id(0)  # row of the logits and of the gradient output
    base, q, y, valid, lse, coef = row_terms(
        x_ptr=x_ptr, x_sb=x_sb, x_st=x_st, y_ptr=y_ptr, y_sb=y_sb, y_st=y_st, ref_ptr=ref_ptr,
        klref_ptr=klref_ptr, adv_ptr=adv_ptr, adv_sb=adv_sb, adv_st=adv_st, val_ptr=val_ptr, coef_ptr=coef_ptr,
        lse_ptr=lse_ptr, aux_ptr=aux_ptr, tok_ptr=tok_ptr, r=r, N=N, Q=Q, T=T, V=V, inv_temperature=inv_temperature,
        ignore_index=ignore_index, log_eps_p=log_eps_p, log_eps_r=log_eps_r, ratio_low=ratio_low, ratio_high=ratio_high,
        beta=beta, n0=n0, off0=off0, off1=off1, BLOCK_V=BLOCK_V, MODE=MODE, CLIP=CLIP, HAS_KL_REF=HAS_KL_REF,
        TOKEN_MAP=TOKEN_MAP, EVICT_LAST=False)
    if GRAD:
        grad_row(
            base=base, g_ptr=g_ptr, g_sb=g_sb, g_st=g_st, w_ptr=w_ptr, r=r, q=q, T=T, V=V, y=y, valid=valid,
            lse=lse, g=coef, inv_temperature=inv_temperature, BLOCK_V=BLOCK_V, STREAM=False, ROW_WEIGHT=True)


# ------------------------------------------------------------------ launcher (torch.library ops) and its caller
def _token_terms_launch(logits: Tensor, labels: Tensor, ref: Tensor, kl_ref: Optional[Tensor],
                        advantages: Optional[Tensor], row_weight: Optional[Tensor], grad: Optional[Tensor],
                        grad_inplace: bool, val: Tensor, coef: Tensor, lse: Tensor, aux: Tensor, terms: int,
                        clip: bool, log_eps_p: float, log_eps_r: float, ratio_low: float, ratio_high: float,
                        beta: float, inv_temperature: float, ignore_index: int, n0: int, off0: int, off1: int,
                        tok: Optional[Tensor]) -> None:
    # (no argument may be called "mode": the dispatcher's mode redirection takes that keyword)
    T = labels.shape[1]
    rows, x_sb, x_st = logits_rows(logits, T)
    if rows == 0:
        return
    g = logits if grad_inplace or grad is None else grad
    _, g_sb, g_st = logits_rows(g, T)
    grpo = terms == Terms.GRPO
    block, warps = sweep_config(logits, family="terms")
    with device_guard(logits):
        launcher(_token_terms_kernel, logits)[(rows,)](
            # data (unused pointers get ref: no variant of their own)
            x_ptr=logits, y_ptr=labels, ref_ptr=ref, klref_ptr=ref if kl_ref is None else kl_ref,
            adv_ptr=advantages if grpo else ref, w_ptr=ref if row_weight is None else row_weight, g_ptr=g,
            val_ptr=val, coef_ptr=coef, lse_ptr=lse, aux_ptr=aux, tok_ptr=labels if tok is None else tok,
            # shapes and the rows' tokens (a chunk's ranges or a token map)
            N=aux.stride(0), Q=labels.numel(), T=T, V=logits.shape[-1], n0=n0, off0=off0, off1=off1,
            # strides (advantages [B] have a zero token stride)
            x_sb=x_sb, x_st=x_st, y_sb=labels.stride(0), y_st=labels.stride(1),
            adv_sb=advantages.stride(0) if grpo else 0,
            adv_st=advantages.stride(1) if grpo and advantages.dim() == 2 else 0, g_sb=g_sb, g_st=g_st,
            # the loss's options
            log_eps_p=log_eps_p, log_eps_r=log_eps_r, ratio_low=ratio_low, ratio_high=ratio_high, beta=beta,
            inv_temperature=inv_temperature, ignore_index=ignore_index,
            # constants
            BLOCK_V=block, MODE=int(terms), CLIP=clip, HAS_KL_REF=kl_ref is not None,
            GRAD=grad_inplace or grad is not None, TOKEN_MAP=tok is not None, num_warps=warps,
            **register_budget(logits, warps))


# one launcher, two ops: the gradient into a buffer of its own or over the logits (a mutated argument of an op may
# not alias another of its arguments, so the in-place op mutates the logits and gets grad=None)
_token_terms_out = custom_op("token_terms_out", mutates_args=("grad", "val", "coef", "lse", "aux"))(
    _token_terms_launch)
_token_terms_inplace = custom_op("token_terms_inplace", mutates_args=("logits", "val", "coef", "lse", "aux"),
                                 bumps=("logits",))(_token_terms_launch)


def token_terms(logits, labels, ref_logps, p, inp=None, *, out=None, segs=None, row_weight=None, grad_out=None):
    """``(val, coef, lse, aux)`` of ``logits [B, T, V]`` for the loss ``p`` (a params object of
    :mod:`humanline_kernels._params`: its ``mode``, ``clip`` band, ``temperature``, ``ignore_index`` and for GRPO
    ``epsilon_low`` / ``epsilon_high`` and ``beta``) and, for GRPO, ``inp.advantages`` (``[B]`` or ``[B, T]``) and
    ``inp.kl_ref_logps``: fp32 ``[B, T]`` x3 and ``aux [AUX_PLANES, B, T]`` (4 planes, GRPO 5).

    With ``row_weight [B]`` and ``grad_out`` (a buffer shaped like ``logits``, or ``logits`` itself: in place,
    its version counter bumped) the GRPO gradient is written too. ``out``: the four outputs to write into
    (``val``, ``coef``, ``lse`` contiguous ``[B, T]``, ``aux`` ``[AUX_PLANES, B, T]`` with any plane stride).
    ``segs``: a fused-linear chunk's token ranges (:func:`.common.chunk_rows`); ``logits`` and
    ``grad_out`` are then the chunk's ``[n, V]`` buffer, every other tensor the whole batch's, and ``out`` is
    required.
    """
    B, T = labels.shape
    if out is None:
        f32 = dict(dtype=torch.float32, device=logits.device)
        # every plane is written by the kernel, except under a token map (a packed batch) the padding positions,
        # whose labels are ignore_index: the finalize and backward kernels never read them
        val, coef, lse = (torch.empty((B, T), **f32) for _ in range(3))
        out = val, coef, lse, torch.empty((AUX_PLANES[p.mode], B, T), **f32)
    val, coef, lse, aux = out
    grpo = p.mode == Terms.GRPO
    inplace = grad_out is not None and grad_out is logits
    n0, off0, off1, tok = chunk_rows(segs, B * T)
    (_token_terms_inplace if inplace else _token_terms_out)(
        # data
        logits=logits, labels=labels, ref=as_f32(ref_logps), kl_ref=as_f32(inp.kl_ref_logps) if grpo else None,
        advantages=inp.advantages.to(torch.float32) if grpo else None, row_weight=as_f32(row_weight),
        grad=None if inplace else grad_out, grad_inplace=inplace, val=val, coef=coef, lse=lse, aux=aux,
        # the loss's options (GRPO's ratio band and k3 weight unused by the clipped log-ratio)
        terms=int(p.mode), **band(p.clip), ratio_low=1.0 - float(p.epsilon_low) if grpo else 0.8,
        ratio_high=1.0 + float(p.epsilon_high) if grpo else 1.2, beta=float(p.beta) if grpo else 0.0,
        inv_temperature=1.0 / float(p.temperature), ignore_index=p.ignore_index,
        # the rows' tokens
        n0=n0, off0=off0, off1=off1, tok=tok)
    return out
