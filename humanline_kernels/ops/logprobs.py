r"""Triton kernels for selected-token log-probs: online softmax forward, recomputing backward.

One program per row ``r`` of a canonical view ``logits [B, T, V]`` (row ``r -> (b, t) = (r // T, r % T)``, any
batch/row strides, last stride 1, int64 offsets so ``N * V`` may pass 2^31). With ``z = logits / T_temp``:

* forward: one sweep over ``V`` in fp32 blocks keeps a running max ``m`` and sum ``d = sum exp(z - m)``
  (and ``s = sum exp(z - m) z`` for the entropy); ``lse = m + log d``, ``logp = z_y - lse``,
  ``entropy = lse - s / d``. Only ``lse`` (4 bytes a row) is kept for the backward.
* backward: ``dz = g * (onehot(y) - exp(z - lse)) / T_temp``, written in the logits' dtype into ``out``
  (which may be the logits' own storage: each block is read before it is overwritten by the same program).

Ignored rows (``y == ignore_index``) get ``logp = entropy = 0`` and an all-zero gradient row.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ._jit import COMPILED_DEVICES, jit, launcher


def block_config(x: torch.Tensor) -> tuple[int, int]:
    """``(BLOCK_V, num_warps)`` for the rows of ``x [..., V]``: 8 KiB blocks on GPU (4096 bf16/fp16 or 2048 fp32
    elements, two or four 16-byte loads a thread at 8 warps: 4096 fp32 made the entropy variant spill with
    triton 3.6), small ones in the interpreter."""
    V = x.shape[-1]
    if x.device.type in COMPILED_DEVICES:
        return min(triton.next_power_of_2(V), 8192 // x.element_size()), 8
    return min(triton.next_power_of_2(V), 128), 1


def device_guard(t: torch.Tensor):
    """Launch on ``t``'s GPU even when another one is current."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@jit
