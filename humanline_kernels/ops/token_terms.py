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
from .common import as_f32, chunk_rows, device_guard, grad_row, logits_rows, register_budget, row_terms, sweep_config
from .constants import AUX_PLANES, MODE_GRPO


# ------------------------------------------------------------------ kernel
@jit(do_not_specialize=["N", "Q", "n0", "off0", "off1", "adv_sb", "adv_st"])
def _token_terms_kernel(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, ref_ptr, klref_ptr, adv_ptr, adv_sb, adv_st, w_ptr,
                        g_ptr, g_sb, g_st, val_ptr, coef_ptr, lse_ptr, aux_ptr, tok_ptr, N, Q, T, V, inv_t,
                        ignore_index, clip_lo, clip_hi, rho_lo, rho_hi, beta, n0, off0, off1, BLOCK_V: tl.constexpr,
                        MODE: tl.constexpr, CLIP: tl.constexpr, HAS_KL_REF: tl.constexpr, GRAD: tl.constexpr,
                        TOKEN_MAP: tl.constexpr):
    r = tl.program_id(0)  # row of the logits and of the gradient output
    base, q, y, valid, lse, coef = row_terms(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, ref_ptr, klref_ptr, adv_ptr, adv_sb,
                                          adv_st, val_ptr, coef_ptr, lse_ptr, aux_ptr, tok_ptr, r, N, Q, T, V, inv_t,
                                          ignore_index, clip_lo, clip_hi, rho_lo, rho_hi, beta, n0, off0, off1,
                                          BLOCK_V, MODE, CLIP, HAS_KL_REF, TOKEN_MAP, False)
    if GRAD:
        grad_row(base, g_ptr, g_sb, g_st, w_ptr, r, q, T, V, y, valid, lse, coef, inv_t, BLOCK_V, False, True)


# ------------------------------------------------------------------ launcher (torch.library ops) and its caller
def _terms_launch(logits: Tensor, labels: Tensor, ref: Tensor, klref: Optional[Tensor], adv: Optional[Tensor],
                  w: Optional[Tensor], grad: Optional[Tensor], grad_inplace: bool, val: Tensor, coef: Tensor,
                  lse: Tensor, aux: Tensor, row_mode: int, clip_on: bool, clip_lo: float, clip_hi: float,
                  rho_lo: float, rho_hi: float, beta: float, inv_t: float, ignore_index: int, n0: int, off0: int,
                  off1: int, tok: Optional[Tensor]) -> None:
    # (no argument may be called "mode": the dispatcher's mode redirection takes that keyword)
    T = labels.shape[1]
    rows, x_sb, x_st = logits_rows(logits, T)
    if rows == 0:
        return
    g = logits if grad_inplace or grad is None else grad
    _, g_sb, g_st = logits_rows(g, T)
    grpo = row_mode == MODE_GRPO
    block, warps = sweep_config(logits, family="terms")
    with device_guard(logits):
        launcher(_token_terms_kernel, logits)[(rows,)](
            # data (unused pointers get ref: no variant of their own)
            x_ptr=logits, y_ptr=labels, ref_ptr=ref, klref_ptr=ref if klref is None else klref,
            adv_ptr=adv if grpo else ref, w_ptr=ref if w is None else w, g_ptr=g,
            val_ptr=val, coef_ptr=coef, lse_ptr=lse, aux_ptr=aux, tok_ptr=labels if tok is None else tok,
            # strides (advantages [B] have a zero token stride)
            x_sb=x_sb, x_st=x_st, y_sb=labels.stride(0), y_st=labels.stride(1),
            adv_sb=adv.stride(0) if grpo else 0, adv_st=adv.stride(1) if grpo and adv.dim() == 2 else 0,
            g_sb=g_sb, g_st=g_st,
            # sizes, scalars and the chunk's token ranges or map
            N=aux.stride(0), Q=labels.numel(), T=T, V=logits.shape[-1], inv_t=inv_t, ignore_index=ignore_index,
            clip_lo=clip_lo, clip_hi=clip_hi, rho_lo=rho_lo, rho_hi=rho_hi, beta=beta, n0=n0, off0=off0, off1=off1,
            # constants
            BLOCK_V=block, MODE=row_mode, CLIP=clip_on, HAS_KL_REF=klref is not None,
            GRAD=grad_inplace or grad is not None, TOKEN_MAP=tok is not None, num_warps=warps,
            **register_budget(logits, warps))


# one launcher, two ops: the gradient into a buffer of its own or over the logits (a mutated argument of an op may
# not alias another of its arguments, so the in-place op mutates the logits and gets grad=None)
_terms_out = custom_op("token_terms_out", mutates_args=("grad", "val", "coef", "lse", "aux"))(_terms_launch)


_terms_inplace = custom_op("token_terms_inplace", mutates_args=("logits", "val", "coef", "lse", "aux"),
                           bumps=(0,))(_terms_launch)


def token_terms(logits, labels, ref_logps, p, inp=None, *, out=None, segs=None, row_weight=None, grad_out=None):
    """``(val, coef, lse, aux)`` of ``logits [B, T, V]`` for the loss ``p`` (a params object of
    :mod:`humanline_kernels._params`: its mode, clip band, GRPO band and k3 weight, temperature, ignore_index)
    and, for GRPO, ``inp.advantages`` (``[B]`` or ``[B, T]``) and ``inp.kl_ref_logps``: fp32 ``[B, T]`` x3 and
    ``aux [AUX_PLANES, B, T]`` (4 planes, GRPO 5).

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
    grpo = p.mode == MODE_GRPO
    klref = as_f32(inp.kl_ref_logps) if grpo else None
    adv = inp.advantages.to(torch.float32) if grpo else None
    inplace = grad_out is not None and grad_out is logits
    (_terms_inplace if inplace else _terms_out)(
        logits, labels, as_f32(ref_logps), klref, adv, as_f32(row_weight), None if inplace else grad_out, inplace, *out,
        *p.terms, *chunk_rows(segs, B * T))
    return out
