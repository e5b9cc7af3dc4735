r"""Selected-token log-probs: the online-softmax forward, the recomputing backward, and a row scale.

* forward (:func:`logprobs_fwd`): one sweep over ``V`` in fp32 blocks (:func:`.common.row_stats`; with the entropy
  also ``s = sum exp(z - m) z``), ``lse = m + log d``, ``logp = z_y - lse``, ``entropy = lse - s / d``. Only ``lse``
  (4 bytes a row) is kept for the backward.
* backward (:func:`logprobs_bwd`): ``dz = g * (onehot(y) - exp(z - lse)) / T_temp``, written in the logits' dtype
  into ``out`` (which may be the logits' own storage: each block is read before it is overwritten by the same
  program); with a row weight, the fused losses' one-launch backward.
* :func:`scale_rows_` / :func:`scaled`: a tensor times a 0-d scale read on the device (the gradient formed in the
  forward times ``grad_output``; fused linear's ``dW``).

Ignored rows (``y == ignore_index``) get ``logp = entropy = 0`` and an all-zero gradient row. Each launcher is a
``torch.library`` op (namespace ``humanline``) writing into preallocated outputs.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton.language as tl
from torch import Tensor

from ._jit import custom_op, jit, launcher
from .common import (
    block_config,
    chunk_rows,
    device_guard,
    logits_rows,
    row_base,
    row_grad_store,
    row_logp,
    row_token,
    row_zero,
    split_token,
    sweep_config,
)


# ------------------------------------------------------------------ kernels
@jit
def _row_grad_store_entropy(base, out_base, V, y, lse, g, gh, h, inv_temperature, BLOCK_V: tl.constexpr):
    """:func:`row_grad_store` plus the entropy's gradient: ``(g (onehot(y) - p) - gh p (log p + h)) * inv_temperature``
    with ``h`` the row's entropy and ``gh`` its upstream gradient (``dH/dz = -p (log p + H)``; 0 where ``p`` is 0)."""
    cols = tl.arange(0, BLOCK_V)
    gs = g * inv_temperature
    ghs = gh * inv_temperature
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        z = tl.load(base + c, mask=c < V, other=0.0).to(tl.float32) * inv_temperature
        logp = z - lse
        p = tl.exp(logp)
        # p == 0 (z == -inf) adds 0: log p is replaced before the product, so no 0 * -inf is formed
        dz = gs * (tl.where(c == y, 1.0, 0.0) - p) - ghs * p * (tl.where(p > 0, logp, 0.0) + h)
        tl.store(out_base + c, dz.to(out_base.dtype.element_ty), mask=c < V)


@jit(do_not_specialize=["Q", "n0", "off0", "off1"])
def _logprobs_fwd_kernel(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, logp_ptr, lse_ptr, ent_ptr, tok_ptr, Q, T, V,
                         inv_temperature, ignore_index, n0, off0, off1, BLOCK_V: tl.constexpr, ENTROPY: tl.constexpr,
                         TOKEN_MAP: tl.constexpr):
    """Logits row ``r``, token ``q`` (:func:`row_token`): ``logp``, ``lse`` (and the entropy) of token ``q``."""
    r = tl.program_id(0)
    _base, q, _y, valid, lse, pz, logp = row_logp(
        x_ptr=x_ptr, x_sb=x_sb, x_st=x_st, y_ptr=y_ptr, y_sb=y_sb, y_st=y_st, r=r, n0=n0, off0=off0,
        off1=off1, tok_ptr=tok_ptr, Q=Q, T=T, V=V, inv_temperature=inv_temperature, ignore_index=ignore_index,
        BLOCK_V=BLOCK_V, ENTROPY=ENTROPY, TOKEN_MAP=TOKEN_MAP, EVICT_LAST=False)
    tl.store(logp_ptr + q, logp)
    tl.store(lse_ptr + q, lse)
    if ENTROPY:
        tl.store(ent_ptr + q, tl.where(valid, lse - pz, 0.0))


