r"""Humanline losses and token log-probs straight from hidden states and the lm_head weight (no ``[N, V]`` logits).

``hidden [..., D]`` (``[B, T, D]`` for the losses), ``weight [V, D]`` (same dtype and device), optional
``bias [V]``, ``labels`` shaped like ``hidden`` without ``D`` (int64, ``ignore_index`` marks tokens that do not
count). Logits are ``z = hidden @ weight.T + bias``; everything else is the math of :mod:`humanline_kernels.reference`.

How it runs (:mod:`humanline_kernels.ops.linear`): tokens go through the lm_head in chunks of at most
``chunk_bytes`` of logits (one reused buffer, input dtype). For the losses each chunk holds everything its loss
coefficients need -- single tokens for GRPO, whole rows for KTO (its KL rows enter only through the baseline
``z0``), whole chosen/rejected pairs (rows ``j`` and ``P + j``) for DPO -- so ``g = dL/dlogp`` is known inside the
chunk: the row and finalize kernels of the logits path give it and write ``dL/dz`` in place into the buffer
(nine launches forward + backward in one chunk; on CPU tensors and fp64 their eager twins do the same steps).
``dh``, ``dW`` (both in the weight's dtype: ``dW`` adds one chunk a GEMM, rounded once a chunk) and the fp32 ``db``
are formed during the forward pass; the backward only multiplies them by ``grad_output`` (device-side, no host sync;
in place unless the graph is retained). Flops: 6 N D V (no recomputed GEMM). The loss value and metrics are
those of ``hk.losses.*`` on the full batch.
:func:`token_logprobs` (per-token ``grad_output`` is unknown in the forward) saves the fp32 log-sum-exp and
recomputes the GEMM in its backward (8 N D V flops).

A DPO pair (KTO row) never straddles chunks, so one pair (row) is the smallest chunk: with very long rows the
buffer can exceed ``chunk_bytes`` (``2 T V`` elements for DPO, ``T V`` for KTO).

Calling pattern under FSDP / ZeRO-3 (the weight is only gathered inside the owning module's forward, and the
gradient for ``weight`` must reach autograd while FSDP's hooks are armed): call these functions *inside* the
forward of the module that owns the lm_head (or a wrapper whose forward runs the whole model), e.g.::

    class HumanlineHead(torch.nn.Module):           # wrap the whole causal LM with FSDP / ZeRO-3 as usual
        def __init__(self, lm):
            super().__init__()
            self.lm = lm
        def forward(self, input_ids, attention_mask, labels, ref_logps, advantages):
            h = self.lm.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            w = self.lm.get_output_embeddings().weight   # gathered here by FSDP / ZeRO-3
            return hk.fused_linear.grpo(h[:, :-1], w, labels[:, 1:], ref_logps, advantages)

The losses need nothing from ``weight`` in the backward (``dW`` is already formed), so a re-gather is only
needed by :func:`token_logprobs` with gradient. For the reference model use :func:`token_logprobs_nograd` (or
:func:`token_logprobs` under ``torch.no_grad()``): log-probs only, nothing saved.
"""
from __future__ import annotations

import math

import torch

from . import _eager, _layout, _objectives, _validation, losses, ops
from ._params import DPO, GRPO, IPO, KTO, GRPOInputs, KTOInputs, Sequence, SimPO, SLiC, Tokens, named_metrics, options
from .fused import _distinct, _input_grads, _owed
from .ops import linear
from .ops.constants import AUX_PLANES

__all__ = ["token_logprobs", "token_logprobs_nograd", "grpo", "dpo", "kto", "sequence_logratios", "ipo", "simpo",
           "slic", "CHUNK_BYTES"]

CHUNK_BYTES = 512 << 20  # logits buffer budget: 2048 tokens of a 128k vocabulary in bf16


def _impl(kernels):
    """The launchers (:mod:`.ops.kernels`: importing it imports Triton, only once a call has decided for the
    kernels) or their eager twins (:mod:`._eager`), under the same names."""
    if not kernels:
        return _eager
    from .ops import kernels as launchers
    return launchers


def _autocast(hidden, weight, bias):
    """Under ``torch.autocast`` run the lm_head in the autocast dtype, as ``nn.Linear`` would (autograd casts back)."""
    if not (isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor)):
        return hidden, weight, bias
    dev = hidden.device.type
    try:
        on = torch.is_autocast_enabled(dev)
    except RuntimeError:  # a device type autocast does not know (meta: the ahead-of-time compile check)
        on = False
    if not on or not hidden.is_floating_point():
        return hidden, weight, bias
    dt = torch.get_autocast_dtype(dev)
    with torch.autocast(dev, enabled=False):
        return hidden.to(dt), weight.to(dt), None if bias is None else bias.to(dt)


