r"""The eager twins of the kernels in :mod:`humanline_kernels.ops`: the same signatures and results in plain torch.

They are the CPU path (CPU tensors without ``TRITON_INTERPRET=1``) and the fp64 path of the logits and hidden-state
levels, and the tests' per-op oracle of each kernel. The token terms and the finalize tails are written with the
losses' own math (:mod:`humanline_kernels.losses`), so they live above the kernel layer, which imports nothing of
the package above it.

* **Log-probs** (:func:`logprobs_fwd`, :func:`logprobs_bwd`): per row with logits ``z`` and label ``y``,
  ``lse = logsumexp(z / T)``, ``logp = z_y / T - lse`` and optionally ``entropy = -sum(q log q)`` with
  ``q = softmax(z / T)``; backward ``dz = g * (onehot(y) - softmax(z / T)) / T``. Rows are processed in chunks, so
  no fp32 copy of the whole logits tensor is ever built (at most ``chunk_bytes``). Inputs are canonical 3-D views
  ``logits [B, T, V]`` (any batch/row strides, last stride 1), ``labels [B, T]``.
* **Token terms** (:func:`token_terms`): the per-token values from :func:`humanline_kernels.losses.clip_log_ratio`
  and :func:`humanline_kernels.losses.grpo_token_terms`; ``coef = d val / d logp`` by autograd on the small
  ``[B, T]`` tensors (each ``val[b, t]`` depends on ``logp[b, t]`` only, so the gradient of the sum is the
  elementwise derivative).
* **Finalize** (:func:`dpo_finalize`, :func:`kto_finalize`, :func:`grpo_finalize`, :func:`seq_finalize`): the loss
  and metrics of the per-row sums (DPO, KTO) or of the per-token terms (GRPO), and the row weights
  ``w = d loss / d val`` by autograd on those small tensors (every masked token of a row has the same weight).
"""
from __future__ import annotations

import torch

from . import losses
from ._params import METRICS
from .ops.constants import AUX_PLANES, Terms

CHUNK_BYTES = 64 << 20


# ------------------------------------------------------------------ log-probs
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


# ------------------------------------------------------------------ token terms
def _token_terms_rows(logits, labels, ref, p, adv, klref, w_tok, grad_out):
    """``(val, coef, lse, aux)`` of ``logits [B, T, V]``; ``adv`` and ``klref`` shaped like ``labels`` (GRPO),
    ``w_tok`` the per-token weight of the gradient written into ``grad_out``."""
    logp, lse, _ = logprobs_fwd(logits, labels, p.temperature, p.ignore_index, False)
    mask = labels != p.ignore_index
    ref = ref.to(logp.dtype)
    grpo = p.mode == Terms.GRPO
    with torch.enable_grad():
        lp = logp.detach().requires_grad_()
        val = losses.clip_log_ratio(lp, ref, mask, p.clip)[0]
        if grpo:
            klr = ref if klref is None else klref.to(logp.dtype)
            val, k3, low, high = losses.grpo_token_terms(lp, val, klr, adv, mask, beta=p.beta,
                                                         epsilon_low=p.epsilon_low, epsilon_high=p.epsilon_high)
        (coef,) = torch.autograd.grad(val.sum(), lp, allow_unused=True)
    coef = torch.zeros_like(logp) if coef is None else coef
    delta = logp - ref
    c = p.clip
    inside = mask if c is None else mask & (delta > c.log_eps_p) & (delta < c.log_eps_r)
    aux = torch.zeros((AUX_PLANES[p.mode], *logp.shape), dtype=logp.dtype, device=logp.device)
    aux[0] = inside
    if grpo:
        aux[1], aux[2], aux[3], aux[4] = low, high, k3, torch.where(mask, logp, 0.0)
    else:
        aux[1] = torch.where(mask, logp, 0.0)
    if grad_out is not None:
        logprobs_bwd(logits, labels, lse, coef * w_tok.to(coef.dtype), p.temperature, p.ignore_index, out=grad_out)
    return val.detach(), coef, lse, aux


def token_terms(logits, labels, ref_logps, p, inp=None, *, out=None, segs=None, row_weight=None, grad_out=None):
    """The twin of the token-terms launcher (same arguments and results): ``(val, coef, lse, aux)``."""
    grpo = p.mode == Terms.GRPO
    B, T = labels.shape
    adv = klref = None
    if grpo:
        adv = inp.advantages
        adv = adv if adv.dim() == 2 else adv.unsqueeze(1).expand(B, T)
        klref = inp.kl_ref_logps
    w_tok = None if row_weight is None else row_weight.unsqueeze(1).expand(B, T)
    if segs is None:
        res = _token_terms_rows(logits, labels, ref_logps, p, adv, klref, w_tok, grad_out)
        if out is None:
            return res
        for dst, src in zip(out, res):
            dst.copy_(src)
        return out
    # a fused-linear chunk or a packed batch: its [n, V] rows hold the tokens idx of the whole batch's [B, T] tensors
    idx = chunk_tokens(segs, logits.device)
    n, V = logits.shape
    if out is None:  # (zeros: the positions no row maps to)
        dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
        out = tuple(torch.zeros(shape, dtype=dt, device=logits.device)
                    for shape in ((B, T),) * 3 + ((AUX_PLANES[p.mode], B, T),))

    def pick(t):
        return None if t is None else t.reshape(-1)[idx].view(1, n)
    res = _token_terms_rows(logits.view(1, n, V), pick(labels), pick(ref_logps), p, pick(adv), pick(klref),
                            pick(w_tok), None if grad_out is None else grad_out.view(1, n, V))
    for dst, src in zip(out, res):
        dst.view(*dst.shape[:-2], -1)[..., idx] = src.view(*src.shape[:-2], -1).to(dst.dtype)  # (fp64 hidden states,
        # fp32 planes: as the dense path's copy_)
    return out


# ------------------------------------------------------------------ finalize
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
