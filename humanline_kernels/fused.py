r"""Humanline losses and token log-probs straight from logits.

``logits [..., V]`` (bf16/fp16/fp32, last dimension contiguous, any other strides: a ``logits[:, :-1]`` view is
used as is), ``labels [...]`` int64 with ``ignore_index`` marking tokens that do not count. Each public function
checks its arguments once, builds its loss's params object (:mod:`humanline_kernels._params`) and decides once
(:func:`humanline_kernels.ops.use_kernels`): CUDA tensors (and CPU tensors under ``TRITON_INTERPRET=1``) go through
the Triton kernels (see ``docs/kernels.md``); other CPU tensors, fp64 logits and fp64 reference log-probs through
the eager path (chunked eager log-probs, :mod:`humanline_kernels.ops.logprobs.eager`, then
:func:`humanline_kernels.losses.compute`), which enters no custom op.

Kernel path of the losses: one pass over the logits gives, per token, the log-prob, the humanline clamp, the
loss term ``val`` and its derivative ``coef = d val / d logp`` (:mod:`humanline_kernels.ops.token_terms`). One more
launch, the loss's finalize kernel (:mod:`humanline_kernels.ops.finalize`), does the ``[B, T]`` tail: per-sequence
sums, the loss, the metrics and the row weights ``w = d loss / d val`` (tests pin both kernels and their eager twins
to :mod:`humanline_kernels.reference`). The backward is one launch (:mod:`humanline_kernels.ops.logprobs`) that
recomputes the softmax from the saved per-row logsumexp:
``dlogits = grad_loss * w[b] * coef * (onehot - softmax) / temperature``.

Extra keywords (not in the log-prob level): ``inplace_backward=True`` writes the logits' gradient into the logits'
own storage (zero extra memory; the logits must be an intermediate that nothing else uses afterwards, e.g. the
lm_head output; their version counter is bumped so a later use fails loudly instead of reading garbage).
GRPO's ``grad_in_forward=True`` forms the gradient during the forward pass, see :func:`grpo`.
``validate=False`` skips the label range check, the only check that synchronises with the device.
"""
from __future__ import annotations

import torch

from . import _validation as V
from . import losses, ops
from ._clip import DEFAULT_CLIP
from ._params import DPO, KTO, GRPOInputs, KTOInputs, NoInputs, Tokens
from .ops.constants import named_metrics
from .ops.logprobs import eager as logprobs_eager

__all__ = ["token_logprobs", "grpo", "dpo", "kto"]


def _kernels():
    """The kernel modules (they import Triton: only once a call has decided for the kernels)."""
    from .ops.finalize import kernel as finalize
    from .ops.logprobs import kernel as logprobs
    from .ops.token_terms import kernel as token_terms
    return logprobs, token_terms, finalize


def _as_3d(logits, labels):
    """View ``[..., V]`` as ``[B, T, V]`` without copying the 2-D and 3-D cases."""
    if logits.dim() == 2:
        return logits.unsqueeze(0), labels.unsqueeze(0)
    if logits.dim() == 3:
        return logits, labels
    return logits.reshape(-1, *logits.shape[-2:]), labels.reshape(-1, labels.shape[-1])


class _TokenLogprobs(torch.autograd.Function):
    """Per-token log-probs (and the detached entropy): the Triton kernels or their eager twin (``kernels``)."""

    @staticmethod
    def forward(ctx, p, return_entropy, inplace, kernels, logits, labels):
        LP = _kernels()[0] if kernels else logprobs_eager
        l3, y3 = _as_3d(logits, labels)
        logp, lse, ent = LP.logprobs_fwd(l3, y3, p.temperature, p.ignore_index, return_entropy)
        ctx.save_for_backward(logits, labels, lse)
        ctx.cfg = (p, inplace, LP)
        if return_entropy:
            ent = ent.view(labels.shape)
            ctx.mark_non_differentiable(ent)
        ctx.set_materialize_grads(False)  # no zero-filled gradient for the entropy
        return logp.view(labels.shape), ent

    @staticmethod
    def backward(ctx, grad_logp, _grad_ent):
        if grad_logp is None:
            return (None,) * 6
        logits, labels, lse = ctx.saved_tensors
        p, inplace, LP = ctx.cfg
        l3, y3 = _as_3d(logits, labels)
        d = LP.logprobs_bwd(l3, y3, lse, grad_logp.reshape(y3.shape), p.temperature, p.ignore_index,
                            out=l3 if inplace else None)
        if inplace and LP is logprobs_eager:  # (the kernel's launcher bumps it itself)
            torch.autograd.graph.increment_version(logits)
        # in place, ``d`` is ``l3``: a view of ``logits``, or a copy when ``[..., T, V]`` could not be flattened
        # without one (then the gradient lives in the copy, not in ``logits``)
        return None, None, None, None, d.view(logits.shape), None