@jit(do_not_specialize=["Q", "n0", "off0", "off1"])
def _logprobs_bwd_kernel(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, lse_ptr, g_ptr, w_ptr, w2_ptr, go_ptr, gh_ptr, h_ptr,
                         o_ptr, o_sb, o_st, tok_ptr, Q, T, V, inv_temperature, ignore_index, n0, off0, off1, has_w2,
                         has_go, BLOCK_V: tl.constexpr, ROW_WEIGHT: tl.constexpr, ENTROPY: tl.constexpr,
                         TOKEN_MAP: tl.constexpr):
    """Logits row ``r``, token ``q`` (:func:`row_token`): ``g = g[q]``, or with ``ROW_WEIGHT`` (the fused losses and
    the sequence sums) ``g = go * (w[b] * g[q] + w2[b])``: ``g[q]`` the token's ``coef``, ``w[b]`` its row's
    ``d loss / d val``, ``w2[b]`` (when ``has_w2``) its row's ``d loss / d logp`` of a term in the plain log-probs
    (the policy sums), and ``go`` the loss's upstream gradient (1 when ``has_go == 0``), all read on the device
    (the backward is this one launch). With ``ENTROPY`` the token's entropy ``h[q]`` has the upstream gradient
    ``gh[q]`` too (a differentiable entropy: the entropy bonus of GRPO)."""
    r = tl.program_id(0)
    q = row_token(r, n0, off0, off1, tok_ptr, Q, TOKEN_MAP)
    base = row_base(x_ptr, r, T, x_sb, x_st)
    out_base = row_base(o_ptr, r, T, o_sb, o_st)
    y = tl.load(row_base(y_ptr, q, T, y_sb, y_st))
    if y != ignore_index:
        g = tl.load(g_ptr + q).to(tl.float32)
        if ROW_WEIGHT:
            b = split_token(q, T)[0]
            g = g * tl.load(w_ptr + b)
            if has_w2 != 0:
                g = g + tl.load(w2_ptr + b)
            if has_go != 0:
                g = g * tl.load(go_ptr).to(tl.float32)
        if ENTROPY:
            _row_grad_store_entropy(
                base=base, out_base=out_base, V=V, y=y, lse=tl.load(lse_ptr + q), g=g,
                gh=tl.load(gh_ptr + q), h=tl.load(h_ptr + q), inv_temperature=inv_temperature, BLOCK_V=BLOCK_V)
        else:
            row_grad_store(
                base=base, out_base=out_base, V=V, y=y, lse=tl.load(lse_ptr + q), g=g,
                inv_temperature=inv_temperature, BLOCK_V=BLOCK_V, STREAM=False)
    else:
        row_zero(out_base, V, BLOCK_V)


@jit
def _scale_row(src, dst, s, V, BLOCK_V: tl.constexpr):
    cols = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        x = tl.load(src + c, mask=c < V, other=0.0).to(tl.float32)
        tl.store(dst + c, (x * s).to(dst.dtype.element_ty), mask=c < V)


@jit
def _scale_rows_kernel(x_ptr, x_sb, x_st, s_ptr, out_ptr, o_sb, o_st, T, V, BLOCK_V: tl.constexpr,
                       OUT: tl.constexpr):
    """``x *= s`` in place, skipped on the device when ``s == 1`` (no host sync to find out); with ``OUT``,
    ``out = x * s`` in ``out``'s dtype, ``s == 1`` included."""
    s = tl.load(s_ptr).to(tl.float32)
    r = tl.program_id(0)
    if OUT:
        _scale_row(row_base(x_ptr, r, T, x_sb, x_st), row_base(out_ptr, r, T, o_sb, o_st), s, V, BLOCK_V)
    elif s != 1.0:
        base = row_base(x_ptr, r, T, x_sb, x_st)
        _scale_row(base, base, s, V, BLOCK_V)