def _row_base(ptr, r, T, s_b, s_t):
    """Pointer to row ``r`` of a ``[B, T, ...]`` view with strides ``(s_b, s_t)``, in int64."""
    r64 = r.to(tl.int64)
    return ptr + (r64 // T) * s_b + (r64 % T) * s_t


@jit
def _row_stats(base, V, inv_t, BLOCK_V: tl.constexpr, ENTROPY: tl.constexpr):
    """Online softmax over one row: ``(lse, sum p*z)`` of ``z = x * inv_t`` (second is 0 without ENTROPY)."""
    cols = tl.arange(0, BLOCK_V)
    m = -float("inf")
    d = 0.0
    s = 0.0
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        z = tl.load(base + c, mask=c < V, other=-float("inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(z, 0))
        # a row (or prefix) of -inf keeps m == -inf: shift by 0 instead so exp() gives 0, not NaN
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        e = tl.exp(z - m_safe)
        d = d * alpha + tl.sum(e, 0)
        if ENTROPY:
            s = s * alpha + tl.sum(e * tl.where(e > 0, z, 0.0), 0)  # 0 * -inf would be NaN
        m = m_new
    lse = m + tl.log(d)
    return lse, s / d


@jit
def _row_grad_store(base, out_base, V, y, lse, g, inv_t, BLOCK_V: tl.constexpr):
    """Write ``g * (onehot(y) - exp(z - lse)) * inv_t`` for one row into ``out_base`` (may equal ``base``)."""
    cols = tl.arange(0, BLOCK_V)
    gs = g * inv_t
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        z = tl.load(base + c, mask=c < V, other=0.0).to(tl.float32) * inv_t
        p = tl.exp(z - lse)
        dz = gs * (tl.where(c == y, 1.0, 0.0) - p)
        tl.store(out_base + c, dz.to(out_base.dtype.element_ty), mask=c < V)


@jit
def _row_zero(out_base, V, BLOCK_V: tl.constexpr):
    cols = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        tl.store(out_base + c, tl.zeros([BLOCK_V], dtype=out_base.dtype.element_ty), mask=c < V)


@jit
def _token(r, n0, off0, off1):
    """Token ``q`` (int64) of the ``[B, T]`` inputs and outputs for row ``r`` of the logits: ``r + off0`` for the
    first ``n0`` rows, ``r + off1`` after them. The logits-level ops pass ``(N, 0, 0)`` (``q = r``); a fused-linear
    chunk (logits in a buffer of its own) passes its token ranges, at most two (a DPO chunk: chosen rows, then
    their rejected partners)."""
    r64 = r.to(tl.int64)
    return r64 + tl.where(r64 < n0, off0, off1)


@jit
def _row_logp(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, r, q, T, V, inv_t, ignore_index, BLOCK_V: tl.constexpr,
              ENTROPY: tl.constexpr):
    """Logits row ``r`` (label of token ``q``): ``(row pointer, label, valid, lse, sum p*z, logp)``;
    ``logp = z_y - lse``, 0 where ignored."""
    base = _row_base(x_ptr, r, T, x_sb, x_st)
    y = tl.load(_row_base(y_ptr, q, T, y_sb, y_st))
    valid = y != ignore_index
    lse, pz = _row_stats(base, V, inv_t, BLOCK_V, ENTROPY)
    zy = tl.load(base + tl.where(valid, y, 0)).to(tl.float32) * inv_t
    return base, y, valid, lse, pz, tl.where(valid, zy - lse, 0.0)


@jit
def _logprobs_fwd_kernel(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, logp_ptr, lse_ptr, ent_ptr, T, V, inv_t,
                         ignore_index, BLOCK_V: tl.constexpr, ENTROPY: tl.constexpr):
    r = tl.program_id(0)
    _base, _y, valid, lse, pz, logp = _row_logp(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, r, r, T, V, inv_t,
                                                ignore_index, BLOCK_V, ENTROPY)
    tl.store(logp_ptr + r, logp)
    tl.store(lse_ptr + r, lse)
    if ENTROPY:
        tl.store(ent_ptr + r, tl.where(valid, lse - pz, 0.0))


@jit(do_not_specialize=["n0", "off0", "off1"])
def _logprobs_bwd_kernel(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, lse_ptr, g_ptr, w_ptr, go_ptr, o_ptr, o_sb, o_st, T,
                         V, inv_t, ignore_index, n0, off0, off1, has_go, BLOCK_V: tl.constexpr,
                         ROW_WEIGHT: tl.constexpr):
    """Logits row ``r``, token ``q`` (:func:`_token`): ``g = g[q]``, or with ``ROW_WEIGHT`` (the fused losses)
    ``g = go * w[b] * g[q]``: ``g[q]`` the token's ``coef``, ``w[b]`` its row's ``d loss / d val`` and ``go`` the
    loss's upstream gradient (1 when ``has_go == 0``), all read on the device (the loss backward is this one
    launch)."""
    r = tl.program_id(0)
    q = _token(r, n0, off0, off1)
    base = _row_base(x_ptr, r, T, x_sb, x_st)
    out_base = _row_base(o_ptr, r, T, o_sb, o_st)
    y = tl.load(_row_base(y_ptr, q, T, y_sb, y_st))
    if y != ignore_index:
        g = tl.load(g_ptr + q).to(tl.float32)
        if ROW_WEIGHT:
            g = g * tl.load(w_ptr + q // T)
            if has_go != 0:
                g = g * tl.load(go_ptr).to(tl.float32)
        _row_grad_store(base, out_base, V, y, tl.load(lse_ptr + q), g, inv_t, BLOCK_V)
    else:
        _row_zero(out_base, V, BLOCK_V)


@jit
def _scale_rows_kernel(x_ptr, x_sb, x_st, s_ptr, T, V, BLOCK_V: tl.constexpr):
    """``x *= s`` in place, skipped on the device when ``s == 1`` (no host sync to find out)."""
    s = tl.load(s_ptr).to(tl.float32)
    if s != 1.0:
        base = _row_base(x_ptr, tl.program_id(0), T, x_sb, x_st)
        cols = tl.arange(0, BLOCK_V)
        for v0 in range(0, V, BLOCK_V):
            c = v0 + cols
            x = tl.load(base + c, mask=c < V, other=0.0).to(tl.float32)
            tl.store(base + c, (x * s).to(base.dtype.element_ty), mask=c < V)


def logprobs_fwd(logits, labels, temperature, ignore_index, return_entropy):
    """Triton version of :func:`humanline_kernels.ops.eager.logprobs_fwd` (same signature and results)."""
    B, T, V = logits.shape
    logp = torch.empty((B, T), dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(logp)
    ent = torch.empty_like(logp) if return_entropy else None
    if B * T == 0:
        return logp, lse, ent
    block, warps = block_config(logits)
    with device_guard(logits):
        launcher(_logprobs_fwd_kernel, logits)[(B * T,)](
            logits, logits.stride(0), logits.stride(1), labels, labels.stride(0), labels.stride(1), logp, lse,
            logp if ent is None else ent, T, V, 1.0 / temperature, ignore_index, BLOCK_V=block,
            ENTROPY=bool(return_entropy), num_warps=warps)
    return logp, lse, ent


def chunk_rows(segs):
    """``(n, n0, off0, off1)`` for :func:`_token` from a fused-linear chunk's token ranges ``((s0, e0), [(s1, e1)])``:
    the chunk's ``n`` logits rows are the tokens ``s0..e0`` followed by ``s1..e1``."""
    (s0, e0), *rest = segs
    n0 = e0 - s0
    if not rest:
        return n0, n0, s0, s0
    (s1, e1), = rest
    return n0 + e1 - s1, n0, s0, s1 - n0


def row_args(logits, labels, segs):
    """Launch geometry shared by the row kernels: ``(grid, T, V, x_sb, x_st, n0, off0, off1)``.

    Without ``segs``, ``logits [B, T, V]`` and ``labels [B, T]`` match row for row. With ``segs``, ``logits`` is a
    fused-linear chunk's ``[n, V]`` buffer (rows ``stride(0)`` apart) and ``labels`` (and every other ``[B, T]``
    tensor) is the whole batch's: row ``r`` of the buffer is token :func:`_token` ``(r, n0, off0, off1)``; the
    buffer's row ``r`` is addressed as ``(r // T) * (T * stride) + (r % T) * stride`` by the same code."""
    T, V = labels.shape[1], logits.shape[-1]
    n, n0, off0, off1 = (labels.numel(), labels.numel(), 0, 0) if segs is None else chunk_rows(segs)
    return (n, T, V, *row_strides(logits, T, segs), n0, off0, off1)


def row_strides(x, T, segs):
    """``(s_b, s_t)`` with which :func:`_row_base` finds row ``r`` of ``x``: its own batch and row strides, or for a
    chunk's ``[n, V]`` buffer (``segs``) ``(T * stride, stride)``, i.e. ``r * stride`` for any ``T``."""
    return (x.stride(0), x.stride(1)) if segs is None else (T * x.stride(0), x.stride(0))


def logprobs_bwd(logits, labels, lse, grad_logp, temperature, ignore_index, out=None, row_weight=None,
                 grad_loss=None, segs=None):
    """Triton version of :func:`humanline_kernels.ops.eager.logprobs_bwd`; ``out`` may be ``logits`` itself.
    With ``row_weight [B]`` the per-token gradient is ``row_weight[b] * grad_logp[b, t]``, times ``grad_loss``
    (0-d) when given. ``segs``: ``logits`` and ``out`` are a fused-linear chunk's ``[n, V]`` buffer, the other
    tensors the whole batch's (see :func:`row_args`)."""
    grid, T, V, x_sb, x_st, n0, off0, off1 = row_args(logits, labels, segs)
    if out is None:
        out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if grid == 0:
        return out
    block, warps = block_config(logits)
    g = grad_logp.reshape(labels.shape).contiguous()
    weighted = row_weight is not None
    w = row_weight.contiguous() if weighted else g
    go = grad_loss.reshape(1) if grad_loss is not None else g
    with device_guard(logits):
        launcher(_logprobs_bwd_kernel, logits)[(grid,)](
            logits, x_sb, x_st, labels, labels.stride(0), labels.stride(1), lse.contiguous(), g, w, go, out,
            *row_strides(out, T, segs), T, V, 1.0 / temperature, ignore_index, n0, off0, off1,
            int(grad_loss is not None), BLOCK_V=block, ROW_WEIGHT=weighted, num_warps=warps)
    return out


def scale_rows_(x, scale):
    """``x [B, T, V] *= scale`` (0-d tensor) in place; a no-op on the device when ``scale == 1``."""
    B, T, V = x.shape
    if B * T == 0:
        return x
    block, warps = block_config(x)
    with device_guard(x):
        launcher(_scale_rows_kernel, x)[(B * T,)](x, x.stride(0), x.stride(1), scale.reshape(1), T, V,
                                                  BLOCK_V=block, num_warps=warps)
    return x