def token_logprobs(logits, labels, *, temperature=1.0, ignore_index=-100, return_entropy=False,
                   inplace_backward=False, validate=True):
    """Per-token ``log_softmax(logits / temperature)[labels]`` in fp32, shaped like ``labels``, 0 where ignored.

    Differentiable with respect to ``logits``. With ``return_entropy=True`` returns ``(logps, entropy)``, the
    entropy detached. ``inplace_backward=True`` (opt-in) writes the gradient into ``logits``' own storage: the
    logits must not be used afterwards (their version counter is bumped). ``validate=False`` skips the label
    range check, the only check that synchronises with the device.
    """
    p = Tokens(temperature=temperature, ignore_index=ignore_index)
    V.check_logits(logits, labels, p, validate)
    kernels = ops.use_kernels(logits)
    logp, ent = _TokenLogprobs.apply(p, bool(return_entropy), bool(inplace_backward), kernels, logits, labels)
    return (logp, ent) if return_entropy else logp


class _FusedLoss(torch.autograd.Function):
    """``(loss, metrics [K])`` of the loss ``p`` on the kernel path: the row kernel (per-token ``val``, ``coef``),
    then the loss's finalize kernel (sums, loss, metrics and the row weights ``w = d loss / d val``); the backward
    is one launch: ``dlogits = grad_loss * w * coef * (onehot - softmax) / T``. ``inputs``: the loss's
    :attr:`~humanline_kernels._params.Loss.Inputs`, flattened."""

    @staticmethod
    def forward(ctx, p, inplace, logits, labels, ref, *inputs):
        LP, TT, FIN = _kernels()
        inp = p.Inputs(*inputs)
        val, coef, lse, aux = TT.token_terms(logits, labels, ref, p, inp)
        loss, met, w = FIN.FINALIZE[p.name](val, aux, labels, p, inp)
        ctx.save_for_backward(logits, labels, lse, coef, w)
        ctx.cfg = (p, inplace, len(inputs))
        ctx.mark_non_differentiable(met)
        ctx.set_materialize_grads(False)  # no zero-filled gradient for the metrics
        return loss, met

    @staticmethod
    def backward(ctx, grad_loss, _grad_met):
        p, inplace, n = ctx.cfg
        if grad_loss is None:
            return (None,) * (5 + n)
        logits, labels, lse, coef, w = ctx.saved_tensors
        d = _kernels()[0].logprobs_bwd(logits, labels, lse, coef, p.temperature, p.ignore_index,
                                       out=logits if inplace else None, row_weight=w, grad_loss=grad_loss)
        return (None, None, d) + (None,) * (2 + n)


class _GrpoGradInForward(torch.autograd.Function):
    """GRPO loss whose logits gradient is written during the forward; backward only scales it by grad_output.
    The row weights come first, from the labels (the finalize kernel without terms); the loss and metrics after."""

    @staticmethod
    def forward(ctx, p, inplace, logits, labels, ref, *inputs):
        _, TT, FIN = _kernels()
        inp = p.Inputs(*inputs)
        w = FIN.grpo_finalize(None, None, labels, p, inp)[2]
        grad = logits if inplace else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        val, _coef, _lse, aux = TT.token_terms(logits, labels, ref, p, inp, row_weight=w, grad_out=grad)
        loss, met, _w = FIN.grpo_finalize(val, aux, labels, p, inp)
        ctx.save_for_backward(grad)
        ctx.n = len(inputs)
        ctx.mark_non_differentiable(met)
        ctx.set_materialize_grads(False)
        return loss, met

    @staticmethod
    def backward(ctx, grad_loss, _grad_met):
        if grad_loss is None:
            return (None,) * (5 + ctx.n)
        (grad,) = ctx.saved_tensors
        # a device-side no-op when grad_loss == 1 (the usual case; no host sync to find out)
        _kernels()[0].scale_rows_(grad, grad_loss.to(torch.float32))
        return (None, None, grad) + (None,) * (2 + ctx.n)


def _distinct(*ts):
    """The tensors, a repeated one as a view of itself (free): Dynamo refuses the same tensor twice in the inputs
    of an autograd.Function (e.g. ``kl_ref_logps=ref_logps``)."""
    out = []
    for t in ts:
        # `is`, not id(): torch 2.11's Dynamo cannot trace id() of None or of a tensor made inside the graph
        if t is not None and any(t is u for u in out):
            t = t.view(t.shape)
        out.append(t)
    return out


