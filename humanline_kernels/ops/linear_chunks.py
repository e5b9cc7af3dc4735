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
:func:`run` does this with a ``coef`` callback (plain log-probs, and the losses off the kernel path);
:func:`run_kernels` is the losses' kernel path, steps 2-3 by the row and finalize kernels of the logits path.
"""
from __future__ import annotations

import torch

from .. import ops as _ops  # looked up at call time: dispatch (Triton / eager) lives in ops/__init__

__all__ = ["token_chunks", "row_chunks", "pair_chunks", "grpo_chunks", "max_rows_for", "run", "run_kernels",
           "new_buffer"]


def max_rows_for(V, dtype, chunk_bytes):
    """Tokens per chunk so that the ``[rows, V]`` logits buffer stays within ``chunk_bytes`` (at least 1)."""
    return max(1, int(chunk_bytes) // (V * torch.empty(0, dtype=dtype).element_size()))


def token_chunks(N, max_rows):
    """Contiguous token ranges (GRPO, plain log-probs: every token's coefficient is local)."""
    return [((s, min(N, s + max_rows)),) for s in range(0, N, max_rows)]


def row_chunks(B, T, max_rows):
    """Whole rows (KTO: a row's coefficient needs its full sum). One row at least, even above the budget."""
    if T == 0:  # no tokens: one empty chunk
        return [((0, 0),)]
    k = max(1, max_rows // T)
    return [((r * T, min(B, r + k) * T),) for r in range(0, B, k)]


def pair_chunks(B, T, max_rows):
    """DPO pairs: chosen rows ``j0..j1`` and their rejected partners ``P+j0..P+j1`` in the same chunk."""
    P = B // 2
    k = max(1, max_rows // (2 * T)) if T else P
    if k >= P:  # every pair (or no tokens): one contiguous range
        return [((0, B * T),)]
    return [((j * T, min(P, j + k) * T), ((P + j) * T, (P + min(P, j + k)) * T)) for j in range(0, P, k)]


def new_buffer(numel, dtype, device):
    """The one logits buffer of a call (a function so tests can count what it allocates)."""
    return torch.empty(numel, dtype=dtype, device=device)


def _size(segs):
    """Tokens in a chunk."""
    return sum(e - s for s, e in segs)


def _chunks_buffer(chunks, V, dtype, device):
    """The buffer for the largest chunk's ``[n, V]`` logits."""
    return new_buffer(max(map(_size, chunks), default=0) * V, dtype, device)


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
    buf = _chunks_buffer(chunks, V, cdt, dev)
    wt = weight.t()
    for i, segs in enumerate(chunks):
        y_c = _gather(labels, segs)
        n = y_c.shape[0]
        z = buf[:n * V].view(n, V)
        _lm_head(h2, wt, bias, segs, z)
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
        _grads(h2, weight, segs, z, dh, dw, db, first=i == 0)
    return logp, lse, ent, dh, dw, db


def _alloc_grads(h2, weight, bias, chunks, need):
    """``dh`` (input dtype), fp32 ``dW`` and ``db`` (not zero-filled when a first chunk overwrites them)."""
    N, D = h2.shape
    V = weight.shape[0]
    acc = torch.float64 if h2.dtype == torch.float64 else torch.float32
    dh = torch.empty_like(h2) if need[0] else None
    dw = (torch.empty if chunks else torch.zeros)(V, D, dtype=acc, device=h2.device) if need[1] else None
    db = (torch.empty if chunks else torch.zeros)(V, dtype=acc, device=h2.device) if bias is not None and need[2] \
        else None
    return dh, dw, db


def _lm_head(h2, wt, bias, segs, z):
    """``z = h_c W^T (+ b)`` for the chunk's token ranges, one GEMM a range (into consecutive rows of ``z``)."""
    o = 0
    for s, e in segs:
        if bias is None:
            torch.mm(h2[s:e], wt, out=z[o:o + e - s])
        else:
            torch.addmm(bias, h2[s:e], wt, out=z[o:o + e - s])
        o += e - s


def _grads(h2, weight, segs, z, dh, dw, db, first):
    """``dh[c] = dz W``, ``dW += dz^T h_c``, ``db += sum_rows dz`` for the chunk whose logits gradient is in ``z``."""
    o = 0
    for i, (s, e) in enumerate(segs):
        dz = z[o:o + e - s]
        if dh is not None:
            torch.mm(dz, weight, out=dh[s:e])
        if dw is not None:
            _addmm_f32(dw, dz.t(), h2[s:e], beta=0 if first and i == 0 else 1)
        o += e - s
    if db is not None:
        if first:  # overwrite: db is not zero-filled first
            torch.sum(z, 0, dtype=db.dtype, out=db)
        else:
            db += z.sum(0, dtype=db.dtype)


def run_kernels(kind, h2, weight, bias, labels, chunks, *, need, ref_logps, clip, temperature, ignore_index,
                terms, fin):
    """A loss on the kernel path: ``(loss, metrics, (dh, dW, db))``.

    ``kind`` is "grpo", "dpo" or "kto"; ``terms`` the row kernel's GRPO keywords (``advantages``,
    ``kl_ref_logps``, ``beta``, ``epsilon_low``, ``epsilon_high``; empty for DPO/KTO), ``fin`` the finalize op's
    keywords. Per-token results (``val``, ``coef``, ``lse``, ``aux``) live in whole-batch ``[B, T]`` buffers; each
    chunk's logits live in one reused ``[n, V]`` buffer that the row kernels address through the chunk's token
    ranges (:func:`.logprobs.row_args`). Per chunk:

    * GRPO (row weights ``w_b = d loss / d val`` from the labels, one finalize launch before the chunks): the lm_head
      GEMM; the token-terms kernel, which also writes ``dL/dz`` in place (``GRAD``); the ``dh`` and ``dW`` GEMMs.
    * DPO / KTO (``w`` of a pair or row needs its whole sum, known once the chunk's row kernel ran): the GEMM; the
      token-terms kernel; the finalize kernel over the chunk's pairs / rows (``span``), giving their ``w``; the
      backward kernel in place (``dL/dz = w_b coef (onehot - softmax) / T``); the ``dh`` and ``dW`` GEMMs.

    Then one finalize launch over the whole batch gives the loss and the metrics (skipped for DPO / KTO in one
    chunk: the chunk's finalize was the whole batch's). A DPO chunk of some of the pairs has two token ranges
    (chosen rows, rejected partners): its GEMMs run per range. KTO: the first chunk's finalize finds the baseline
    ``z0`` from the KL rows (its ``kl`` metric); later launches read it from there.
    """
    from . import finalize_kernels as FK, logprobs as LP, losses_kernels as LK
    B, T = labels.shape
    V = weight.shape[0]
    dev = h2.device
    grad = any(need)
    f32 = dict(dtype=torch.float32, device=dev)
    val, coef, lse = (torch.empty((B, T), **f32) for _ in range(3))
    aux = torch.empty((4, B, T), **f32)
    dh, dw, db = _alloc_grads(h2, weight, bias, chunks, need) if grad else (None, None, None)
    # the per-chunk launches read these whole-batch inputs as they are: cast and made contiguous once per call
    ref_logps = _f32(ref_logps)
    terms = {k: _f32(v) if isinstance(v, torch.Tensor) else v for k, v in terms.items()}
    fin = {k: (_f32(v) if v.is_floating_point() else v.contiguous()) if isinstance(v, torch.Tensor) else v
           for k, v in fin.items()}
    if fin.get("z0") is not None:  # given (all-reduced under torch.distributed)
        _known_z0(fin, fin["z0"])
    fin["ignore_index"] = ignore_index
    finalize = getattr(FK, f"{kind}_finalize")
    grpo = kind == "grpo"
    w = FK.grpo_finalize(None, None, labels, **fin)[2] if grpo and grad else None
    mode = _ops.MODE_GRPO if grpo else _ops.MODE_RATIO
    buf = _chunks_buffer(chunks, V, h2.dtype, dev)
    wt = weight.t()
    whole = len(chunks) == 1  # a DPO / KTO chunk's finalize is then the whole batch's
    done = None  # (loss, metrics, w) of a finalize over the whole batch
    for i, segs in enumerate(chunks):
        z = buf[:_size(segs) * V].view(-1, V)
        _lm_head(h2, wt, bias, segs, z)
        LK.token_terms_fwd(z, labels, ref_logps, mode=mode, clip=clip, temperature=temperature,
                           ignore_index=ignore_index, row_weight=w, grad_out=z if grpo and grad else None,
                           out=(val, coef, lse, aux), segs=segs, **terms)
        if not grad:
            continue
        if not grpo:
            res = finalize(val, aux, labels, **fin, span=None if whole else _span(kind, segs, T))
            if kind == "kto" and fin.get("z0") is None:  # the baseline found once, by the first chunk's launch
                _known_z0(fin, res[1][0])
            done = res if whole else None
            LP.logprobs_bwd(z, labels, lse, coef, temperature, ignore_index, out=z, row_weight=res[2], segs=segs)
        _grads(h2, weight, segs, z, dh, dw, db, first=i == 0)
    loss, met, _ = done if done is not None else finalize(val, aux, labels, **fin)
    return loss, _ops.named_metrics(kind, met), (dh, dw, db)


def _known_z0(fin, z0):
    """KTO's finalize keywords once ``z0`` is known: later launches read it instead of the KL rows."""
    fin.update(z0=z0, kl_logps=None, kl_ref_logps=None, kl_mask=None)


def _f32(t):
    return None if t is None else t.to(torch.float32).contiguous()


def _span(kind, segs, T):
    """The pairs (DPO) or rows (KTO) of a chunk, for its finalize launch."""
    (s, e), *_ = segs
    if kind == "dpo":  # chosen rows first; merged with their partners when the chunk holds every pair
        return s // T, s // T + _size(segs) // (2 * T)
    return s // T, e // T


def grpo_chunks(B, T, max_rows):
    """GRPO's chunks: whole rows while a row fits in the buffer (the kernel then reads advantages and weights per
    row), else token ranges."""
    return row_chunks(B, T, max_rows) if max_rows >= T else token_chunks(B * T, max_rows)