# ------------------------------------------------------------------ launchers (torch.library ops) and their callers
@custom_op("logprobs_fwd_out", mutates_args=("logp", "lse", "ent"))
def _fwd_out(logits: Tensor, labels: Tensor, logp: Tensor, lse: Tensor, ent: Optional[Tensor], inv_temperature: float,
             ignore_index: int, n0: int, off0: int, off1: int, tok: Optional[Tensor]) -> None:
    T = labels.shape[1]
    rows, x_sb, x_st = logits_rows(logits, T)
    if rows == 0:
        return
    block, warps = sweep_config(logits)
    with device_guard(logits):
        launcher(_logprobs_fwd_kernel, logits)[(rows,)](
            # data
            x_ptr=logits, y_ptr=labels, logp_ptr=logp, lse_ptr=lse, ent_ptr=logp if ent is None else ent,
            tok_ptr=labels if tok is None else tok,
            # shapes and the rows' tokens (a chunk's ranges or a token map)
            Q=labels.numel(), T=T, V=logits.shape[-1], n0=n0, off0=off0, off1=off1,
            # strides
            x_sb=x_sb, x_st=x_st, y_sb=labels.stride(0), y_st=labels.stride(1),
            # options
            inv_temperature=inv_temperature, ignore_index=ignore_index,
            # constants
            BLOCK_V=block, ENTROPY=ent is not None, TOKEN_MAP=tok is not None, num_warps=warps)


def _like(t):
    return dict(dtype=t.dtype, device=t.device)


def logprobs_fwd(logits, labels, temperature, ignore_index, return_entropy, out=None, segs=None):
    """``(logp, lse, entropy or None)``, fp32 ``[B, T]``, of ``logits [B, T, V]`` (last stride 1) and
    ``labels [B, T]``; the Triton twin of :func:`humanline_kernels._eager.logprobs_fwd`. ``out``: the (two or
    three) contiguous outputs to write into. ``segs``: ``logits`` is a fused-linear chunk's ``[n, V]`` buffer and
    ``labels`` and ``out`` the whole batch's (:func:`.common.chunk_rows`); ``out`` is required then."""
    if out is None:
        B, T = labels.shape
        alloc = torch.zeros if isinstance(segs, Tensor) else torch.empty  # a token map may skip positions
        logp = alloc((B, T), dtype=torch.float32, device=logits.device)
        out = logp, alloc((B, T), **_like(logp)), alloc((B, T), **_like(logp)) if return_entropy else None
    logp, lse, ent = out
    n0, off0, off1, tok = chunk_rows(segs, labels.numel())
    _fwd_out(logits=logits, labels=labels, logp=logp, lse=lse, ent=ent, inv_temperature=1.0 / temperature,
             ignore_index=ignore_index, n0=n0, off0=off0, off1=off1, tok=tok)
    return logp, lse, ent


def _bwd_launch(logits: Tensor, labels: Tensor, lse: Tensor, g: Tensor, w: Optional[Tensor], w2: Optional[Tensor],
                go: Optional[Tensor], gh: Optional[Tensor], h: Optional[Tensor], out: Optional[Tensor],
                inv_temperature: float, ignore_index: int, n0: int, off0: int, off1: int,
                tok: Optional[Tensor]) -> None:
    out = logits if out is None else out  # None: in place
    T = labels.shape[1]
    rows, x_sb, x_st = logits_rows(logits, T)
    if rows == 0:
        return
    _, o_sb, o_st = logits_rows(out, T)
    block, warps = block_config(logits)
    with device_guard(logits):
        launcher(_logprobs_bwd_kernel, logits)[(rows,)](
            # data
            x_ptr=logits, y_ptr=labels, lse_ptr=lse, g_ptr=g, w_ptr=g if w is None else w,
            w2_ptr=g if w2 is None else w2, go_ptr=g if go is None else go, gh_ptr=g if gh is None else gh,
            h_ptr=g if h is None else h, o_ptr=out, tok_ptr=labels if tok is None else tok,
            # shapes and the rows' tokens (a chunk's ranges or a token map)
            Q=labels.numel(), T=T, V=logits.shape[-1], n0=n0, off0=off0, off1=off1,
            # strides
            x_sb=x_sb, x_st=x_st, y_sb=labels.stride(0), y_st=labels.stride(1), o_sb=o_sb, o_st=o_st,
            # options
            inv_temperature=inv_temperature, ignore_index=ignore_index, has_w2=int(w2 is not None),
            has_go=int(go is not None),
            # constants
            BLOCK_V=block, ROW_WEIGHT=w is not None, ENTROPY=gh is not None, TOKEN_MAP=tok is not None,
            num_warps=warps)


# one launcher, two ops: into a new buffer, or over the logits (out=None; a mutated argument of an op may not alias
# another of its arguments)
_bwd_out = custom_op("logprobs_bwd_out", mutates_args=("out",))(_bwd_launch)
_bwd_inplace = custom_op("logprobs_bwd_inplace", mutates_args=("logits",), bumps=("logits",))(_bwd_launch)