def _eager(p, logits, labels, ref_logps, inp):
    """The eager path of a loss: eager differentiable log-probs, then the loss's math."""
    logps = _TokenLogprobs.apply(p, False, False, False, logits, labels)[0]
    return losses.compute(p, logps.to(ref_logps.dtype), ref_logps, labels != p.ignore_index, inp)


def grpo(logits, labels, ref_logps, advantages, *, clip=DEFAULT_CLIP, beta=0.0, epsilon_low=0.2, epsilon_high=0.2,
         kl_ref_logps=None, loss_type="dapo", normalizer=None, max_completion_length=None, temperature=1.0,
         ignore_index=-100, validate=True, grad_in_forward=False, inplace_backward=False):
    """Humanline GRPO from ``logits [B, T, V]``; same keywords and result as :func:`humanline_kernels.losses.grpo`.

    ``grad_in_forward=True`` (kernel path, when grad is enabled and ``logits`` requires it) writes
    ``d loss / d logits`` for ``grad_output = 1`` during the forward pass: GRPO's per-token term depends only on its
    own token and the aggregation weights ``d loss / d L_t`` come from the mask alone, so this is exact for every
    ``loss_type``. The backward multiplies the stored gradient by ``grad_output`` in place with a kernel that
    reads ``grad_output`` on the device and does nothing when it is 1 (no host sync, no extra pass in the usual
    case). The gradient buffer is new (``inplace_backward=False``) or the logits themselves (``True``: the
    logits are overwritten already during the forward). Backward may then run only once for this loss.
    """
    p, norm = losses.grpo_params(clip=clip, beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
                                 loss_type=loss_type, normalizer=normalizer,
                                 max_completion_length=max_completion_length, temperature=temperature,
                                 ignore_index=ignore_index)
    inp = GRPOInputs(advantages, kl_ref_logps, norm)
    V.check_logits_loss(logits, labels, ref_logps, p, validate)
    V.check_grpo(p, labels.shape, ref_logps, inp)
    if not ops.use_kernels(logits, ref_logps, kl_ref_logps):
        return _eager(p, logits, labels, ref_logps, inp)
    gif = grad_in_forward and torch.is_grad_enabled() and logits.requires_grad
    fn = _GrpoGradInForward if gif else _FusedLoss
    loss, met = fn.apply(p, bool(inplace_backward), logits, labels, *_distinct(ref_logps, *inp))
    return loss, named_metrics("grpo", met)


def dpo(logits, labels, ref_logps, *, clip=DEFAULT_CLIP, beta=0.1, label_smoothing=0.0, temperature=1.0,
        ignore_index=-100, validate=True, inplace_backward=False):
    """Humanline DPO from ``logits [2P, T, V]``; same keywords and result as :func:`humanline_kernels.losses.dpo`."""
    p = DPO(clip=clip, beta=beta, label_smoothing=label_smoothing, temperature=temperature,
            ignore_index=ignore_index)
    V.check_logits_loss(logits, labels, ref_logps, p, validate)
    V.check_dpo(p, labels.shape[0])
    if not ops.use_kernels(logits, ref_logps):
        return _eager(p, logits, labels, ref_logps, NoInputs())
    loss, met = _FusedLoss.apply(p, bool(inplace_backward), logits, labels, ref_logps)
    return loss, named_metrics("dpo", met)


def kto(logits, labels, ref_logps, desirable, kl_logps=None, kl_ref_logps=None, kl_mask=None, *, clip=DEFAULT_CLIP,
        beta=0.1, desirable_weight=1.0, undesirable_weight=1.0, temperature=1.0, ignore_index=-100, validate=True,
        inplace_backward=False):
    """Humanline KTO from ``logits [B, T, V]``; the KL rows come as log-probs from a separate no-grad pass."""
    p = KTO(clip=clip, beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
            temperature=temperature, ignore_index=ignore_index)
    inp = KTOInputs(desirable, kl_logps, kl_ref_logps, kl_mask)
    V.check_logits_loss(logits, labels, ref_logps, p, validate)
    V.check_kto(p, labels.shape[0], labels.device, inp)
    if not ops.use_kernels(logits, ref_logps, kl_logps, kl_ref_logps):
        return _eager(p, logits, labels, ref_logps, inp)
    if losses.distributed():  # the baseline's sum and count are all-reduced across ranks first
        inp = inp._replace(z0=losses.kto_kl_baseline(kl_logps, kl_ref_logps, kl_mask, clip, ref_logps))
    loss, met = _FusedLoss.apply(p, bool(inplace_backward), logits, labels, *_distinct(ref_logps, *inp))
    return loss, named_metrics("kto", met)
