r"""Chunked lm_head driver: log-probs and losses from ``hidden [N, D]`` and ``weight [V, D]`` without the logits.

A *chunk* is a tuple of flat token ranges ``((s0, e0), (s1, e1), ...)`` of ``hidden``; its ``n`` tokens go through

1. ``z = h_c W^T (+ b)`` into one reused buffer of ``max_rows * V`` elements (input dtype: bf16 in, fp32
   accumulation inside cuBLAS);
2. the row kernels on ``z``: log-probs, or a loss's token terms and finalize (the chunk loops are the
   ``autograd.Function``\ s of :mod:`humanline_kernels.fused_linear`; this module holds their pieces);
3. when a gradient is wanted, ``dL/dz = g (onehot(y) - softmax(z/T)) / T`` overwrites the logits in the buffer;
4. ``dh[c] = dz W``, ``dW += dz^T h_c`` (in the weight's dtype: one GEMM a chunk that adds to ``dW`` in fp32 and
   rounds once), ``db += sum_rows dz`` (fp32).

For the losses ``g`` is known inside the chunk, which holds everything its coefficients need (:func:`loss_chunks`),
so the logits GEMM is never recomputed: 6 N D V flops in all. Plain log-probs learn their per-token
gradient only in the backward, which recomputes each chunk's GEMM (8 N D V). At most one chunk of logits exists
at any time (the buffer), plus the transient upcasts of the eager twins. Both run the Triton kernels or, on CPU
tensors and fp64, their eager twins (``humanline_kernels._eager``, decided once by the caller). The row kernels
address a chunk's buffer through its token ranges and read and write the whole batch's ``[B, T]`` tensors, so nothing is
gathered or scattered per chunk.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

__all__ = ["token_chunks", "row_chunks", "pair_chunks", "grpo_chunks", "loss_chunks", "map_chunks", "Mapped",
           "max_rows_for", "new_buffer", "chunks_buffer", "gather_buffer", "chunk_logits", "kernel_segs",
           "alloc_grads", "grads", "span"]


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


class Mapped(NamedTuple):
    """A chunk of a token map (:class:`humanline_kernels._layout.TokenMap`: a packed batch, or the supervised
    tokens only): map entries ``a..b``; ``source`` the hidden rows (a contiguous ``(s, e)`` range, or an int64 index
    tensor, gathered for the GEMM), ``tokens`` their positions in the ``[S, T]`` planes (the row kernels' token map),
    ``span`` the chunk's pairs (DPO) or rows (KTO) for its finalize launch."""

    source: object
    tokens: torch.Tensor
    span: Optional[tuple]
    n: int


def size(segs):
    """Tokens in a chunk."""
    if isinstance(segs, Mapped):
        return segs.n
    return sum(e - s for s, e in segs)


def kernel_segs(segs):
    """What the row kernels address a chunk's buffer rows by: token ranges, or a token map."""
    return segs.tokens if isinstance(segs, Mapped) else segs


def map_chunks(name, tm, max_rows):
    """Chunks of a token map, slices of it in map order: any ``max_rows`` tokens (GRPO, the sequence sums, plain
    log-probs: name ``"grpo"``, ``"sequence"`` or ``"tokens"``), whole rows (KTO) or whole pairs (DPO: the map lists
    row ``j`` then row ``P + j``, pair by pair), at least one row or pair even above the budget."""
    if name in ("dpo", "kto"):
        runs, step = tm.runs(), 2 if name == "dpo" else 1
        units = [(runs[i][1], runs[i + step - 1][2]) for i in range(0, len(runs), step)]  # pair j / row r: k
        out, k0 = [], 0
        for k in range(len(units)):
            if k + 1 == len(units) or units[k + 1][1] - units[k0][0] > max_rows:
                out.append(_mapped(tm, units[k0][0], units[k][1], (k0, k + 1)))
                k0 = k + 1
        return out or [_mapped(tm, 0, 0, (0, 0))]
    M = tm.M
    return [_mapped(tm, a, min(M, a + max_rows), None) for a in range(0, M, max_rows)] or [_mapped(tm, 0, 0, None)]


def _mapped(tm, a, b, span):
    src = (a, b) if tm.source is None else tm.source[a:b]
    return Mapped(src, tm.plane[a:b], span, b - a)


def chunks_buffer(chunks, V, dtype, device):
    """The buffer for the largest chunk's ``[n, V]`` logits."""
    return new_buffer(max(map(size, chunks), default=0) * V, dtype, device)


def gather_buffer(chunks, h2):
    """The buffer for the largest gathered chunk's ``[n, D]`` hidden rows (and, in the backward, its ``dh``), or
    None when no chunk gathers. Its size is at most ``D / V`` of the logits buffer's."""
    sizes = [size(c) for c in chunks if _gathers(c)]
    # (an empty one for a map without a token, e.g. supervised ranges all empty: its chunk still gathers)
    return torch.empty((max(sizes), h2.shape[1]), dtype=h2.dtype, device=h2.device) if sizes else None


def _gathers(segs):
    """Whether a chunk's hidden rows are gathered into one buffer for its GEMMs: a map's index rows, or several
    row ranges (a DPO pair chunk, chosen and rejected rows ``B/2`` rows apart). One range is used in place."""
    if isinstance(segs, Mapped):
        return isinstance(segs.source, torch.Tensor)
    return len(segs) > 1


def _rows_of(h2, segs, gbuf):
    """The chunk's hidden rows: a slice, or gathered into ``gbuf``."""
    if not isinstance(segs, Mapped):
        if len(segs) == 1:
            (s, e), = segs
            return h2[s:e]
        return torch.cat([h2[s:e] for s, e in segs], out=gbuf[:size(segs)])
    src = segs.source
    if isinstance(src, tuple):
        return h2[src[0]:src[1]]
    return torch.index_select(h2, 0, src, out=gbuf[:segs.n])


def alloc_grads(h2, weight, bias, chunks, need, sparse=False):
    """``dh`` and ``dW`` in the input's (the weight's) dtype, ``db`` in fp32 (fp64 for fp64), none zero-filled when
    a first chunk overwrites them; ``dh`` zero-filled when the chunks skip rows (``sparse``: a map of the supervised
    tokens only). ``dW`` is accumulated in place, one rounding a chunk (docs/fused_linear.md, "dW's precision")."""
    N, D = h2.shape
    V = weight.shape[0]
    acc = torch.float64 if h2.dtype == torch.float64 else torch.float32
    dh = (torch.zeros_like if sparse else torch.empty_like)(h2) if need[0] else None
    dw = (torch.empty if chunks else torch.zeros)(V, D, dtype=weight.dtype, device=h2.device) if need[1] else None
    db = (torch.empty if chunks else torch.zeros)(V, dtype=acc, device=h2.device) if bias is not None and need[2] \
        else None
    return dh, dw, db


def chunk_logits(buf, h2, wt, bias, segs, gbuf=None):
    """The chunk's ``[n, V]`` logits ``h_c W^T (+ b)`` in the front of ``buf``, in one GEMM: on the rows in place
    when they are one range, else gathered into ``gbuf`` (a map's index rows; a DPO pair chunk's two ranges, so
    that it adds to ``dW`` once, not once a range)."""
    V = wt.shape[1]
    z = buf[:size(segs) * V].view(-1, V)
    h = _rows_of(h2, segs, gbuf)
    if bias is None:
        torch.mm(h, wt, out=z)
    else:
        torch.addmm(bias, h, wt, out=z)
    return z


def grads(h2, weight, segs, z, dh, dw, db, first, gbuf=None):
    """``dh[c] = dz W``, ``dW += dz^T h_c``, ``db += sum_rows dz`` for the chunk whose logits gradient is in ``z``
    (a gathered chunk: ``h_c`` is still in ``gbuf`` from :func:`chunk_logits`; a map's ``dh`` goes there next,
    then to its rows of ``dh``; a pair chunk's ``dh`` straight to its two ranges)."""
    gathered = _gathers(segs)
    if dw is not None:  # one accumulation a chunk (each reads and writes the whole [V, D]), fp32 inside the GEMM
        h = gbuf[:size(segs)] if gathered else _rows_of(h2, segs, None)
        dw.addmm_(z.t(), h, beta=0 if first else 1)  # beta = 0: the first chunk ignores dw's (unset) contents
    if dh is not None:
        if isinstance(segs, Mapped):
            src = segs.source
            if gathered:
                torch.mm(z, weight, out=gbuf[:segs.n])
                dh.index_copy_(0, src, gbuf[:segs.n])
            else:
                torch.mm(z, weight, out=dh[src[0]:src[1]])
        else:
            o = 0
            for s, e in segs:
                torch.mm(z[o:o + e - s], weight, out=dh[s:e])
                o += e - s
    _db(z, db, first)


def _db(z, db, first):
    if db is not None:
        if first:  # overwrite: db is not zero-filled first
            torch.sum(z, 0, dtype=db.dtype, out=db)
        else:
            db += z.sum(0, dtype=db.dtype)


def span(name, segs, T):
    """The pairs (DPO) or rows (KTO) of a chunk, for its finalize launch."""
    if isinstance(segs, Mapped):
        return segs.span
    (s, e), *_ = segs
    if name == "dpo":  # chosen rows first; merged with their partners when the chunk holds every pair
        return s // T, s // T + size(segs) // (2 * T)
    return s // T, e // T


def grpo_chunks(B, T, max_rows):
    """GRPO's chunks: whole rows while a row fits in the buffer (the kernel then reads advantages and weights per
    row), else token ranges."""
    return row_chunks(B, T, max_rows) if max_rows >= T else token_chunks(B * T, max_rows)


def loss_chunks(name, B, T, max_rows):
    """The chunks of a loss: everything a coefficient needs in one chunk (DPO pairs, KTO rows, GRPO tokens)."""
    return {"dpo": pair_chunks, "kto": row_chunks, "grpo": grpo_chunks}[name](B, T, max_rows)
