"""Eager twins of :mod:`.kernel`'s finalize launchers (same signatures and results).

Each goes through the losses' own math (:mod:`humanline_kernels.losses`): the loss and metrics of the per-row sums
(DPO, KTO) or of the per-token terms (GRPO), and the row weights ``w = d loss / d val`` by autograd on those small
tensors (every masked token of a row has the same weight). They are the fused-linear losses' path on CPU tensors
and fp64, and the per-op oracles of the tests.
"""
from __future__ import annotations

import torch

from ... import losses
from ..constants import METRICS


def _w(loss_fn, x):
    """``(loss, metrics, d loss / d x)`` of ``loss_fn(x) -> (loss, metrics)`` for a small tensor ``x``."""
    with torch.enable_grad():
        x = x.detach().requires_grad_()
        loss, metrics = loss_fn(x)
        (w,) = torch.autograd.grad(loss, x)
    return loss.detach(), metrics, w


def _pack(name, metrics, aux, mask, dtype):
    """The metrics tensor in :data:`METRICS` order, ``unclipped_frac`` from ``aux``'s first plane."""
    metrics = dict(metrics, unclipped_frac=losses._frac(aux[0].to(dtype).sum(), mask.sum().to(dtype)))
    return torch.stack([metrics[k].detach().reshape(()).to(dtype) for k in METRICS[name]])


def _rows(val, rows, scale, loss_fn):
    """``(loss, metrics, w)`` of the rows ``rows`` only (a fused-linear chunk: the loss is a mean over units, so
    the chunk's share is its own mean times ``scale``); ``w`` of the other rows is 0."""
    loss, m, w_rows = _w(lambda s: tuple(x * scale if i == 0 else x for i, x in enumerate(loss_fn(s))),
                         val[rows].sum(1))
    w = val.new_zeros(val.shape[0])
    w[rows] = w_rows
    return loss, m, w


def dpo_finalize(val, aux, labels, p, inp=None, span=None):
    """``span = (j0, j1)``: only those pairs (and their partners), as the kernel."""
    P = labels.shape[0] // 2
    j0, j1 = (0, P) if span is None else span
    rows = torch.cat([torch.arange(j0, j1), torch.arange(P + j0, P + j1)]).to(val.device)
    loss, m, w = _rows(val, rows, (j1 - j0) / P,
                       lambda s: losses.dpo_from_sums(s, beta=p.beta, label_smoothing=p.label_smoothing))
    return loss, _pack("dpo", m, aux, labels != p.ignore_index, val.dtype), w


def kto_finalize(val, aux, labels, p, inp, span=None):
    """``span = (b0, b1)``: only those rows, as the kernel."""
    B = labels.shape[0]
    b0, b1 = (0, B) if span is None else span
    z0 = inp.z0
    if z0 is None:
        z0 = losses.kto_kl_baseline(inp.kl_logps, inp.kl_ref_logps, inp.kl_mask, p.clip, val)
    weights = dict(beta=p.beta, desirable_weight=p.desirable_weight, undesirable_weight=p.undesirable_weight)
    rows = torch.arange(b0, b1, device=val.device)
    loss, m, w = _rows(val, rows, (b1 - b0) / B, lambda s: losses.kto_from_sums(
        s, z0.to(val.dtype).reshape(()), inp.desirable[rows], **weights))
    return loss, _pack("kto", m, aux, labels != p.ignore_index, val.dtype), w


def grpo_finalize(val, aux, labels, p, inp, span=None):
    """With ``val=None`` only ``w`` (loss and metrics 0), as the kernel; ``span`` is unused (as the kernel's)."""
    mask = labels != p.ignore_index
    norm = inp.normalizer if inp.normalizer is not None else p.normalizer
    agg = dict(loss_type=p.loss_type, normalizer=norm, max_completion_length=p.max_completion_length)
    terms = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device) if val is None else val
    loss, _, w = _w(lambda x: (losses.grpo_aggregate(x, mask, **agg), {}), terms)
    # the aggregation is linear in the terms: every token of a row has the row's weight (T = 0: no token needs one)
    w = w[:, 0] if w.shape[1] else w.new_zeros(w.shape[0])
    if val is None:
        return w.new_zeros(()), w.new_zeros(len(METRICS["grpo"])), w
    den = mask.sum().to(val.dtype).clamp(min=1)
    m = {"kl": aux[3].sum() / den, "clip_frac_low": aux[1].sum() / den, "clip_frac_high": aux[2].sum() / den}
    return loss.to(val.dtype), _pack("grpo", m, aux, mask, val.dtype), w.to(val.dtype)


FINALIZE = {"dpo": dpo_finalize, "kto": kto_finalize, "grpo": grpo_finalize}


def seq_finalize(val, aux, labels, p, token_weights=None):
    """The sequence-level primitive's per-row sums and metrics, as the kernel."""
    mask = labels != p.ignore_index
    v = val if token_weights is None else val * token_weights.to(val.dtype)
    s = torch.where(mask, v, 0.0).sum(1)
    pol = torch.where(mask, aux[1], 0.0).sum(1)
    n = mask.sum(1).to(val.dtype)
    n_in = torch.where(mask, aux[0], 0.0).sum()
    met = torch.stack([losses._frac(n_in, n.sum()), n.sum(), n_in])
    return s, pol, n, met
