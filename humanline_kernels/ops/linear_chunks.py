r"""Chunked lm_head driver: log-probs (and, optionally, the gradient) from ``hidden [N, D]`` and ``weight [V, D]``.

A *chunk* is a tuple of flat token ranges ``((s0, e0), (s1, e1), ...)`` of ``hidden``; its ``n`` tokens go through

1. ``z = h_c W^T (+ b)`` into one reused buffer of ``max_rows * V`` elements (input dtype: bf16 in, fp32
   accumulation inside cuBLAS);
2. ``logp, lse = logprobs_fwd(z)`` (Triton on CUDA / ``TRITON_INTERPRET=1``, eager otherwise);
3. when a gradient is wanted: ``g = dL/dlogp`` for the chunk's tokens from ``coef(chunk, logp)``, then
   ``logprobs_bwd(..., out=z)`` overwrites the logits with ``dL/dz = g (onehot(y) - softmax(z/T)) / T``;
4. ``dh[c] = dz W``, ``dW += dz^T h_c`` (fp32 accumulator), ``db += sum_rows dz`` (fp32).

So the gradient costs two GEMMs per chunk and the logits GEMM is never recomputed: 6 N D V flops in all. At most
one chunk of logits exists at any time (the buffer), plus the transient upcasts inside the eager fallback.
"""
from __future__ import annotations

import torch

from .. import ops as _ops  # looked up at call time: dispatch (Triton / eager) lives in ops/__init__

__all__ = ["token_chunks", "row_chunks", "pair_chunks", "max_rows_for", "run", "new_buffer"]