def _need(hidden, weight, bias):
    if not torch.is_grad_enabled():
        return (False, False, False)
    return (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)


def _scaled(acc, go, dtype, launchers):
    """``acc * grad_output`` cast to ``dtype`` in one pass (no fp32 temporary), a new tensor; on the kernel path
    (``launchers``, :mod:`.ops.kernels`) one vectorised Triton pass (``torch.mul`` takes a non-vectorised
    path for it on CUDA: ``ops.logprobs.scaled``)."""
    if acc is None:
        return None
    if launchers is not None:
        return launchers.scaled(acc, go, dtype)
    out = torch.empty(acc.shape, dtype=dtype, device=acc.device)
    return torch.mul(acc, go, out=out)


def _graph_kept():
    """Whether the running backward keeps the graph (``retain_graph`` / ``create_graph``): then the gradients formed
    in the forward stay on ctx for the next backward and are scaled out of place. Unknown (the engine's query is
    private: ``torch._C._autograd._get_current_graph_task_keep_graph``, which torch 2.13 has; a torch without it):
    kept, the safe side (a copy of ``dW``: the peak of a plain backward is then one ``[V, D]`` more)."""
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    if query is None:
        return True
    try:
        return bool(query())
    except RuntimeError:  # no graph task running (a backward called by hand)
        return True


