r"""Humanline losses and token log-probs straight from hidden states and the lm_head weight (no ``[N, V]`` logits).

``hidden [..., D]`` (``[B, T, D]`` for the losses), ``weight [V, D]`` (same dtype and device), optional
``bias [V]``, ``labels`` shaped like ``hidden`` without ``D`` (int64, ``ignore_index`` marks tokens that do not
count). Logits are ``z = hidden @ weight.T + bias``; everything else is the math of :mod:`humanline_kernels.reference`.

How it runs (:mod:`humanline_kernels.ops.linear_chunks`): tokens go through the lm_head in chunks of at most
``chunk_bytes`` of logits (one reused buffer, input dtype). For the losses each chunk holds everything its loss
coefficients need -- single tokens for GRPO, whole rows for KTO (its KL rows enter only through the baseline
``z0``), whole chosen/rejected pairs (rows ``j`` and ``P + j``) for DPO -- so ``g = dL/dlogp`` is known inside the
chunk. On the kernel path (:func:`~humanline_kernels.ops.linear_chunks.run_kernels`) the row kernels and finalize
kernels of :mod:`humanline_kernels.fused` give it and write ``dL/dz`` in place into the buffer (nine launches
forward + backward in one chunk); elsewhere it comes from autograd on the small ``[rows, T]`` log-prob tensors
through the factored math of :mod:`humanline_kernels.losses`, with chunk means rescaled to whole-batch means.
``dh`` and the fp32 ``dW`` / ``db`` are formed during the forward pass; the backward only multiplies them by
``grad_output`` (device-side, no host sync). Flops: 6 N D V (no recomputed GEMM). The loss value and metrics are
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

import torch

from . import _validation as V
from . import losses, ops
from ._clip import DEFAULT_CLIP
from .ops import linear_chunks as LC

__all__ = ["token_logprobs", "token_logprobs_nograd", "grpo", "dpo", "kto", "CHUNK_BYTES"]

CHUNK_BYTES = 512 << 20  # logits buffer budget: 2048 tokens of a 128k vocabulary in bf16
_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


# ----------------------------------------------------------------------------------------------------- checks
def _autocast(hidden, weight, bias):
    """Under ``torch.autocast`` run the lm_head in the autocast dtype, as ``nn.Linear`` would (autograd casts back)."""
    if not (isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor)):
        return hidden, weight, bias
    dev = hidden.device.type
    try:
        on = torch.is_autocast_enabled(dev)
    except TypeError:  # pragma: no cover - torch without the device_type argument
        on = dev == "cuda" and torch.is_autocast_enabled()
    if not on or not hidden.is_floating_point():
        return hidden, weight, bias
    dt = torch.get_autocast_dtype(dev)
    with torch.autocast(dev, enabled=False):
        return hidden.to(dt), weight.to(dt), None if bias is None else bias.to(dt)


def _check(hidden, weight, bias, labels, *, temperature, ignore_index, chunk_bytes, validate):
    V.check_tensor("hidden", hidden, dtypes=_DTYPES)
    if hidden.dim() < 2:
        raise ValueError(f"hidden must have shape [..., D] with at least 2 dimensions, got {V._shape(hidden)}")
    D = hidden.shape[-1]
    V.check_tensor("weight", weight, ndim=2, dtypes=(hidden.dtype,), device=hidden.device)
    if weight.shape[1] != D:
        raise ValueError(f"weight must have shape [V, D] with D = hidden.shape[-1] = {D}, got {V._shape(weight)}")
    if weight.shape[0] == 0:
        raise ValueError("weight must have a non-empty vocabulary dimension (shape [V, D] with V > 0)")
    if bias is not None:
        V.check_tensor("bias", bias, shape=(weight.shape[0],), dtypes=(hidden.dtype,), device=hidden.device)
    V.check_tensor("labels", labels, dtypes=(torch.int64,), device=hidden.device)
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"labels must have shape {list(hidden.shape[:-1])} (hidden without D), "
                         f"got {V._shape(labels)}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    V.check_common(clip=None, temperature=temperature)
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    if validate:
        V.check_label_range(labels, weight.shape[0], ignore_index)


def _check_loss(hidden, weight, bias, labels, ref_logps, **kw):
    _check(hidden, weight, bias, labels, **kw)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must have shape [B, T, D] for a loss, got {V._shape(hidden)}")
    V.check_ref_logps(ref_logps, labels)


def _need(hidden, weight, bias):
    if not torch.is_grad_enabled():
        return (False, False, False)
    return (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)


def _scaled(acc, go, dtype):
    """``acc * grad_output`` cast to ``dtype`` in one pass (no fp32 temporary)."""
    if acc is None:
        return None
    out = torch.empty(acc.shape, dtype=dtype, device=acc.device)
    return torch.mul(acc, go, out=out)


# ---------------------------------------------------------------------------------------------- token log-probs
class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, cfg):
        temperature, ignore_index, return_entropy, rows = cfg
        h2, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        logp, lse, ent, *_ = LC.run(h2, weight, bias, y, LC.token_chunks(h2.shape[0], rows),
                                    temperature=temperature, ignore_index=ignore_index, return_entropy=return_entropy)
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.cfg = cfg
        ent = None if ent is None else ent.view(labels.shape)
        if ent is not None:
            ctx.mark_non_differentiable(ent)
        return logp.view(labels.shape), ent

    @staticmethod
    def backward(ctx, grad_logp, _grad_ent):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        temperature, ignore_index, _, rows = ctx.cfg
        h2, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        g = grad_logp.reshape(-1)
        need = ctx.needs_input_grad[:3]
        # recompute: the per-token grad_output is only known now
        *_, dh, dw, db = LC.run(h2, weight, bias, y, LC.token_chunks(h2.shape[0], rows), temperature=temperature,
                                ignore_index=ignore_index, coef=lambda segs, _lp: LC._gather(g, segs), lse=lse,
                                need=need)
        dh = None if dh is None else dh.view(hidden.shape)
        dw = None if dw is None else dw.to(weight.dtype)
        db = None if db is None else db.to(bias.dtype)
        return dh, dw, db, None, None


def token_logprobs(hidden, weight, labels, *, bias=None, temperature=1.0, ignore_index=-100, return_entropy=False,
                   chunk_bytes=CHUNK_BYTES, validate=True):
    """fp32 ``log_softmax((hidden @ weight.T + bias) / temperature)[labels]`` shaped like ``labels``, 0 where ignored.

    Differentiable with respect to ``hidden``, ``weight`` and ``bias`` (the backward recomputes the lm_head GEMM
    chunk by chunk). With ``return_entropy=True`` returns ``(logps, entropy)``, the entropy detached. Under
    ``torch.no_grad()`` (or when nothing requires grad) nothing is saved. ``chunk_bytes`` bounds the logits
    buffer; ``validate=False`` skips the label range check (the only host sync).
    """
    hidden, weight, bias = _autocast(hidden, weight, bias)
    _check(hidden, weight, bias, labels, temperature=temperature, ignore_index=ignore_index,
           chunk_bytes=chunk_bytes, validate=validate)
    rows = LC.max_rows_for(weight.shape[0], hidden.dtype, chunk_bytes)
    cfg = (float(temperature), ignore_index, bool(return_entropy), rows)
    if any(_need(hidden, weight, bias)):
        logp, ent = _LinearLogprobs.apply(hidden, weight, bias, labels, cfg)
    else:
        logp, _, ent, *_ = LC.run(hidden.reshape(-1, hidden.shape[-1]), weight, bias, labels.reshape(-1),
                                  LC.token_chunks(labels.numel(), rows), temperature=cfg[0],
                                  ignore_index=ignore_index, return_entropy=cfg[2])
        logp = logp.view(labels.shape)
        ent = None if ent is None else ent.view(labels.shape)
    return (logp, ent) if return_entropy else logp


@torch.no_grad()
def token_logprobs_nograd(hidden, weight, labels, **kw):
    """:func:`token_logprobs` for the reference model's forward: no autograd, no saved state."""
    return token_logprobs(hidden, weight, labels, **kw)


