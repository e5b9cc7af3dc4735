r"""The sequence-level primitive's kernel: per-row sums of the clipped log-ratio (weighted per token, optionally) and of
the policy's log-probs, and the token counts, after the row kernel (:mod:`.token_terms`); the objectives built on
the sums (IPO, SimPO, SLiC, TRL's DPO loss types) are batch math above the kernels.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton.language as tl
from torch import Tensor

from ._jit import custom_op, jit, launcher
from .common import device_guard, frac, tile_mask, tile_offsets, tiles
from .constants import N_METRICS


# ------------------------------------------------------------------ kernel
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
            off, t = tile_offsets(b, T, t0, BLOCK_T)
            inb = bm[:, None] & (t < T)[None, :]
            m = tile_mask(y_ptr, y_sb, y_st, b, t, inb, ignore_index)
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
    tl.store(met_ptr, frac(n_in, n_tok))
    tl.store(met_ptr + 1, n_tok)
    tl.store(met_ptr + 2, n_in)


# ------------------------------------------------------------------ launcher (torch.library op) and its caller
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
            # shapes
            B=B, T=T, N=aux.stride(0),
            # strides
            y_sb=labels.stride(0), y_st=labels.stride(1),
            # options
            ignore_index=ignore_index, has_tw=int(tw is not None),
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
    _seq_out(val=val.contiguous(), aux=aux.contiguous(), labels=labels, tw=tw, s=s, pol=pol, n=n, met=met,
             ignore_index=p.ignore_index)
    return s, pol, n, met
