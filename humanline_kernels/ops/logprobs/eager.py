r"""Chunked eager log-prob forward/backward: the eager twin of :mod:`.kernel` (same signatures), the CPU path.

Forward, per row with logits ``z`` and label ``y``: ``lse = logsumexp(z / T)``, ``logp = z_y / T - lse`` and
optionally ``entropy = -sum(q log q)`` with ``q = softmax(z / T)``. Backward:
``dz = g * (onehot(y) - softmax(z / T)) / T``.
Rows are processed in chunks so no fp32 copy of the whole logits tensor is ever built (at most ``chunk_bytes``).

Inputs are canonical 3-D views ``logits [B, T, V]`` (any batch/row strides, last stride 1), ``labels [B, T]``.
"""
from __future__ import annotations

import torch

CHUNK_BYTES = 64 << 20


def _chunks(B, T, V, chunk_bytes):
    """Yield ``(b0, b1, t0, t1)`` blocks of at most ``chunk_bytes`` fp32 logits (at least one row)."""
    rows = max(1, chunk_bytes // (4 * V))
    if rows >= T:
        nb = max(1, rows // max(T, 1))
        for b0 in range(0, B, nb):
            yield b0, min(B, b0 + nb), 0, T
    else:
        for b in range(B):
            for t0 in range(0, T, rows):
                yield b, b + 1, t0, min(T, t0 + rows)


def _acc_dtype(logits):
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def logprobs_fwd(logits, labels, temperature, ignore_index, return_entropy, out=None, segs=None,
                 chunk_bytes=CHUNK_BYTES):
    """Return ``(logp [B, T], lse [B, T], entropy [B, T] or None)`` in fp32 (fp64 for fp64 logits); into ``out``
    when given. ``segs``: ``logits`` is a fused-linear chunk's ``[n, V]`` buffer, ``labels`` and ``out`` the whole
    batch's."""
    if segs is not None:
        idx = chunk_tokens(segs, logits.device)
        n, V = logits.shape
        if out is None:  # (zeros: the positions no row maps to)
            z = dict(dtype=_acc_dtype(logits), device=logits.device)
            out = (torch.zeros(labels.shape, **z), torch.zeros(labels.shape, **z),
                   torch.zeros(labels.shape, **z) if return_entropy else None)
        res = logprobs_fwd(logits.view(1, n, V), labels.reshape(-1)[idx].view(1, n), temperature, ignore_index,
                           return_entropy)
        for dst, src in zip(out, res):
            if dst is not None:
                dst.view(-1)[idx] = src.view(-1)
        return out
    B, T, V = logits.shape
    dt = _acc_dtype(logits)
    logp = torch.zeros(B, T, dtype=dt, device=logits.device)
    lse = torch.zeros(B, T, dtype=dt, device=logits.device)
    ent = torch.zeros(B, T, dtype=dt, device=logits.device) if return_entropy else None
    for b0, b1, t0, t1 in _chunks(B, T, V, chunk_bytes):
        z = logits[b0:b1, t0:t1].to(dt) / temperature
        lab = labels[b0:b1, t0:t1]
        valid = lab != ignore_index
        c_lse = torch.logsumexp(z, dim=-1)
        at, inside = _label_index(lab, valid, V)
        zy = z.gather(-1, at.unsqueeze(-1)).squeeze(-1)
        logp[b0:b1, t0:t1] = torch.where(valid, torch.where(inside, zy - c_lse, float("nan")), 0.0)
        lse[b0:b1, t0:t1] = c_lse
        if ent is not None:
            logq = z - c_lse.unsqueeze(-1)
            # -sum(p log p) rather than lse - sum(p z): no cancellation; p == 0 (z == -inf) adds 0, not NaN
            h = -torch.where(logq > -float("inf"), torch.exp(logq) * logq, 0.0).sum(-1)
            ent[b0:b1, t0:t1] = torch.where(valid, h, 0.0)
    if out is not None:
        for dst, src in zip(out, (logp, lse, ent)):
            if dst is not None:
                dst.copy_(src)
        return out
    return logp, lse, ent


def _label_index(lab, valid, V):
    """``(index, inside)``: where a label is read. A label outside ``[0, V)`` (a ``validate=False`` call) is not:
    index 0, and its log-prob is NaN, as in the kernels (docs/design.md). On CUDA an out-of-range ``gather`` is a
    device-side assert that ends the context (fp64 CUDA logits take this path)."""
    inside = valid & (lab >= 0) & (lab < V)
    return torch.where(inside, lab, 0), inside


def logprobs_bwd(logits, labels, lse, grad_logp, temperature, ignore_index, out=None, row_weight=None,
                 grad_loss=None, segs=None, row_add=None, grad_entropy=None, entropy=None, chunk_bytes=CHUNK_BYTES):
    """Return ``dlogits`` (dtype of ``logits``); written into ``out`` when given (``out`` may be ``logits``). With
    ``row_weight [B]`` the per-token gradient is ``row_weight[b] * grad_logp[b, t] (+ row_add[b])``, times
    ``grad_loss`` (0-d). ``grad_entropy`` (with the forward's ``entropy``) adds ``-grad_entropy p (log p + H) / T``.
    ``segs``: ``logits`` and ``out`` are a fused-linear chunk's ``[n, V]`` buffer (:func:`chunk_logprobs_bwd`)."""
    if segs is not None:
        return chunk_logprobs_bwd(logits, labels, lse, grad_logp, temperature, ignore_index, out, row_weight,
                                  grad_loss, segs, row_add, grad_entropy, entropy)
    B, T, V = logits.shape
    dt = _acc_dtype(logits)
    if row_weight is not None:
        grad_logp = grad_logp * row_weight.to(grad_logp.dtype).unsqueeze(1)
    if row_add is not None:  # (a masked token's gradient is 0 below whatever it is here)
        grad_logp = grad_logp + row_add.to(grad_logp.dtype).unsqueeze(1)
    if grad_loss is not None:
        grad_logp = grad_logp * grad_loss.to(grad_logp.dtype)
    if out is None:
        out = torch.empty((B, T, V), dtype=logits.dtype, device=logits.device)
    for b0, b1, t0, t1 in _chunks(B, T, V, chunk_bytes):
        lab = labels[b0:b1, t0:t1]
        valid = lab != ignore_index
        g = torch.where(valid, grad_logp[b0:b1, t0:t1].to(dt), 0.0)
        # log p in place of the upcast logits, p, then d in place of p: two chunk-sized temporaries (three with the
        # entropy's gradient), as tests/test_fused_linear_memory.py checks
        logq = (logits[b0:b1, t0:t1].to(dt) / temperature).sub_(lse[b0:b1, t0:t1].unsqueeze(-1).to(dt))
        p = torch.exp(logq)
        if grad_entropy is None:
            del logq
            d = p.mul_((-g).unsqueeze(-1))
        else:
            d = p * (-g).unsqueeze(-1)
        at, inside = _label_index(lab, valid, V)
        d.scatter_add_(-1, at.unsqueeze(-1), torch.where(inside, g, 0.0).unsqueeze(-1))
        if grad_entropy is not None:  # dH/dz = -p (log p + H); p == 0 (z == -inf) adds 0, not NaN
            gh = torch.where(valid, grad_entropy[b0:b1, t0:t1].to(dt), 0.0).unsqueeze(-1)
            h = entropy[b0:b1, t0:t1].to(dt).unsqueeze(-1)
            d = d.sub_(gh * p * (torch.where(p > 0, logq, 0.0) + h))
        out[b0:b1, t0:t1] = d.div_(temperature)
    return out


def chunk_tokens(segs, device):
    """Flat token indices of a fused-linear chunk's ``[n, V]`` buffer's rows: its token ranges ``((s0, e0), ...)``,
    or a token map (an int64 tensor, returned as it is)."""
    if isinstance(segs, torch.Tensor):
        return segs
    return torch.cat([torch.arange(s, e, device=device) for s, e in segs])


def chunk_logprobs_bwd(logits, labels, lse, grad_logp, temperature, ignore_index, out, row_weight, grad_loss, segs,
                       row_add=None, grad_entropy=None, entropy=None):
    """:func:`logprobs_bwd` of a fused-linear chunk: ``logits``/``out`` its ``[n, V]`` buffer, the other tensors the
    whole batch's ``[B, T]`` (``row_weight [B]``)."""
    T = labels.shape[1]
    idx = chunk_tokens(segs, logits.device)
    g = grad_logp.reshape(-1)[idx]
    if row_weight is not None:
        g = g * row_weight.to(g.dtype)[idx // T]
    if row_add is not None:
        g = g + row_add.to(g.dtype)[idx // T]
    n, V = logits.shape

    def pick(t):
        return None if t is None else t.reshape(-1)[idx].view(1, n)
    logprobs_bwd(logits.view(1, n, V), pick(labels), pick(lse), g.view(1, n), temperature, ignore_index,
                 out=out.view(1, n, V), grad_loss=grad_loss, grad_entropy=pick(grad_entropy), entropy=pick(entropy))
    return out