# -------------------------------------------------------------------------------------------------------- losses
class _LinearLoss(torch.autograd.Function):
    """Loss whose ``dh``, ``dW``, ``db`` were formed in the forward; the backward scales them by ``grad_output``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, job):
        loss, grads = _execute(hidden, weight, bias, job)
        ctx.grads = grads  # formed here; the inputs themselves are not kept
        ctx.meta = (hidden.shape, weight.dtype, None if bias is None else bias.dtype)
        return loss

    @staticmethod
    def backward(ctx, go):
        (dh, dw, db), (h_shape, w_dtype, b_dtype) = ctx.grads, ctx.meta
        dh = None if dh is None else (dh * go).view(h_shape)  # one kernel: a 0-d go does not promote dh
        return dh, _scaled(dw, go, w_dtype), _scaled(db, go, b_dtype), None


def _execute(hidden, weight, bias, job):
    """Run the chunks; return ``(loss, (dh, dW, db))`` and fill ``job['metrics']``."""
    if "run" in job:  # the kernel path: the job runs its own chunks
        loss, job["metrics"], grads = job["run"](hidden, weight, bias, job["need"])
        return loss, grads
    chunks, coef, finalize, need = job["chunks"], job["coef"], job["finalize"], job["need"]
    h2 = hidden.reshape(-1, hidden.shape[-1])
    logp, _, _, dh, dw, db = LC.run(h2, weight, bias, job["labels"].reshape(-1), chunks,
                                    temperature=job["temperature"], ignore_index=job["ignore_index"],
                                    coef=coef() if any(need) else None, need=need)
    loss, metrics = finalize(logp.view(job["labels"].shape))
    job["metrics"] = {k: v.detach() for k, v in metrics.items()}
    return loss.detach(), (dh, dw, db)


def _run_loss(hidden, weight, bias, labels, chunks, coef, finalize, temperature, ignore_index, run=None):
    job = {"chunks": chunks, "coef": coef, "finalize": finalize, "need": _need(hidden, weight, bias),
           "labels": labels, "temperature": float(temperature), "ignore_index": ignore_index}
    if run is not None:
        job["run"] = run
    if any(job["need"]):
        loss = _LinearLoss.apply(hidden, weight, bias, job)
    else:
        loss, _ = _execute(hidden, weight, bias, job)
    return loss, job["metrics"]


def _grad_wrt(fn, x):
    """``d fn(x) / d x`` for a small tensor ``x`` (autograd through the factored math of ``losses``)."""
    with torch.enable_grad():
        x = x.detach().requires_grad_()
        return torch.autograd.grad(fn(x).sum(), x)[0]


def _kernel_run(kind, labels, ref_logps, clip, temperature, ignore_index, terms, fin, chunks):
    """The ``run`` of a job on the kernel path (:func:`~humanline_kernels.ops.linear_chunks.run_kernels`)."""
    def run(hidden, weight, bias, need):
        return LC.run_kernels(kind, hidden.reshape(-1, hidden.shape[-1]), weight, bias, labels, chunks, need=need,
                              ref_logps=ref_logps, clip=clip, temperature=temperature, ignore_index=ignore_index,
                              terms=terms, fin=fin)
    return run


def _rows(x, segs, T):
    """The ``[rows, T]`` slice of a ``[B, T]`` tensor covered by a chunk's flat token ranges."""
    if T == 0:  # rows without tokens come as one chunk of every row
        return x
    return torch.cat([x[s // T:e // T] for s, e in segs]) if len(segs) > 1 else x[segs[0][0] // T:segs[0][1] // T]


def grpo(hidden, weight, labels, ref_logps, advantages, *, bias=None, clip=DEFAULT_CLIP, beta=0.0, epsilon_low=0.2,
         epsilon_high=0.2, kl_ref_logps=None, loss_type="dapo", normalizer=None, max_completion_length=None,
         temperature=1.0, ignore_index=-100, chunk_bytes=CHUNK_BYTES, validate=True):
    """Humanline GRPO from ``hidden [B, T, D]`` and ``weight [V, D]``; keywords and result of
    :func:`humanline_kernels.losses.grpo` plus ``bias`` and ``chunk_bytes``. Chunks are token ranges."""
    hidden, weight, bias = _autocast(hidden, weight, bias)
    _check_loss(hidden, weight, bias, labels, ref_logps, temperature=temperature, ignore_index=ignore_index,
                chunk_bytes=chunk_bytes, validate=validate)
    B, T = labels.shape
    V.check_common(clip=clip, beta=beta)
    V.check_grpo_args(B, labels.device, advantages, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
                      loss_type=loss_type, normalizer=normalizer, max_completion_length=max_completion_length)
    if kl_ref_logps is not None:
        V.check_tensor("kl_ref_logps", kl_ref_logps, shape=labels.shape, dtypes=(ref_logps.dtype,),
                       device=labels.device)
    dt = ref_logps.dtype
    terms = dict(beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high)
    agg = dict(loss_type=loss_type, normalizer=normalizer, max_completion_length=max_completion_length)
    kernels = ops.kernels_ok(hidden, ref_logps, kl_ref_logps)
    mask = None if kernels else labels != ignore_index  # eager path only: the kernels read the labels themselves

    def coef():
        # The aggregation is linear in the per-token terms: its gradient is each token's whole-batch weight.
        w = _grad_wrt(lambda x: losses.grpo_aggregate(x, mask, **agg), torch.zeros(B, T, dtype=dt,
                                                                                   device=mask.device))
        w, ref, m = w.reshape(-1, 1), ref_logps.reshape(-1, 1), mask.reshape(-1, 1)
        klr = (ref_logps if kl_ref_logps is None else kl_ref_logps).reshape(-1, 1)
        adv = advantages.to(dt).unsqueeze(1).expand(B, T).reshape(-1)  # one "row" per token

        def per_chunk(segs, lp):
            (s, e), = segs

            def weighted(x):
                clipped = losses.clip_log_ratio(x, ref[s:e], m[s:e], clip)[0]
                per_token = losses.grpo_token_terms(x, clipped, klr[s:e], adv[s:e], m[s:e], **terms)[0]
                return per_token * w[s:e]
            return _grad_wrt(weighted, lp.to(dt).unsqueeze(1)).view(-1)
        return per_chunk

    def finalize(logps):
        return losses.grpo(logps.to(dt), ref_logps, advantages, mask, clip=clip,
                           kl_ref_logps=kl_ref_logps, **terms, **agg)

    max_rows = LC.max_rows_for(weight.shape[0], hidden.dtype, chunk_bytes)
    if not kernels:
        chunks = LC.token_chunks(B * T, max_rows)
        return _run_loss(hidden, weight, bias, labels, chunks, coef, finalize, temperature, ignore_index)
    chunks = LC.grpo_chunks(B, T, max_rows)
    run = _kernel_run("grpo", labels, ref_logps, clip, temperature, ignore_index,
                      dict(terms, advantages=advantages, kl_ref_logps=kl_ref_logps), agg, chunks)
    return _run_loss(hidden, weight, bias, labels, chunks, coef, finalize, temperature, ignore_index, run)


def dpo(hidden, weight, labels, ref_logps, *, bias=None, clip=DEFAULT_CLIP, beta=0.1, label_smoothing=0.0,
        temperature=1.0, ignore_index=-100, chunk_bytes=CHUNK_BYTES, validate=True):
    """Humanline DPO from ``hidden [2P, T, D]`` (chosen rows first); keywords and result of
    :func:`humanline_kernels.losses.dpo` plus ``bias`` and ``chunk_bytes``. Chunks hold whole pairs."""
    hidden, weight, bias = _autocast(hidden, weight, bias)
    _check_loss(hidden, weight, bias, labels, ref_logps, temperature=temperature, ignore_index=ignore_index,
                chunk_bytes=chunk_bytes, validate=validate)
    B, T = labels.shape
    V.check_dpo_rows(B)
    V.check_common(clip=clip, beta=beta)
    V.check_dpo_args(label_smoothing)
    dt, P = ref_logps.dtype, B // 2
    kernels = ops.kernels_ok(hidden, ref_logps)
    mask = None if kernels else labels != ignore_index  # eager path only: the kernels read the labels themselves

    def coef():
        def per_chunk(segs, lp):
            ref, m = _rows(ref_logps, segs, T), _rows(mask, segs, T)
            k = ref.shape[0] // 2

            def chunk_loss(x):  # mean over the chunk's k pairs, rescaled to the mean over all P pairs
                s = losses.clip_log_ratio(x, ref, m, clip)[0].sum(dim=1)
                return losses.dpo_from_sums(s, beta=beta, label_smoothing=label_smoothing)[0] * (k / P)
            return _grad_wrt(chunk_loss, lp.to(dt).view(2 * k, T)).view(-1)
        return per_chunk

    def finalize(logps):
        return losses.dpo(logps.to(dt), ref_logps, mask, clip=clip, beta=beta, label_smoothing=label_smoothing)

    chunks = LC.pair_chunks(B, T, LC.max_rows_for(weight.shape[0], hidden.dtype, chunk_bytes))
    run = None
    if kernels:
        run = _kernel_run("dpo", labels, ref_logps, clip, temperature, ignore_index, {},
                          dict(beta=beta, label_smoothing=label_smoothing), chunks)
    return _run_loss(hidden, weight, bias, labels, chunks, coef, finalize, temperature, ignore_index, run)


def kto(hidden, weight, labels, ref_logps, desirable, kl_logps=None, kl_ref_logps=None, kl_mask=None, *,
        bias=None, clip=DEFAULT_CLIP, beta=0.1, desirable_weight=1.0, undesirable_weight=1.0, temperature=1.0,
        ignore_index=-100, chunk_bytes=CHUNK_BYTES, validate=True):
    """Humanline KTO from ``hidden [B, T, D]``; the KL rows come as log-probs (``kl_logps``, ``kl_ref_logps``,
    ``kl_mask``) from a separate no-grad pass, e.g. :func:`token_logprobs_nograd`. Chunks hold whole rows."""
    hidden, weight, bias = _autocast(hidden, weight, bias)
    _check_loss(hidden, weight, bias, labels, ref_logps, temperature=temperature, ignore_index=ignore_index,
                chunk_bytes=chunk_bytes, validate=validate)
    B, T = labels.shape
    V.check_common(clip=clip, beta=beta)
    V.check_kto_args(B, labels.device, desirable, kl_logps, kl_ref_logps, kl_mask,
                     desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)
    dt = ref_logps.dtype
    weights = dict(beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)
    kernels = ops.kernels_ok(hidden, ref_logps, kl_logps, kl_ref_logps)
    mask = None if kernels else labels != ignore_index  # eager path only: the kernels read the labels themselves
    z0 = None
    # z0 is known before any chunk runs (all-reduced across ranks under torch.distributed)
    if losses._distributed() or not kernels:
        z0 = losses.kto_kl_baseline(kl_logps, kl_ref_logps, kl_mask, clip, ref_logps)

    def coef():
        def per_chunk(segs, lp):
            ref, m, des = _rows(ref_logps, segs, T), _rows(mask, segs, T), _rows(desirable, segs, T)
            k = ref.shape[0]

            def chunk_loss(x):  # mean over the chunk's k rows, rescaled to the mean over all B rows
                s = losses.clip_log_ratio(x, ref, m, clip)[0].sum(dim=1)
                return losses.kto_from_sums(s, z0, des, **weights)[0] * (k / B)
            return _grad_wrt(chunk_loss, lp.to(dt).view(k, T)).view(-1)
        return per_chunk

    def finalize(logps):
        clipped, n_in, n = losses.clip_log_ratio(logps.to(dt), ref_logps, mask, clip)
        loss, metrics = losses.kto_from_sums(clipped.sum(dim=1), z0, desirable, **weights)
        metrics["unclipped_frac"] = losses._frac(n_in, n).detach()
        return loss, metrics

    chunks = LC.row_chunks(B, T, LC.max_rows_for(weight.shape[0], hidden.dtype, chunk_bytes))
    run = None
    if kernels:  # without torch.distributed the finalize kernel finds z0 from the KL rows itself
        run = _kernel_run("kto", labels, ref_logps, clip, temperature, ignore_index, {},
                          dict(weights, desirable=desirable, kl_logps=kl_logps, kl_ref_logps=kl_ref_logps,
                               kl_mask=kl_mask, z0=z0, clip=clip), chunks)
    return _run_loss(hidden, weight, bias, labels, chunks, coef, finalize, temperature, ignore_index, run)