def _acc(t):
    """The accumulation dtype of the per-token outputs: fp64 for fp64 inputs (the eager twins), else fp32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _planes(p, B, T, f, tm, kernels):
    """The per-token planes ``(val, coef, lse, aux [AUX_PLANES, B, T])`` the row kernels write chunk by chunk. A map
    may skip positions: their labels are ignore_index, so the kernels never read them; the eager twins sum whole
    rows and need zeros there."""
    alloc = torch.empty if tm is None or kernels else torch.zeros
    return tuple(alloc((B, T), **f) for _ in range(3)) + (alloc((AUX_PLANES[p.mode], B, T), **f),)


def _sparse(tm, h2):
    """Whether a map skips hidden rows (the supervised tokens only): their ``dh`` is never written, so zeros."""
    return tm is not None and tm.M != h2.shape[0]


def _linear_level(p, hidden, weight, bias, labels, ref_logps, chunk_bytes, validate, packed, supervised, pairs=False):
    """The checked ``(labels, ref_logps, map)`` of a loss call: as given (map None), or on the padded rows
    ``[S, T]`` with the token map of a packed batch and / or of the supervised positions (:mod:`._layout`; ``pairs``:
    DPO's chunks of whole pairs, so the map lists row ``j`` then row ``P + j``)."""
    if packed is None:
        _validation.check_linear_loss(hidden, weight, bias, labels, ref_logps, p, chunk_bytes, validate)
        if supervised is None:
            return labels, ref_logps, None
        tm = _layout.supervised_map(supervised, *labels.shape, hidden.device, pairs=pairs)
    else:
        _layout.check_packed("hidden", hidden, labels, ref_logps, packed, p)
        _validation.check_linear(hidden, weight, bias, labels, p, chunk_bytes, validate)
        N, dev = labels.numel(), hidden.device
        tm = (_layout.packed_map(packed, N, dev, pairs=pairs, host=True) if supervised is None else
              _layout.supervised_map(supervised, 0, 0, dev, packed=packed, N=N, pairs=pairs))
    y = _layout.unpack(labels, tm, p.ignore_index)
    if validate and supervised is not None:
        _validation.check_supervised(labels, y, p.ignore_index)
    return y, None if ref_logps is None else _layout.unpack(ref_logps, tm, 0.0), tm


# ---------------------------------------------------------------------------------------------- token log-probs
class _LinearLogprobs(torch.autograd.Function):
    """Per-token log-probs chunk by chunk; the backward recomputes each chunk's GEMM (the per-token gradient is
    only known then). ``kernels``: the Triton kernels or their eager twins."""

    @staticmethod
    def forward(ctx, p, return_entropy, rows, kernels, tm, hidden, weight, bias, labels):
        impl = _impl(kernels)
        h2, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(1, -1)  # tokens as one row: q = r
        f = dict(dtype=_acc(hidden), device=hidden.device)
        alloc = torch.empty if tm is None else torch.zeros  # (a map of the supervised tokens skips the others)
        logp, lse = alloc(y.shape, **f), alloc(y.shape, **f)
        ent = alloc(y.shape, **f) if return_entropy else None
        chunks = linear.token_chunks(y.shape[1], rows) if tm is None else linear.map_chunks("tokens", tm, rows)
        buf, wt = linear.chunks_buffer(chunks, weight.shape[0], hidden.dtype, hidden.device), weight.t()
        gbuf = linear.gather_buffer(chunks, h2)
        for segs in chunks:
            z = linear.chunk_logits(buf, h2, wt, bias, segs, gbuf)
            impl.logprobs_fwd(z, y, p.temperature, p.ignore_index, return_entropy, out=(logp, lse, ent),
                              segs=linear.kernel_segs(segs))
        ctx.save_for_backward(hidden, weight, bias, labels, lse, ent)
        ctx.cfg = (p, chunks, impl, tm is not None)
        ctx.set_materialize_grads(False)  # no zero-filled gradient for an unused output
        return logp.view(labels.shape), None if ent is None else ent.view(labels.shape)

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        if grad_logp is None and grad_ent is None:
            return (None,) * 9
        hidden, weight, bias, labels, lse, ent = ctx.saved_tensors
        p, chunks, impl, sparse = ctx.cfg
        h2, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(1, -1)
        dh, dw, db = linear.alloc_grads(h2, weight, bias, chunks, ctx.needs_input_grad[5:8], sparse)
        g = torch.zeros_like(lse) if grad_logp is None else grad_logp.reshape(y.shape).to(lse.dtype).contiguous()
        gh = None if grad_ent is None else grad_ent.reshape(y.shape)
        buf, wt = linear.chunks_buffer(chunks, weight.shape[0], hidden.dtype, hidden.device), weight.t()
        gbuf = linear.gather_buffer(chunks, h2)
        for i, segs in enumerate(chunks):
            z = linear.chunk_logits(buf, h2, wt, bias, segs, gbuf)  # recomputed: dL/dz is formed in place of the logits
            impl.logprobs_bwd(z, y, lse, g, p.temperature, p.ignore_index, out=z, segs=linear.kernel_segs(segs),
                              grad_entropy=gh, entropy=ent)
            linear.grads(h2, weight, segs, z, dh, dw, db, first=i == 0, gbuf=gbuf)
        buf = gbuf = z = None  # the chunk buffers go before anything else is allocated (else they add to the peak)
        dh = None if dh is None else dh.view(hidden.shape)
        db = None if db is None else db.to(bias.dtype)  # (dW is in the weight's dtype already)
        return None, None, None, None, None, dh, dw, db, None


@options(Tokens)
def token_logprobs(hidden, weight, labels, *, bias=None, temperature, ignore_index, return_entropy=False,
                   chunk_bytes=CHUNK_BYTES, validate=True, supervised=None, packed=None):
    """fp32 ``log_softmax((hidden @ weight.T + bias) / temperature)[labels]`` shaped like ``labels``, 0 where ignored.

    Differentiable with respect to ``hidden``, ``weight`` and ``bias`` (the backward recomputes the lm_head GEMM
    chunk by chunk). With ``return_entropy=True`` returns ``(logps, entropy)``, the entropy differentiable too
    (an entropy bonus trains through it, as with TRL's head). Under
    ``torch.no_grad()`` (or when nothing requires grad) nothing is saved. ``chunk_bytes`` bounds the logits
    buffer; ``validate=False`` skips the label range check (the only host sync).

    ``supervised`` (ranges ``[R, 2]`` on the host: per row of ``labels`` viewed as ``[R, T]``, or per sequence of
    ``packed``, the positions ``[start, end)`` that may carry a label) runs the lm_head on those positions only;
    the others get log-prob 0 and an exact 0 gradient (docs/fused_linear.md, "Layouts"). ``packed``
    (:class:`~humanline_kernels.Packed`): ``hidden [N, D]`` or ``[1, N, D]`` is a padding-free stream; without
    ``supervised`` the log-probs are the stream's as they are, and only its boundaries are checked.
    """
    hidden, weight, bias = _autocast(hidden, weight, bias)
    p = Tokens(temperature=temperature, ignore_index=ignore_index)
    if packed is not None:  # (the losses' order: the layout first, then the level's own checks)
        _layout.check_packed("hidden", hidden, labels, None, packed)
    _validation.check_linear(hidden, weight, bias, labels, p, chunk_bytes, validate, return_entropy=return_entropy)
    tm = None
    if supervised is not None:
        N = labels.numel()
        T = labels.shape[-1]  # (padded: the rows of labels [..., T])
        R = math.prod(labels.shape[:-1])  # (N // T, but also with T = 0)
        tm = _layout.flat(_layout.supervised_map(supervised, R, T, hidden.device, packed=packed, N=N))
        if validate:
            _validation.check_supervised(labels, labels.reshape(-1).index_select(0, tm.plane), ignore_index)
    elif packed is not None:  # the stream's log-probs are its own whatever its sequences: boundaries checked only
        _layout.check_bounds(packed, labels.numel(), validate=validate)
    rows = linear.max_rows_for(weight.shape[0], hidden.dtype, chunk_bytes)
    logp, ent = _LinearLogprobs.apply(p, return_entropy, rows, ops.use_kernels(hidden), tm, hidden, weight,
                                      bias, labels)
    return (logp, ent) if return_entropy else logp


@torch.no_grad()
def token_logprobs_nograd(hidden, weight, labels, **kw):
    """:func:`token_logprobs` for the reference model's forward: no autograd, no saved state."""
    return token_logprobs(hidden, weight, labels, **kw)


# ------------------------------------------------------------------------------------- the sequence-level sums
class _LinearSequences(torch.autograd.Function):
    """The sequence-level primitive from the hidden states: ``(s, policy_sums, counts, metrics [3])`` (see
    :func:`humanline_kernels.fused.sequence_logratios`), token chunks through the row kernel, then the sums kernel.
    The loss on the sums is known only after every chunk, so the backward recomputes each chunk's GEMM (8 N D V
    flops, as the plain log-probs) and writes ``d l_t = grad_s[b] w coef + grad_policy[b]`` into its softmax
    backward."""

    @staticmethod
    def forward(ctx, p, rows, kernels, tm, hidden, weight, bias, labels, ref, token_weights):
        impl = _impl(kernels)
        B, T = labels.shape
        h2 = hidden.reshape(-1, hidden.shape[-1])
        f = dict(dtype=_acc(hidden), device=hidden.device)
        out = _planes(p, B, T, f, tm, kernels)
        ref = torch.zeros((B, T), **f) if ref is None else ref.to(f["dtype"]).contiguous()
        chunks = linear.token_chunks(B * T, rows) if tm is None else linear.map_chunks("sequence", tm, rows)
        buf, wt = linear.chunks_buffer(chunks, weight.shape[0], hidden.dtype, hidden.device), weight.t()
        gbuf = linear.gather_buffer(chunks, h2)
        for segs in chunks:
            impl.token_terms(linear.chunk_logits(buf, h2, wt, bias, segs, gbuf), labels, ref, p, out=out,
                             segs=linear.kernel_segs(segs))
        val, coef, lse, aux = out
        s, pol, n, met = impl.seq_finalize(val, aux, labels, p, token_weights)
        if token_weights is not None:
            coef = coef * token_weights.to(coef.dtype)
        owed = _owed(ctx, p, 8)
        ctx.save_for_backward(hidden, weight, bias, labels, lse, coef, *((aux, ref, token_weights) if owed else ()))
        ctx.cfg = (p, chunks, kernels, _sparse(tm, h2), owed)
        ctx.mark_non_differentiable(n, met)
        ctx.set_materialize_grads(False)
        return s, pol, n, met

    @staticmethod
    def backward(ctx, grad_s, grad_pol, _grad_n, _grad_met):
        if grad_s is None and grad_pol is None:
            return (None,) * 10
        hidden, weight, bias, labels, lse, coef, *side = ctx.saved_tensors
        p, chunks, kernels, sparse, owed = ctx.cfg
        impl = _impl(kernels)
        h2 = hidden.reshape(-1, hidden.shape[-1])
        dh, dw, db = linear.alloc_grads(h2, weight, bias, chunks, ctx.needs_input_grad[4:7], sparse)
        w = torch.zeros_like(lse[:, 0]) if grad_s is None else grad_s.to(lse.dtype).contiguous()
        d_ref = None
        if owed and grad_s is not None:  # the policy sums do not depend on the reference
            aux, ref, tw = side
            g = w[:, None] if tw is None else w[:, None] * tw.to(w.dtype)
            d_ref = _input_grads(p, owed, labels, aux, ref, (), None, g, None)[0]
        if not any(ctx.needs_input_grad[4:7]):
            return None, None, None, None, None, None, None, None, d_ref, None
        add = None if grad_pol is None else grad_pol.to(lse.dtype).contiguous()
        buf, wt = linear.chunks_buffer(chunks, weight.shape[0], hidden.dtype, hidden.device), weight.t()
        gbuf = linear.gather_buffer(chunks, h2)
        for i, segs in enumerate(chunks):
            z = linear.chunk_logits(buf, h2, wt, bias, segs, gbuf)  # recomputed: dL/dz is formed in place of the logits
            impl.logprobs_bwd(z, labels, lse, coef, p.temperature, p.ignore_index, out=z, row_weight=w, row_add=add,
                              segs=linear.kernel_segs(segs))
            linear.grads(h2, weight, segs, z, dh, dw, db, first=i == 0, gbuf=gbuf)
        buf = gbuf = z = None  # the chunk buffers go before anything else is allocated (no z without chunks)
        dh = None if dh is None else dh.view(hidden.shape)
        db = None if db is None else db.to(bias.dtype)  # (dW is in the weight's dtype already)
        return None, None, None, None, dh, dw, db, None, d_ref, None


def _rows(p, hidden, weight, bias, labels, ref_logps, chunk_bytes, token_weights=None, tm=None):
    """``(Rows, metrics)`` of the sequence-level primitive (``ref_logps=None``: a reference of 0; ``tm``: a token
    map, :mod:`._layout`)."""
    rows = linear.max_rows_for(weight.shape[0], hidden.dtype, chunk_bytes)
    s, pol, n, met = _LinearSequences.apply(p, rows, ops.use_kernels(hidden, ref_logps), tm, hidden, weight, bias,
                                            labels, ref_logps, token_weights)
    return _objectives.Rows(s, pol, n), named_metrics("sequence", met)


@options(Sequence)
def sequence_logratios(hidden, weight, labels, ref_logps, *, bias=None, clip, normalize, temperature, ignore_index,
                       chunk_bytes=CHUNK_BYTES, validate=True, supervised=None, packed=None):
    """The sequence-level primitive from ``hidden [B, T, D]`` and ``weight [V, D]``: ``(s [B], policy_sums [B],
    metrics)``, as :func:`humanline_kernels.losses.sequence_logratios`; the backward recomputes the lm_head GEMM
    chunk by chunk. ``supervised`` / ``packed``: as for :func:`grpo`."""
    hidden, weight, bias = _autocast(hidden, weight, bias)
    p = Sequence(clip=clip, normalize=normalize, temperature=temperature, ignore_index=ignore_index)
    labels, ref_logps, tm = _linear_level(p, hidden, weight, bias, labels, ref_logps, chunk_bytes, validate, packed,
                                          supervised)
    _validation.check_sequence(p)
    rows, metrics = _rows(p, hidden, weight, bias, labels, ref_logps, chunk_bytes, None, tm)
    return (losses.mean_sums(rows) if normalize else rows.s), rows.policy, metrics


@options(IPO)
def ipo(hidden, weight, labels, ref_logps, *, bias=None, clip, beta, temperature, ignore_index, chunk_bytes=CHUNK_BYTES,
        validate=True, supervised=None, packed=None):
    """Humanline IPO from ``hidden [2P, T, D]``; as :func:`humanline_kernels.losses.ipo`."""
    hidden, weight, bias = _autocast(hidden, weight, bias)
    p = IPO(clip=clip, beta=beta, temperature=temperature, ignore_index=ignore_index)
    labels, ref_logps, tm = _linear_level(p, hidden, weight, bias, labels, ref_logps, chunk_bytes, validate, packed,
                                          supervised)
    _validation.check_ipo(p, labels.shape[0])
    return losses.from_rows(p, *_rows(p, hidden, weight, bias, labels, ref_logps, chunk_bytes, None, tm))


@options(SimPO)
def simpo(hidden, weight, labels, *, bias=None, clip, beta, gamma_beta_ratio, temperature, ignore_index,
          chunk_bytes=CHUNK_BYTES, validate=True, supervised=None, packed=None):
    """Humanline SimPO from ``hidden [2P, T, D]`` (a reference of 0); as :func:`humanline_kernels.losses.simpo`."""
    hidden, weight, bias = _autocast(hidden, weight, bias)
    p = SimPO(clip=clip, beta=beta, gamma_beta_ratio=gamma_beta_ratio, temperature=temperature,
              ignore_index=ignore_index)
    labels, _, tm = _linear_level(p, hidden, weight, bias, labels, None, chunk_bytes, validate, packed, supervised)
    _validation.check_simpo(p, labels.shape[0])
    return losses.from_rows(p, *_rows(p, hidden, weight, bias, labels, None, chunk_bytes, None, tm))


@options(SLiC)
def slic(hidden, weight, labels, *, bias=None, clip, beta, lambda_coef, temperature, ignore_index,
         chunk_bytes=CHUNK_BYTES, validate=True, supervised=None, packed=None):
    """Humanline SLiC from ``hidden [2P, T, D]`` (a reference of 0); as :func:`humanline_kernels.losses.slic`."""
    hidden, weight, bias = _autocast(hidden, weight, bias)
    p = SLiC(clip=clip, beta=beta, lambda_coef=lambda_coef, temperature=temperature, ignore_index=ignore_index)
    labels, _, tm = _linear_level(p, hidden, weight, bias, labels, None, chunk_bytes, validate, packed, supervised)
    _validation.check_slic(p, labels.shape[0])
    return losses.from_rows(p, *_rows(p, hidden, weight, bias, labels, None, chunk_bytes, None, tm))


# -------------------------------------------------------------------------------------------------------- losses
class _LinearLoss(torch.autograd.Function):
    """``(loss, metrics [K])`` of the loss ``p`` (``inputs``: its inputs, flattened) with ``dh``, ``dW``, ``db``
    formed in the forward; the backward scales them by ``grad_output``. ``kernels``: the Triton kernels or their
    eager twins; ``need``: which of the three gradients to form (none without grad). The chunks
    (:func:`~humanline_kernels.ops.linear.loss_chunks`) each hold what their coefficients need.

    Per-token results (``val``, ``coef``, ``lse``, ``aux``) live in whole-batch ``[B, T]`` buffers; each chunk's
    logits live in one reused ``[n, V]`` buffer that the row kernels address through the chunk's token ranges.
    Per chunk:

    * GRPO (row weights ``w_b = d loss / d val`` from the labels, one finalize launch before the chunks): the lm_head
      GEMM; the token-terms kernel, which also writes ``dL/dz`` in place (``grad_out``); the ``dh`` and ``dW`` GEMMs.
    * DPO / KTO (``w`` of a pair or row needs its whole sum, known once the chunk's row kernel ran): the GEMM; the
      token-terms kernel; the finalize kernel over the chunk's pairs / rows (``span``), giving their ``w``; the
      backward kernel in place (``dL/dz = w_b coef (onehot - softmax) / T``); the ``dh`` and ``dW`` GEMMs.

    Then one finalize launch over the whole batch gives the loss and the metrics (skipped for DPO / KTO in one
    chunk: the chunk's finalize was the whole batch's). A DPO chunk of some of the pairs has two token ranges
    (chosen rows, rejected partners), gathered for one lm_head GEMM and one ``dW`` accumulation. KTO: the first
    chunk's finalize finds the baseline ``z0`` from the KL rows (its ``kl`` metric); later launches read it from
    there.
    """

    @staticmethod
    def forward(ctx, p, chunk_bytes, kernels, need, tm, hidden, weight, bias, labels, ref, *inputs):
        impl = _impl(kernels)
        B, T = labels.shape
        max_rows = linear.max_rows_for(weight.shape[0], hidden.dtype, chunk_bytes)
        chunks = linear.loss_chunks(p.name, B, T, max_rows) if tm is None else linear.map_chunks(p.name, tm, max_rows)
        h2 = hidden.reshape(-1, hidden.shape[-1])
        grad, grpo = any(need), p.name == "grpo"
        f = dict(dtype=_acc(ref), device=hidden.device)
        out = _planes(p, B, T, f, tm, kernels)
        val, coef, lse, _ = out
        dh, dw, db = linear.alloc_grads(h2, weight, bias, chunks, need, _sparse(tm, h2)) if grad else (None, None, None)
        # the per-chunk launches read these whole-batch inputs as they are: cast and made contiguous once per call
        ref = ref.to(f["dtype"]).contiguous()
        inp = p.Inputs(*(None if t is None else (t.to(f["dtype"]) if t.is_floating_point() else t).contiguous()
                         for t in inputs))
        finalize = impl.FINALIZE[p.name]
        w = impl.grpo_finalize(None, None, labels, p, inp)[2] if grpo and grad else None
        buf, wt = linear.chunks_buffer(chunks, weight.shape[0], hidden.dtype, hidden.device), weight.t()
        gbuf = linear.gather_buffer(chunks, h2)
        whole = len(chunks) == 1  # a DPO / KTO chunk's finalize is then the whole batch's
        done = None  # (loss, metrics, w) of a finalize over the whole batch
        for i, segs in enumerate(chunks):
            z = linear.chunk_logits(buf, h2, wt, bias, segs, gbuf)
            impl.token_terms(z, labels, ref, p, inp, out=out, segs=linear.kernel_segs(segs), row_weight=w,
                             grad_out=z if grpo and grad else None)
            if not grad:
                continue
            if not grpo:
                res = finalize(val, out[3], labels, p, inp, None if whole else linear.span(p.name, segs, T))
                if p.name == "kto" and inp.z0 is None:  # the baseline found once, by the first chunk's launch
                    inp = inp._replace(z0=res[1][0], kl_logps=None, kl_ref_logps=None, kl_mask=None)
                done = res if whole else None
                impl.logprobs_bwd(z, labels, lse, coef, p.temperature, p.ignore_index, out=z, row_weight=res[2],
                                  segs=linear.kernel_segs(segs))
            linear.grads(h2, weight, segs, z, dh, dw, db, first=i == 0, gbuf=gbuf)
        loss, met, w = done if done is not None else finalize(val, out[3], labels, p, inp)
        ctx.grads = (dh, dw, db)  # formed here; the inputs themselves are not kept
        ctx.meta = (hidden.shape, weight.dtype, None if bias is None else bias.dtype, len(inputs),
                    impl if kernels else None)
        # a reference (advantages, ...) that requires grad: what its gradient needs (the loss detached: an output
        # kept on ctx would be a reference cycle)
        owed = _owed(ctx, p, 9)
        ctx.side = (p, owed, labels, out[3], ref, tuple(inp), loss.detach(), w,
                    [None if t is None else t.dtype for t in inputs]) if owed else None
        ctx.mark_non_differentiable(met)
        ctx.set_materialize_grads(False)
        return loss, met

    @staticmethod
    def backward(ctx, go, _grad_met):
        h_shape, _w_dtype, b_dtype, n, impl = ctx.meta
        if go is None:
            return (None,) * (10 + n)
        if ctx.grads is None:
            raise RuntimeError("Trying to backward through the fused-linear loss a second time: its dh and dW were "
                               "handed to the first backward. Pass retain_graph=True to the first one.")
        dh, dw, db = ctx.grads
        # (dh times go by torch: a 0-d go does not promote dh)
        if _graph_kept():  # a later backward reads them again: new tensors
            dh, dw = None if dh is None else dh * go, None if dw is None else dw.clone()
        else:  # handed over, scaled in place; with ctx's reference gone, autograd takes them as .grad without a copy
            ctx.grads = None
            dh = None if dh is None else dh.mul_(go)
        if dw is not None and dw.numel():  # dW *= go: on the kernel path one Triton pass, skipped on the device
            if impl is not None:  # when go == 1 (no host sync); mul_ on the CPU scales bf16 by the fp32 go in fp32
                impl.scale_rows_(dw.view(1, *dw.shape), go.to(torch.float32))
            else:
                dw.mul_(go)
        dh = None if dh is None else dh.view(h_shape)
        db = _scaled(db, go, b_dtype, impl)
        more = (None,) * (1 + n)
        if ctx.side is not None:
            p, owed, labels, aux, ref, inputs, loss, w, dtypes = ctx.side
            more = _input_grads(p, owed, labels, aux, ref, inputs, loss, (go * w)[:, None], go)
            more = more[:1] + tuple(None if d is None else d.to(t) for d, t in zip(more[1:], dtypes))
        return (None,) * 5 + (dh, dw, db, None) + more


@options(GRPO)
def grpo(hidden, weight, labels, ref_logps, advantages, *, bias=None, clip, beta, epsilon_low, epsilon_high,
         kl_ref_logps=None, loss_type, normalizer, max_completion_length, temperature, ignore_index,
         chunk_bytes=CHUNK_BYTES, validate=True, supervised=None, packed=None):
    """Humanline GRPO from ``hidden [B, T, D]`` and ``weight [V, D]``; keywords and result of
    :func:`humanline_kernels.losses.grpo` plus ``bias`` and ``chunk_bytes``. Chunks are token ranges.

    ``supervised``: ranges ``[B, 2]`` on the host, per row (per packed sequence) the positions ``[start, end)``
    that may carry a label (TRL's completions): the lm_head GEMMs and the row kernels run on those positions only
    (6 D V flops a supervised token instead of a position), every other position counts as ignored and gets an
    exact 0 gradient. ``packed`` (:class:`~humanline_kernels.Packed`): a padding-free batch, ``hidden [N, D]`` (or
    ``[1, N, D]``), per-token tensors ``[N]``, advantages ``[S]`` or ``[N]`` (``[1, N]`` when ``N == S``, as ``[S]`` is
    one per sequence then); its boundaries are read on the host
    (pass ``cu_seqlens`` on the CPU). Both: docs/fused_linear.md, "Layouts"."""
    hidden, weight, bias = _autocast(hidden, weight, bias)
    p, norm = GRPO.of(clip=clip, beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
                      loss_type=loss_type, normalizer=normalizer,
                      max_completion_length=max_completion_length, temperature=temperature,
                      ignore_index=ignore_index)
    given = labels
    labels, ref_logps, tm = _linear_level(p, hidden, weight, bias, labels, ref_logps, chunk_bytes, validate, packed,
                                          supervised)
    inp = GRPOInputs(_layout.unpack_like(advantages, tm, given, True), _layout.unpack_like(kl_ref_logps, tm, given),
                     norm)
    _validation.check_grpo(p, labels.shape, ref_logps, inp)
    kernels = ops.use_kernels(hidden, ref_logps, kl_ref_logps)
    loss, met = _LinearLoss.apply(p, chunk_bytes, kernels, _need(hidden, weight, bias), tm, hidden, weight, bias,
                                  labels, *_distinct(ref_logps, *inp))
    return loss, named_metrics("grpo", met)


@options(DPO)
def dpo(hidden, weight, labels, ref_logps, *, bias=None, clip, beta, label_smoothing, loss_type, loss_weights,
        rpo_alpha, f_divergence_type, f_alpha_divergence_coef, ld_alpha, discopop_tau, use_weighting, temperature,
        ignore_index, chunk_bytes=CHUNK_BYTES, validate=True, supervised=None, packed=None):
    """Humanline DPO from ``hidden [2P, T, D]`` (chosen rows first; ``supervised`` / ``packed`` as for
    :func:`grpo`, packed: ``2P`` sequences, chosen first); keywords and result of
    :func:`humanline_kernels.losses.dpo` plus ``bias`` and ``chunk_bytes`` (WPO refused, as at the logits level).
    DPO and cDPO: chunks of whole pairs with the gradient formed in the forward (6 N D V flops); TRL's other loss
    types and options: the sequence-level primitive (:func:`sequence_logratios`, 8 N D V)."""
    hidden, weight, bias = _autocast(hidden, weight, bias)
    p = DPO(clip=clip, beta=beta, label_smoothing=label_smoothing, loss_type=loss_type, loss_weights=loss_weights,
            rpo_alpha=rpo_alpha, f_divergence_type=f_divergence_type, f_alpha_divergence_coef=f_alpha_divergence_coef,
            ld_alpha=ld_alpha, discopop_tau=discopop_tau, use_weighting=use_weighting, temperature=temperature,
            ignore_index=ignore_index)
    _validation.check_fused_dpo(p)
    labels, ref_logps, tm = _linear_level(p, hidden, weight, bias, labels, ref_logps, chunk_bytes, validate, packed,
                                          supervised, pairs=p.fast)
    mixture = _validation.check_dpo(p, labels.shape[0], ref_logps)
    _validation.check_fused_dpo(p, mixture[0])
    if not p.fast:
        tw = None if ld_alpha is None else _objectives.ld_weights(labels != ignore_index, ld_alpha)
        rows, metrics = _rows(p, hidden, weight, bias, labels, ref_logps, chunk_bytes, tw, tm)
        if "aot" in mixture[0]:  # clip is None and no LD weights here: the reference's sums are the policy's minus s
            rows = rows._replace(aot_policy=rows.policy, aot_reference=rows.policy - rows.s)
        return losses.from_rows(p, rows, metrics, mixture=mixture)
    loss, met = _LinearLoss.apply(p, chunk_bytes, ops.use_kernels(hidden, ref_logps), _need(hidden, weight, bias),
                                  tm, hidden, weight, bias, labels, ref_logps)
    return loss, named_metrics("dpo", met)


@options(KTO)
def kto(hidden, weight, labels, ref_logps, desirable, kl_logps=None, kl_ref_logps=None, kl_mask=None, *, bias=None,
        clip, beta, desirable_weight, undesirable_weight, loss_type, kl_estimate, temperature, ignore_index,
        chunk_bytes=CHUNK_BYTES, validate=True, supervised=None, packed=None, kl_packed=None):
    """Humanline KTO from ``hidden [B, T, D]``; the KL rows come as log-probs (``kl_logps``, ``kl_ref_logps``,
    ``kl_mask``) from a separate no-grad pass, e.g. :func:`token_logprobs_nograd`. Chunks hold whole rows. Same
    keywords and result as :func:`humanline_kernels.losses.kto`; ``supervised`` / ``packed`` as for :func:`grpo`,
    ``kl_packed`` the KL rows' own boundaries when they come packed."""
    hidden, weight, bias = _autocast(hidden, weight, bias)
    p = KTO(clip=clip, beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
            loss_type=loss_type, kl_estimate=kl_estimate, temperature=temperature, ignore_index=ignore_index)
    labels, ref_logps, tm = _linear_level(p, hidden, weight, bias, labels, ref_logps, chunk_bytes, validate, packed,
                                          supervised)
    kl_logps, kl_ref_logps, kl_mask = losses.kl_rows(kl_logps, kl_ref_logps, kl_mask, kl_packed)
    inp = KTOInputs(desirable, kl_logps, kl_ref_logps, kl_mask)
    _validation.check_kto(p, labels.shape[0], labels.device, inp)
    if loss_type != "kto":  # apo_zero_unpaired: a function of the sums alone
        return losses.from_rows(p, *_rows(p, hidden, weight, bias, labels, ref_logps, chunk_bytes, None, tm), inp)
    if losses.distributed() or kl_estimate != "halos":  # z0 known before any chunk runs (all-reduced across ranks)
        inp = inp._replace(z0=losses.kto_kl_baseline(kl_logps, kl_ref_logps, kl_mask, clip, ref_logps, kl_estimate))
    kernels = ops.use_kernels(hidden, ref_logps, kl_logps, kl_ref_logps)
    loss, met = _LinearLoss.apply(p, chunk_bytes, kernels, _need(hidden, weight, bias), tm, hidden, weight, bias,
                                  labels, *_distinct(ref_logps, *inp))
    return loss, named_metrics("kto", met)