def max_rows_for(V, dtype, chunk_bytes):
    """Tokens per chunk so that the ``[rows, V]`` logits buffer stays within ``chunk_bytes`` (at least 1)."""
    return max(1, int(chunk_bytes) // (V * torch.empty(0, dtype=dtype).element_size()))


def token_chunks(N, max_rows):
    """Contiguous token ranges (GRPO, plain log-probs: every token's coefficient is local)."""
    return [((s, min(N, s + max_rows)),) for s in range(0, N, max_rows)]


def row_chunks(B, T, max_rows):
    """Whole rows (KTO: a row's coefficient needs its full sum). One row at least, even above the budget."""
    k = max(1, max_rows // max(T, 1))
    return [((r * T, min(B, r + k) * T),) for r in range(0, B, k)]


def pair_chunks(B, T, max_rows):
    """DPO pairs: chosen rows ``j0..j1`` and their rejected partners ``P+j0..P+j1`` in the same chunk."""
    P = B // 2
    k = max(1, max_rows // max(2 * T, 1))
    return [((j * T, min(P, j + k) * T), ((P + j) * T, (P + min(P, j + k)) * T)) for j in range(0, P, k)]


def new_buffer(numel, dtype, device):
    """The one logits buffer of a call (a function so tests can count what it allocates)."""
    return torch.empty(numel, dtype=dtype, device=device)


_F32_ADDMM = {}


def _addmm_f32(acc, a, b, beta):
    """``acc = beta * acc + a @ b`` with fp32 ``acc`` and low-precision ``a``, ``b``, without an fp32 copy of ``a``
    when the backend has a mixed-precision GEMM (``out_dtype``, CUDA in torch >= 2.8). ``beta=0`` ignores ``acc``'s
    contents (first chunk: no memset of the accumulator)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b, beta=beta)
        return
    key = (acc.device.type, a.dtype)
    mode = _F32_ADDMM.get(key)
    if mode is None:
        mode = "upcast"  # CPU: exact, and only small shapes run there
        if acc.is_cuda:
            mode = "low_mm_add"  # last resort on CUDA: per-chunk product rounded once, summed in fp32
            t = torch.zeros(2, 2, dtype=acc.dtype, device=acc.device)
            x = torch.zeros(2, 2, dtype=a.dtype, device=acc.device)
            try:  # probe once on a tiny problem (torch >= 2.8 has out_dtype on CUDA)
                torch.addmm(t, x, x, beta=0, out_dtype=acc.dtype, out=t)
                mode = "addmm_out_dtype"
            except Exception:
                try:
                    torch.mm(x, x, out_dtype=acc.dtype)
                    mode = "mm_out_dtype"
                except Exception:
                    pass
        _F32_ADDMM[key] = mode
    if mode == "addmm_out_dtype":
        torch.addmm(acc, a, b, beta=beta, out_dtype=acc.dtype, out=acc)
    elif mode in ("mm_out_dtype", "low_mm_add"):
        prod = torch.mm(a, b, out_dtype=acc.dtype) if mode == "mm_out_dtype" else torch.mm(a, b)
        if beta == 0:
            acc.copy_(prod)
        else:
            acc.add_(prod)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype), beta=beta)


def _gather(x, segs):
    if len(segs) == 1:
        s, e = segs[0]
        return x[s:e]
    return torch.cat([x[s:e] for s, e in segs])


def _scatter(dst, segs, src):
    o = 0
    for s, e in segs:
        dst[s:e] = src[o:o + e - s]
        o += e - s


def run(h2, weight, bias, labels, chunks, *, temperature, ignore_index, return_entropy=False, coef=None,
        lse=None, need=(True, True, True)):
    """Run every chunk; return ``(logp [N], lse [N], entropy [N] or None, dh, dW, db)``.

    ``coef(segs, logp_chunk) -> g`` turns the chunk's log-probs into ``dL/dlogp``; without it no gradient is formed
    (``dh``, ``dW``, ``db`` are None). ``lse`` (given) skips the forward kernel (recompute backward of plain
    log-probs). ``need`` selects which of ``dh``, ``dW``, ``db`` to form. ``dh`` has the input dtype (one GEMM over
    the full vocabulary per chunk, fp32 accumulation inside it); ``dW`` and ``db`` are fp32 accumulators.
    """
    N, D = h2.shape
    V = weight.shape[0]
    dev, cdt = h2.device, h2.dtype
    acc = torch.float64 if cdt == torch.float64 else torch.float32
    grad = coef is not None
    given_lse = lse is not None
    logp = torch.zeros(N, dtype=acc, device=dev)
    lse = lse if given_lse else torch.zeros(N, dtype=acc, device=dev)
    ent = torch.zeros(N, dtype=acc, device=dev) if return_entropy else None
    dh = torch.empty_like(h2) if grad and need[0] else None
    dw = (torch.empty if chunks else torch.zeros)(V, D, dtype=acc, device=dev) if grad and need[1] else None
    db = torch.zeros(V, dtype=acc, device=dev) if grad and bias is not None and need[2] else None
    max_n = max((sum(e - s for s, e in segs) for segs in chunks), default=0)
    buf = new_buffer(max_n * V, cdt, dev)
    wt = weight.t()
    for i, segs in enumerate(chunks):
        h_c, y_c = _gather(h2, segs), _gather(labels, segs)
        n = h_c.shape[0]
        z = buf[:n * V].view(n, V)
        if bias is None:
            torch.mm(h_c, wt, out=z)
        else:
            torch.addmm(bias, h_c, wt, out=z)
        z3, y3 = z.view(1, n, V), y_c.view(1, n)
        if given_lse:
            lse_c = _gather(lse, segs).view(1, n)
        else:
            lp_c, lse_c, ent_c = _ops.logprobs_fwd(z3, y3, temperature, ignore_index, return_entropy)
            _scatter(logp, segs, lp_c.view(n))
            _scatter(lse, segs, lse_c.view(n))
            if ent is not None:
                _scatter(ent, segs, ent_c.view(n))
        if not grad:
            continue
        g = coef(segs, None if given_lse else lp_c.view(n))
        _ops.logprobs_bwd(z3, y3, lse_c, g.view(1, n).to(acc), temperature, ignore_index, out=z3)
        if dh is not None:
            if len(segs) == 1:
                torch.mm(z, weight, out=dh[segs[0][0]:segs[0][1]])
            else:
                _scatter(dh, segs, torch.mm(z, weight))
        if dw is not None:
            _addmm_f32(dw, z.t(), h_c, beta=0 if i == 0 else 1)
        if db is not None:
            db += z.sum(0, dtype=acc)
    return logp, lse, ent, dh, dw, db