def logprobs_bwd(logits, labels, lse, grad_logp, temperature, ignore_index, out=None, row_weight=None,
                 grad_loss=None, segs=None, row_add=None, grad_entropy=None, entropy=None):
    """``dlogits = g * (onehot(y) - softmax(z / T)) / T`` in the logits' dtype, into ``out`` (new, or ``logits``
    itself: then in place, and the logits' version counter is bumped), the Triton twin of
    :func:`humanline_kernels._eager.logprobs_bwd`. ``g`` is ``grad_logp``, or with ``row_weight [B]`` (a fused
    loss's backward) ``grad_loss * (row_weight[b] * grad_logp[b, t] + row_add[b])`` (``grad_loss`` 0-d, read on the
    device; ``row_add [B]``, with ``row_weight`` only, the gradient of a term in the row's plain log-probs). ``segs``:
    ``logits`` and ``out`` are a fused-linear chunk's ``[n, V]`` buffer and the other tensors the whole batch's
    (:func:`.common.chunk_rows`). ``grad_entropy`` (with the forward's ``entropy``, both shaped like ``labels``)
    adds the entropy's gradient ``-grad_entropy * p (log p + H) / T``."""
    n0, off0, off1, tok = chunk_rows(segs, labels.numel())
    # the kernel reads g, lse (and w) at flat token indices, so any shape with the labels' count will do; autograd
    # may hand an expanded (stride 0) gradient, which contiguous() materialises
    g = grad_logp.contiguous()
    go = None if grad_loss is None else grad_loss.reshape(1)
    gh = h = None
    if grad_entropy is not None:
        gh = grad_entropy.reshape(labels.shape).to(torch.float32).contiguous()
        h = entropy.reshape(labels.shape).contiguous()
    inplace = out is logits
    if out is None:
        out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    (_bwd_inplace if inplace else _bwd_out)(
        logits=logits, labels=labels, lse=lse.contiguous(), g=g, w=row_weight, w2=row_add, go=go, gh=gh, h=h,
        out=None if inplace else out, inv_temperature=1.0 / temperature, ignore_index=ignore_index, n0=n0, off0=off0,
        off1=off1, tok=tok)
    return logits if inplace else out


@custom_op("scale_rows_out", mutates_args=("out",))
def _scale_rows_out(x: Tensor, scale: Tensor, out: Tensor) -> None:
    B, T, V = x.shape
    if B * T == 0:
        return
    block, warps = block_config(x if x.element_size() >= out.element_size() else out)  # the wider dtype's
    with device_guard(x):
        launcher(_scale_rows_kernel, x)[(B * T,)](
            # data (out is x: in place, through _scale_rows, skipped on the device when the scale is 1)
            x_ptr=x, s_ptr=scale, out_ptr=out,
            # shapes
            T=T, V=V,
            # strides
            x_sb=x.stride(0), x_st=x.stride(1), o_sb=out.stride(0), o_st=out.stride(1),
            # constants
            BLOCK_V=block, OUT=out is not x, num_warps=warps)


@custom_op("scale_rows_", mutates_args=("x",), bumps=("x",))
def _scale_rows(x: Tensor, scale: Tensor) -> None:
    _scale_rows_out.fn(x=x, scale=scale, out=x)


def scale_rows_(x, scale):
    """``x [B, T, V] *= scale`` (0-d tensor) in place; a no-op on the device when ``scale == 1``."""
    _scale_rows(x=x, scale=scale.reshape(1))
    return x


def scaled(x, scale, dtype):
    """``x * scale`` (``x`` contiguous, any shape; ``scale`` 0-d) as a new tensor of ``dtype``, in one pass: the
    fused-linear ``dW`` (fp32 accumulator -> weight dtype) times ``grad_output``. ``torch.mul(x, scale, out=)``
    with a 0-d CUDA ``scale`` and a dtype change takes TensorIterator's non-vectorised path, a fraction of the
    bandwidth."""
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    shape = (1, 1, -1) if x.dim() == 1 else (1, -1, x.shape[-1])
    _scale_rows_out(x=x.view(shape), scale=scale.reshape(1), out=out.view(shape))  # the kernel reads any float scale
    return out
