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

__all__ = ["token_chunks", "row_chunks", "pair_chunks", "grpo_chunks", "max_rows_for", "run", "run_grpo",
           "new_buffer"]


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
    dh, dw, db = _alloc_grads(h2, weight, bias, chunks, need) if grad else (None, None, None)
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


def _alloc_grads(h2, weight, bias, chunks, need):
    """``dh`` (input dtype), fp32 ``dW`` (not zero-filled when the first chunk overwrites it) and ``db``."""
    N, D = h2.shape
    V = weight.shape[0]
    acc = torch.float64 if h2.dtype == torch.float64 else torch.float32
    dh = torch.empty_like(h2) if need[0] else None
    dw = (torch.empty if chunks else torch.zeros)(V, D, dtype=acc, device=h2.device) if need[1] else None
    db = torch.zeros(V, dtype=acc, device=h2.device) if bias is not None and need[2] else None
    return dh, dw, db


def run_grpo(h2, weight, bias, labels, chunks, *, need, ref_logps, kl_ref_logps, advantages, clip, temperature,
             ignore_index, beta, epsilon_low, epsilon_high, loss_type, normalizer, max_completion_length):
    """GRPO on the kernel path: ``(loss, metrics, (dh, dW, db))``, four launches a chunk.

    Before the chunks, the GRPO finalize kernel gives the row weights ``w_b = d loss / d L`` (they depend on the
    mask only). Per chunk: the lm_head GEMM into the buffer; the token-terms kernel, which writes the chunk's
    ``val``, ``aux`` into whole-batch buffers and, when a gradient is wanted, ``dL/dz`` in place into the buffer
    (``grpo_fwd_grad``); then the ``dh`` and ``dW`` GEMMs (``db`` a column sum). After them one finalize launch
    for the loss and the metrics. Chunks of whole rows (:func:`grpo_chunks`) run as ``[rows, T, V]``; a token
    range inside a row (rows longer than the buffer) runs as ``n`` rows of one token, with the per-row inputs
    (advantage, weight) expanded to tokens first (two copies a call).
    """
    B, T = labels.shape
    N, V = B * T, weight.shape[0]
    dev = h2.device
    grad = any(need)
    labels_bt = labels
    f32 = dict(dtype=torch.float32, device=dev)
    val, coef, lse = (torch.empty((B, T), **f32) for _ in range(3))
    aux = torch.empty((4, B, T), **f32)
    dh, dw, db = _alloc_grads(h2, weight, bias, chunks, need) if grad else (None, None, None)
    fin = dict(ignore_index=ignore_index, loss_type=loss_type, normalizer=normalizer,
               max_completion_length=max_completion_length)
    adv = advantages.to(torch.float32)
    w = _ops.grpo_finalize(None, None, labels, **fin)[2] if grad else None
    rows = all(s % T == 0 and e % T == 0 for (s, e), in chunks)
    if rows:
        def per_row(x, s, e):
            return x[s // T:e // T]
    else:  # [B, T] tensors as [N, 1], per-row ones expanded to [N]
        labels, ref_logps, val, coef, lse = (x.reshape(N, 1) for x in (labels, ref_logps, val, coef, lse))
        kl_ref_logps = None if kl_ref_logps is None else kl_ref_logps.reshape(N, 1)
        aux_t = aux.view(4, N, 1)
        adv = adv.unsqueeze(1).expand(B, T).reshape(N)
        w = None if w is None else w.unsqueeze(1).expand(B, T).reshape(N)

        def per_row(x, s, e):
            return x[s:e]
    buf = new_buffer(max((e - s for (s, e), in chunks), default=0) * V, h2.dtype, dev)
    wt = weight.t()
    for i, ((s, e),) in enumerate(chunks):
        n = e - s
        z = buf[:n * V].view(n, V)
        if bias is None:
            torch.mm(h2[s:e], wt, out=z)
        else:
            torch.addmm(bias, h2[s:e], wt, out=z)
        z3 = z.view(n // T, T, V) if rows else z.view(n, 1, V)
        out = (per_row(val, s, e), per_row(coef, s, e), per_row(lse, s, e),
               aux[:, s // T:e // T] if rows else aux_t[:, s:e])
        _ops.token_terms_fwd(z3, per_row(labels, s, e), per_row(ref_logps, s, e), mode=_ops.MODE_GRPO, clip=clip,
                             temperature=temperature, ignore_index=ignore_index,
                             kl_ref_logps=None if kl_ref_logps is None else per_row(kl_ref_logps, s, e),
                             advantages=per_row(adv, s, e), beta=beta, epsilon_low=epsilon_low,
                             epsilon_high=epsilon_high, row_weight=None if w is None else per_row(w, s, e),
                             grad_out=z3 if grad else None, out=out)
        if dh is not None:
            torch.mm(z, weight, out=dh[s:e])
        if dw is not None:
            _addmm_f32(dw, z.t(), h2[s:e], beta=0 if i == 0 else 1)
        if db is not None:
            db += z.sum(0, dtype=db.dtype)
    loss, met, _ = _ops.grpo_finalize(val.view(B, T), aux, labels_bt, **fin)
    return loss, dict(zip(_ops.METRICS["grpo"], met.unbind(0))), (dh, dw, db)


def grpo_chunks(B, T, max_rows):
    """GRPO's chunks: whole rows while a row fits in the buffer (the kernel then reads advantages and weights per
    row), else token ranges."""
    return row_chunks(B, T, max_rows) if max_rows >= T else token_chunks(B * T, max_rows)
