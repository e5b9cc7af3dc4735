r"""Humanline losses and token log-probs straight from logits.

``logits [..., V]`` (bf16/fp16/fp32, last dimension contiguous, any other strides: a ``logits[:, :-1]`` view is
used as is), ``labels [...]`` int64 with ``ignore_index`` marking tokens that do not count. Each public function
checks its arguments once, builds its loss's params object (:mod:`humanline_kernels._params`) and decides once
(:func:`humanline_kernels.ops.use_kernels`): CUDA tensors (and CPU tensors under ``TRITON_INTERPRET=1``) go through
the Triton kernels (see ``docs/kernels.md``); other CPU tensors, fp64 logits and fp64 reference log-probs through
the eager path (chunked eager log-probs, :mod:`humanline_kernels._eager`, then
:func:`humanline_kernels.losses.compute`), which enters no custom op.

Kernel path of the losses: one pass over the logits gives, per token, the log-prob, the humanline clamp, the
loss term ``val`` and its derivative ``coef = d val / d logp``, and, folded into the same launch for a dense batch
(:mod:`humanline_kernels.ops.fold`), the ``[B, T]`` tail of the loss (:mod:`humanline_kernels.ops.dpo`,
``.kto``, ``.grpo``): per-sequence sums, the loss, the metrics and the row weights ``w = d loss / d val`` (tests pin
the kernels and their eager twins to :mod:`humanline_kernels.reference`). The backward is one launch
(:mod:`humanline_kernels.ops.logprobs`) that
recomputes the softmax from the saved per-row logsumexp:
``dlogits = grad_loss * w[b] * coef * (onehot - softmax) / temperature``.

Extra keywords (not in the log-prob level): ``inplace_backward=True`` writes the logits' gradient into the logits'
own storage (zero extra memory; the logits must be an intermediate that nothing else uses afterwards, e.g. the
lm_head output; their version counter is bumped so a later use fails loudly instead of reading garbage).
GRPO's ``grad_in_forward=True`` forms the gradient during the forward pass, see :func:`grpo`.
``validate=False`` skips the label range check, the only check that synchronises with the device.
``process_group`` (every function): the logits are this rank's slice of the vocabulary (tensor parallelism,
:mod:`humanline_kernels._tp`, docs/tensor_parallel.md): the sharded log-probs, then the loss's math of the eager
path (:func:`humanline_kernels.losses.compute`) on them, the same on every rank; the backward is one launch a rank
over its slice, no collective (GRPO's ``grad_in_forward`` is not taken then: the gradient is formed in the
backward).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import _eager, _layout, _objectives, _tp, _validation, losses, ops
from ._params import (
    DPO,
    GRPO,
    IPO,
    KTO,
    DPOInputs,
    GRPOInputs,
    KTOInputs,
    Sequence,
    SimPO,
    SLiC,
    Tokens,
    named_metrics,
    options,
)
from .ops.constants import LOGP_PLANE, Terms

__all__ = ["token_logprobs", "grpo", "dpo", "kto", "sequence_logratios", "ipo", "simpo", "slic"]


_KERNELS = None


def _kernels():
    """:mod:`.ops.kernels`, the launchers (importing it imports Triton: only once a call has decided for the kernels;
    then held here, so a call does not pay the import; a backward takes its forward's from ctx). Traced by
    ``torch.compile``, imported without reading the holder: a guard on it would recompile the graph traced before
    the first import once the import set it."""
    global _KERNELS
    if torch.compiler.is_compiling():
        from .ops import kernels
        return kernels
    if _KERNELS is None:
        from .ops import kernels
        _KERNELS = kernels
    return _KERNELS


def _one_launch(tokens, labels):
    """Whether a loss's forward is one launch, the finalize folded into the row kernel (ops/fold.py): for
    a dense batch with tokens. A packed batch's token map keeps the row kernel and a finalize launch after it (its
    rows do not tile its sequences), as do the fused-linear chunks."""
    return tokens is None and labels.numel() > 0


def _as_3d(logits, labels):
    """View ``[..., V]`` as ``[B, T, V]`` without copying the 2-D and 3-D cases."""
    if logits.dim() == 2:
        return logits.unsqueeze(0), labels.unsqueeze(0)
    if logits.dim() == 3:
        return logits, labels
    return logits.reshape(-1, *logits.shape[-2:]), labels.reshape(-1, labels.shape[-1])


class _TokenLogprobs(torch.autograd.Function):
    """Per-token log-probs (and the entropy, both differentiable): the Triton kernels or their eager twin
    (``kernels``)."""

    @staticmethod
    def forward(ctx, p, return_entropy, inplace, kernels, sh, logits, labels):
        LP = _kernels() if kernels else _eager
        if sh is not None:  # this rank's slice of the vocabulary: its own labels, then the slices' stats combined
            labels, given = sh.labels, labels
        l3, y3 = _as_3d(logits, labels)
        logp, lse, ent = LP.logprobs_fwd(l3, y3, p.temperature, p.ignore_index, return_entropy)
        if sh is not None:
            logp, lse, ent = _tp.combine(sh, _as_3d(logits, given)[1], p.ignore_index, logp, lse, ent)
        ctx.save_for_backward(logits, labels, lse, ent)
        ctx.cfg = (p, inplace, LP)
        ctx.set_materialize_grads(False)  # no zero-filled gradient for an unused output
        if labels.dim() == 2:  # already shaped like the labels (a view is host work on every call)
            return logp, ent
        return logp.view(labels.shape), None if ent is None else ent.view(labels.shape)

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        if grad_logp is None and grad_ent is None:
            return (None,) * 7
        logits, labels, lse, ent = ctx.saved_tensors
        p, inplace, LP = ctx.cfg
        l3, y3 = _as_3d(logits, labels)
        g = grad_logp
        if g is None:
            g = torch.zeros_like(lse)
        elif y3 is not labels:  # shaped like the caller's labels: the eager backward indexes [B, T]
            g = g.reshape(y3.shape)
        if grad_ent is not None and y3 is not labels:  # (the entropy's too: 2-D logits crashed the eager twin)
            grad_ent = grad_ent.reshape(y3.shape)
        d = LP.logprobs_bwd(l3, y3, lse, g, p.temperature, p.ignore_index, out=l3 if inplace else None,
                            grad_entropy=grad_ent, entropy=ent)
        if inplace and LP is _eager:  # (the kernel's launcher bumps it itself)
            torch.autograd.graph.increment_version(logits)
        # in place, ``d`` is ``l3``: a view of ``logits``, or a copy when ``[..., T, V]`` could not be flattened
        # without one (then the gradient lives in the copy, not in ``logits``); handed back as a view, never as the
        # input tensor itself, and a new gradient of the caller's shape as it is
        if l3 is not logits or d is logits:
            d = d.view(logits.shape)
        return None, None, None, None, None, d, None


@options(Tokens)
def token_logprobs(logits, labels, *, temperature, ignore_index, return_entropy=False, inplace_backward=False,
                   validate=True, process_group=None):
    """Per-token ``log_softmax(logits / temperature)[labels]`` in fp32, shaped like ``labels``, 0 where ignored.

    Differentiable with respect to ``logits``. With ``return_entropy=True`` returns ``(logps, entropy)``, the
    entropy of ``softmax(logits / temperature)`` (0 where ignored), differentiable too (``dH/dz = -p (log p + H)``:
    an entropy bonus trains through it, as with TRL's head). ``inplace_backward=True`` (opt-in) writes the
    gradient into ``logits``' own storage: the logits must not be used afterwards (their version counter is
    bumped). ``validate=False`` skips the label range check, the only check that synchronises with the device.

    ``process_group`` (a ``torch.distributed.ProcessGroup``): ``logits [..., V_r]`` are this rank's contiguous slice
    of the vocabulary, slices in rank order (sizes may differ), ``labels`` the global ids, equal on every rank; the
    log-probs and entropy are the whole vocabulary's, equal on every rank, and the gradient is this slice's part of
    the unsharded one (the upstream gradient must be the same on every rank). Two all-gathers a call, none in the
    backward: docs/tensor_parallel.md.
    """
    p = Tokens(temperature=temperature, ignore_index=ignore_index)
    sharded = process_group is not None and _tp.check_group(process_group) > 1
    _validation.check_logits(logits, labels, p, validate, label_range=not sharded, return_entropy=return_entropy,
                             inplace_backward=inplace_backward)
    kernels = ops.use_kernels(logits)
    sh = _tp.shard(process_group, logits.shape[-1], labels, ignore_index, validate) if sharded else None
    logp, ent = _TokenLogprobs.apply(p, return_entropy, inplace_backward, kernels, sh, logits, labels)
    return (logp, ent) if return_entropy else logp


def _owed(ctx, p, at):
    """Which of a loss's other inputs want a gradient, ``(ref_logps, advantages, kl_ref_logps, normalizer)``: the
    autograd.Function's arguments from ``at`` on (the reference, then GRPO's inputs; KTO's KL rows get none, as in
    ``hk.reference``). None when none does: nothing more is kept for the backward then."""
    n = ctx.needs_input_grad
    grpo = p.mode == Terms.GRPO
    owed = (n[at], grpo and n[at + 1], grpo and n[at + 2], grpo and n[at + 3])
    return owed if any(owed) else None


def _input_grads(p, owed, labels, aux, ref, inputs, loss, g, grad_loss):
    """The gradients of ``(ref, *inputs)`` that the row kernels do not form (:func:`losses.input_grads`, at the
    policy log-probs the row kernel wrote in ``aux``); ``g = d loss / d val`` per row ``[B, 1]`` (grad_output
    included). A tensor normalizer of "dapo" / "bnpo" divides the loss: ``d loss / d normalizer = -loss /
    normalizer``."""
    inp = p.Inputs(*inputs) if p.mode == Terms.GRPO else None  # (only GRPO's inputs have gradients)
    d = losses.input_grads(p, aux[LOGP_PLANE[p.mode]], ref, labels != p.ignore_index, inp, g, owed[:3])
    out = [None if x is None else x.to(t.dtype) for x, t in zip(d, (ref, *inputs))] + [None] * len(inputs)
    if owed[3]:
        norm = inp.normalizer
        out[3] = (-grad_loss * loss / norm.reshape(())).to(norm.dtype).expand(norm.shape)
    return tuple(out[:1 + len(inputs)])


class _FusedLoss(torch.autograd.Function):
    """``(loss, metrics [K])`` of the loss ``p`` on the kernel path: the row kernel (per-token ``val``, ``coef``),
    then the loss's finalize kernel (sums, loss, metrics and the row weights ``w = d loss / d val``); the backward
    is one launch: ``dlogits = grad_loss * w * coef * (onehot - softmax) / T``, and, for a reference or advantages
    that require grad, small ``[B, T]`` ops (:func:`_input_grads`). ``inputs``: the loss's
    :attr:`~humanline_kernels._params.Loss.Inputs`, flattened."""

    @staticmethod
    def forward(ctx, p, inplace, tokens, logits, labels, ref, *inputs):
        impl = _kernels()
        inp = p.Inputs(*inputs)
        if _one_launch(tokens, labels):
            _val, coef, lse, aux, loss, met, w = impl.ONE_LAUNCH[p.name](logits, labels, ref, p, inp)
        else:
            val, coef, lse, aux = impl.token_terms(logits, labels, ref, p, inp, segs=tokens)
            loss, met, w = impl.FINALIZE[p.name](val, aux, labels, p, inp)
        owed = _owed(ctx, p, 5)
        ctx.save_for_backward(logits, labels, lse, coef, w, tokens, *((aux, ref, loss, *inputs) if owed else ()))
        ctx.cfg = (p, inplace, len(inputs), owed, impl)
        ctx.mark_non_differentiable(met)
        ctx.set_materialize_grads(False)  # no zero-filled gradient for the metrics
        return loss, met

    @staticmethod
    def backward(ctx, grad_loss, _grad_met):
        p, inplace, n, owed, impl = ctx.cfg
        if grad_loss is None:
            return (None,) * (6 + n)
        logits, labels, lse, coef, w, tokens, *side = ctx.saved_tensors
        more = (None,) * (1 + n)
        if owed:  # before the logits' gradient, which may overwrite them (not needed here: aux holds the log-probs)
            aux, ref, loss, *inputs = side
            more = _input_grads(p, owed, labels, aux, ref, inputs, loss, (grad_loss * w)[:, None], grad_loss)
        d = None
        if ctx.needs_input_grad[3]:
            d = impl.logprobs_bwd(logits, labels, lse, coef, p.temperature, p.ignore_index,
                                  out=logits if inplace else None, row_weight=w, grad_loss=grad_loss, segs=tokens)
        return (None, None, None, d, None) + more


class _GrpoGradInForward(torch.autograd.Function):
    """GRPO loss whose logits gradient is written during the forward; backward only scales it by grad_output.
    The row weights come first, from the labels (the finalize kernel without terms), except in one launch for the
    loss types whose rows share one weight (found in the kernel); the loss and metrics after (folded into the row
    kernel, or a finalize launch for a packed batch)."""

    @staticmethod
    def forward(ctx, p, inplace, tokens, logits, labels, ref, *inputs):
        impl = _kernels()
        inp = p.Inputs(*inputs)
        grad = logits if inplace else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        folded = _one_launch(tokens, labels)
        # on sm_90, where measured faster: the row held on chip by a thread-block cluster (ops/cluster.py)
        cluster = None
        if logits.device.type in impl.CLUSTER_DEVICES:
            cluster = impl.grpo_cluster(logits, labels, ref, p, inp, grad, tokens)
        if cluster is not None:
            aux, loss, met, w = cluster
        else:
            w = impl.grpo_finalize(None, None, labels, p, inp)[2] if p.loss_type == "grpo" or not folded else None
            if folded:
                _val, _coef, _lse, aux, loss, met, w = impl.grpo_loss(logits, labels, ref, p, inp, row_weight=w,
                                                                      grad_out=grad)
            else:
                val, _coef, _lse, aux = impl.token_terms(logits, labels, ref, p, inp, row_weight=w, grad_out=grad,
                                                         segs=tokens)
                loss, met, _w = impl.grpo_finalize(val, aux, labels, p, inp)
        owed = _owed(ctx, p, 5)
        ctx.save_for_backward(grad, *((labels, w, aux, ref, loss, *inputs) if owed else ()))
        ctx.cfg = (p, len(inputs), owed, impl)
        ctx.mark_non_differentiable(met)
        ctx.set_materialize_grads(False)
        return loss, met

    @staticmethod
    def backward(ctx, grad_loss, _grad_met):
        p, n, owed, impl = ctx.cfg
        if grad_loss is None:
            return (None,) * (6 + n)
        grad, *side = ctx.saved_tensors
        more = (None,) * (1 + n)
        if owed:
            labels, w, aux, ref, loss, *inputs = side
            more = _input_grads(p, owed, labels, aux, ref, inputs, loss, (grad_loss * w)[:, None], grad_loss)
        # a device-side no-op when grad_loss == 1 (the usual case; no host sync to find out)
        impl.scale_rows_(grad if grad.dim() == 3 else grad.unsqueeze(0), grad_loss.to(torch.float32))
        return (None, None, None, grad, None) + more


class _Sequences(torch.autograd.Function):
    """The sequence-level primitive on the kernel path: ``(s, policy_sums, counts, metrics [3])`` with
    ``s_b = sum_t m w Delta_hat`` (``w`` the token weights, or 1) and ``policy_sums_b = sum_t m l``: the row kernel,
    then the sums kernel. The backward is one launch: ``d l_t = grad_s[b] w coef + grad_policy[b]`` into the
    softmax backward."""

    @staticmethod
    def forward(ctx, p, inplace, tokens, logits, labels, ref, token_weights):
        impl = _kernels()
        val, coef, lse, aux = impl.token_terms(logits, labels, ref, p, segs=tokens)
        s, pol, n, met = impl.seq_finalize(val, aux, labels, p, token_weights)
        if token_weights is not None:
            coef = coef * token_weights.to(coef.dtype)
        owed = _owed(ctx, p, 5)
        ctx.save_for_backward(logits, labels, lse, coef, tokens, *((aux, ref, token_weights) if owed else ()))
        ctx.cfg = (p, inplace, owed, impl)
        ctx.mark_non_differentiable(n, met)
        ctx.set_materialize_grads(False)
        return s, pol, n, met

    @staticmethod
    def backward(ctx, grad_s, grad_pol, _grad_n, _grad_met):
        if grad_s is None and grad_pol is None:
            return (None,) * 7
        logits, labels, lse, coef, tokens, *side = ctx.saved_tensors
        p, inplace, owed, impl = ctx.cfg
        w = torch.zeros_like(lse[:, 0]) if grad_s is None else grad_s.contiguous()  # autograd may expand a [B] 1
        d_ref = None
        if owed and grad_s is not None:  # the policy sums do not depend on the reference
            aux, ref, tw = side
            g = w[:, None] if tw is None else w[:, None] * tw.to(w.dtype)
            d_ref = _input_grads(p, owed, labels, aux, ref, (), None, g, None)[0]
        add = None if grad_pol is None else grad_pol.contiguous()
        d = None
        if ctx.needs_input_grad[3]:
            d = impl.logprobs_bwd(logits, labels, lse, coef, p.temperature, p.ignore_index,
                                  out=logits if inplace else None, row_weight=w, row_add=add, segs=tokens)
        return None, None, None, d, None, d_ref, None


def _kernel_rows(p, logits, labels, ref_logps, inplace, token_weights=None, tokens=None):
    """``(Rows, metrics)`` of the sequence-level primitive on the kernel path (``ref_logps=None``: a reference of
    0; ``tokens``: a packed batch's token map)."""
    if ref_logps is None:
        ref_logps = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
    s, pol, n, met = _Sequences.apply(p, bool(inplace), tokens, logits, labels, ref_logps, token_weights)
    return _objectives.Rows(s, pol, n), named_metrics("sequence", met)


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


class _Sharded(NamedTuple):
    """A call's vocabulary split over ``group`` (:mod:`._tp`), with its ``inplace_backward`` and ``validate``."""

    group: object
    inplace: bool
    validate: bool


def _sharded(process_group, inplace_backward=False, validate=True):
    """The call's :class:`_Sharded`, or None: the whole vocabulary on this rank (no group, or a group of one)."""
    if process_group is None or _tp.check_group(process_group) == 1:  # (no call at all in the usual case)
        return None
    return _Sharded(process_group, inplace_backward, validate)


def _eager_logps(p, logits, labels, ref_logps, lay=None, tp=None):
    """Eager differentiable log-probs (fp64 for fp64 inputs) and the mask (``lay``: a packed batch's ``(map,
    packed labels)``: the log-probs of the stream, then moved to the padded rows). ``tp``: the logits are a
    vocabulary slice (:class:`_Sharded`): the log-probs are the whole vocabulary's, through the kernels where the
    logits take them."""
    y = labels if lay is None else lay[1].reshape(-1)
    if tp is None:
        logps = _TokenLogprobs.apply(p, False, False, False, None, logits, y)[0]
    else:
        sh = _tp.shard(tp.group, logits.shape[-1], y, p.ignore_index, tp.validate)
        logps = _TokenLogprobs.apply(p, False, tp.inplace, ops.use_kernels(logits), sh, logits, y)[0]
    if lay is not None:
        logps = _layout.unpack(logps, lay[0], 0.0)
    if ref_logps is not None:
        logps = logps.to(ref_logps.dtype)
    return logps, labels != p.ignore_index


def _eager_loss(p, logits, labels, ref_logps, inp, lay=None, tp=None):
    """The eager path of a loss: eager differentiable log-probs (``tp``: of a vocabulary slice), then the loss's
    math."""
    logps, mask = _eager_logps(p, logits, labels, ref_logps, lay, tp)
    return losses.compute(p, logps, ref_logps, mask, inp)


def _logits_level(p, logits, labels, ref_logps, packed, validate, tp=None, **flags):
    """The checked ``(logits, labels [B, T], ref_logps, lay)`` of a loss call (``flags``: its bool keywords): as
    given (``lay`` None), or of a packed batch (:class:`~humanline_kernels.Packed`): ``logits [N, V]`` as they are,
    the per-token tensors moved to the padded rows ``[S, T]`` (:func:`._layout.unpack`), ``lay = (map, packed
    labels)``. ``tp``: the logits are a vocabulary slice (the labels are checked against the whole vocabulary
    later, :func:`._tp.shard`)."""
    if packed is None:
        _validation.check_logits_loss(logits, labels, ref_logps, p, validate, label_range=tp is None, **flags)
        return logits, labels, ref_logps, None
    _layout.check_packed("logits", logits, labels, ref_logps, packed, p)
    _validation.check_logits(logits, labels, p, validate, label_range=tp is None, **flags)
    x = logits.reshape(-1, logits.shape[-1])
    tm = _layout.packed_map(packed, x.shape[0], x.device, validate=validate)
    ref = None if ref_logps is None else _layout.unpack(ref_logps, tm, 0.0)
    return x, _layout.unpack(labels, tm, p.ignore_index), ref, (tm, labels)


def _per_token(t, lay, per_sequence=False):
    """A per-token input (``[N]`` of a packed batch, shaped like its labels) on the padded rows; others as given
    (``per_sequence``: advantages, whose ``[S]`` is one per sequence even when ``N == S``)."""
    return t if lay is None else _layout.unpack_like(t, *lay, per_sequence)


def _tokens(lay):
    return None if lay is None else lay[0].plane


@options(GRPO)
def grpo(logits, labels, ref_logps, advantages, *, clip, beta, epsilon_low, epsilon_high, kl_ref_logps=None, loss_type,
         normalizer, max_completion_length, temperature, ignore_index, validate=True, grad_in_forward=False,
         inplace_backward=False, packed=None, process_group=None):
    """Humanline GRPO from ``logits [B, T, V]``; same keywords and result as :func:`humanline_kernels.losses.grpo`.
    ``packed`` (:class:`~humanline_kernels.Packed`): a padding-free batch, ``logits [N, V]`` (or ``[1, N, V]``)
    and per-token tensors ``[N]``, advantages ``[S]`` (one per sequence, also when ``N == S``) or ``[N]`` / ``[1, N]``
    (docs/fused_linear.md, "Layouts").

    ``grad_in_forward=True`` (kernel path, when grad is enabled and ``logits`` requires it) writes
    ``d loss / d logits`` for ``grad_output = 1`` during the forward pass: GRPO's per-token term depends only on its
    own token and the aggregation weights ``d loss / d L_t`` come from the mask alone, so this is exact for every
    ``loss_type``. The backward multiplies the stored gradient by ``grad_output`` in place with a kernel that
    reads ``grad_output`` on the device and does nothing when it is 1 (no host sync, no extra pass in the usual
    case). The gradient buffer is new (``inplace_backward=False``) or the logits themselves (``True``: the
    logits are overwritten already during the forward). Backward may then run only once for this loss. The option
    is never slower than not using it where measured: on a card, dtype and vocabulary for which a GPU run measured
    it slower than the default path (the tuned table's ``"grad_in_forward"`` section, listed in docs/kernels.md),
    the default path runs instead (the gradient formed in the backward; with ``inplace_backward=True`` the logits
    are then overwritten in the backward). On sm_90 cards where a GPU run measured it faster, a thread-block
    cluster kernel forms the gradient with the row held on chip; elsewhere the Triton kernel does (docs/kernels.md,
    "Dispatch"). With ``process_group`` (a vocabulary slice) it is not taken: the gradient is formed in the
    backward.
    """
    p, norm = GRPO.of(clip=clip, beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
                      loss_type=loss_type, normalizer=normalizer,
                      max_completion_length=max_completion_length, temperature=temperature,
                      ignore_index=ignore_index)
    tp = _sharded(process_group, inplace_backward, validate)
    logits, labels, ref_logps, lay = _logits_level(p, logits, labels, ref_logps, packed, validate, tp,
                                                   grad_in_forward=grad_in_forward, inplace_backward=inplace_backward)
    inp = GRPOInputs(_per_token(advantages, lay, True), _per_token(kl_ref_logps, lay), norm)
    _validation.check_grpo(p, labels.shape, ref_logps, inp)
    if tp is not None or not ops.use_kernels(logits, ref_logps, kl_ref_logps):
        return _eager_loss(p, logits, labels, ref_logps, inp, lay, tp)
    # where a GPU run measured the option slower than not using it, the default path runs (the tuned table)
    gif = (grad_in_forward and torch.is_grad_enabled() and logits.requires_grad
           and _kernels().grad_in_forward_entry(logits) != "default")
    fn = _GrpoGradInForward if gif else _FusedLoss
    loss, met = fn.apply(p, inplace_backward, _tokens(lay), logits, labels, *_distinct(ref_logps, *inp))
    return loss, named_metrics("grpo", met)


@options(DPO)
def dpo(logits, labels, ref_logps, *, clip, beta, label_smoothing, loss_type, loss_weights, rpo_alpha,
        f_divergence_type, f_alpha_divergence_coef, ld_alpha, discopop_tau, use_weighting, temperature, ignore_index,
        validate=True, inplace_backward=False, packed=None, process_group=None):
    """Humanline DPO from ``logits [2P, T, V]`` (or a packed batch of ``2P`` sequences, chosen first: ``packed``,
    as for :func:`grpo`); same keywords and result as :func:`humanline_kernels.losses.dpo`
    (WPO's ``use_weighting`` is refused: it needs each token's ``log sum p^2``). DPO and cDPO run in the DPO
    finalize kernel; TRL's other loss types and options on the sequence-level primitive (:func:`sequence_logratios`)
    and the batch math of :mod:`humanline_kernels._objectives`."""
    p = DPO(clip=clip, beta=beta, label_smoothing=label_smoothing, loss_type=loss_type, loss_weights=loss_weights,
            rpo_alpha=rpo_alpha, f_divergence_type=f_divergence_type, f_alpha_divergence_coef=f_alpha_divergence_coef,
            ld_alpha=ld_alpha, discopop_tau=discopop_tau, use_weighting=use_weighting, temperature=temperature,
            ignore_index=ignore_index)
    _validation.check_fused_dpo(p)
    tp = _sharded(process_group, inplace_backward, validate)
    logits, labels, ref_logps, lay = _logits_level(p, logits, labels, ref_logps, packed, validate, tp,
                                                   inplace_backward=inplace_backward)
    mixture = _validation.check_dpo(p, labels.shape[0], ref_logps)
    _validation.check_fused_dpo(p, mixture[0])
    if tp is not None or not ops.use_kernels(logits, ref_logps):
        return _eager_loss(p, logits, labels, ref_logps, DPOInputs(), lay, tp)
    if p.fast:
        loss, met = _FusedLoss.apply(p, inplace_backward, _tokens(lay), logits, labels, ref_logps)
        return loss, named_metrics("dpo", met)
    mask = labels != ignore_index
    tw = None if ld_alpha is None else _objectives.ld_weights(mask, ld_alpha)
    rows, metrics = _kernel_rows(p, logits, labels, ref_logps, inplace_backward, tw, _tokens(lay))
    if "aot" in mixture[0]:  # clip is None and no LD weights here: the reference's sums are the policy's minus s
        rows = rows._replace(aot_policy=rows.policy, aot_reference=rows.policy - rows.s)
    return losses.from_rows(p, rows, metrics, mixture=mixture)


@options(KTO)
def kto(logits, labels, ref_logps, desirable, kl_logps=None, kl_ref_logps=None, kl_mask=None, *, clip, beta,
        desirable_weight, undesirable_weight, loss_type, kl_estimate, temperature, ignore_index, validate=True,
        inplace_backward=False, packed=None, kl_packed=None, process_group=None):
    """Humanline KTO from ``logits [B, T, V]``; the KL rows come as log-probs from a separate no-grad pass. Same
    keywords and result as :func:`humanline_kernels.losses.kto`. ``packed`` / ``kl_packed``: the batch / the KL
    rows packed (as for :func:`grpo`; the KL rows ``[N_kl]`` with boundaries of their own)."""
    p = KTO(clip=clip, beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
            loss_type=loss_type, kl_estimate=kl_estimate, temperature=temperature, ignore_index=ignore_index)
    tp = _sharded(process_group, inplace_backward, validate)
    logits, labels, ref_logps, lay = _logits_level(p, logits, labels, ref_logps, packed, validate, tp,
                                                   inplace_backward=inplace_backward)
    kl_logps, kl_ref_logps, kl_mask = losses.kl_rows(kl_logps, kl_ref_logps, kl_mask, kl_packed)
    inp = KTOInputs(desirable, kl_logps, kl_ref_logps, kl_mask)
    _validation.check_kto(p, labels.shape[0], labels.device, inp)
    if tp is not None or not ops.use_kernels(logits, ref_logps, kl_logps, kl_ref_logps):
        return _eager_loss(p, logits, labels, ref_logps, inp, lay, tp)
    if loss_type != "kto":  # apo_zero_unpaired: a function of the sums alone
        rows = _kernel_rows(p, logits, labels, ref_logps, inplace_backward, None, _tokens(lay))
        return losses.from_rows(p, *rows, inp)
    if losses.distributed() or kl_estimate != "halos":  # the finalize kernel finds HALOs' baseline on one rank only
        inp = inp._replace(z0=losses.kto_kl_baseline(kl_logps, kl_ref_logps, kl_mask, clip, ref_logps, kl_estimate))
    loss, met = _FusedLoss.apply(p, inplace_backward, _tokens(lay), logits, labels,
                                 *_distinct(ref_logps, *inp))
    return loss, named_metrics("kto", met)


@options(Sequence)
def sequence_logratios(logits, labels, ref_logps, *, clip, normalize, temperature, ignore_index, validate=True,
                       inplace_backward=False, packed=None, process_group=None):
    """The sequence-level primitive from ``logits [B, T, V]``: ``(s [B], policy_sums [B], metrics)``, as
    :func:`humanline_kernels.losses.sequence_logratios` (``ref_logps=None``: a reference of 0). Kernel path: the
    row kernel and one sums kernel forward, one launch backward, whatever loss is built on the sums. ``packed``:
    a padding-free batch (as for :func:`grpo`), one sum per sequence."""
    p = Sequence(clip=clip, normalize=normalize, temperature=temperature, ignore_index=ignore_index)
    tp = _sharded(process_group, inplace_backward, validate)
    logits, labels, ref_logps, lay = _logits_level(p, logits, labels, ref_logps, packed, validate, tp,
                                                   inplace_backward=inplace_backward)
    _validation.check_sequence(p)
    if tp is None and ops.use_kernels(logits, ref_logps):
        rows, metrics = _kernel_rows(p, logits, labels, ref_logps, inplace_backward, None, _tokens(lay))
    else:
        logps, mask = _eager_logps(p, logits, labels, ref_logps, lay, tp)
        rows, metrics = losses.sequence_rows(logps, ref_logps, mask, clip)
    return (losses.mean_sums(rows) if normalize else rows.s), rows.policy, metrics


@options(IPO)
def ipo(logits, labels, ref_logps, *, clip, beta, temperature, ignore_index, validate=True, inplace_backward=False,
        packed=None, process_group=None):
    """Humanline IPO from ``logits [2P, T, V]`` (or ``packed``, as for :func:`grpo`); as
    :func:`humanline_kernels.losses.ipo`."""
    p = IPO(clip=clip, beta=beta, temperature=temperature, ignore_index=ignore_index)
    tp = _sharded(process_group, inplace_backward, validate)
    logits, labels, ref_logps, lay = _logits_level(p, logits, labels, ref_logps, packed, validate, tp,
                                                   inplace_backward=inplace_backward)
    _validation.check_ipo(p, labels.shape[0])
    if tp is not None or not ops.use_kernels(logits, ref_logps):
        return _eager_loss(p, logits, labels, ref_logps, None, lay, tp)
    return losses.from_rows(p, *_kernel_rows(p, logits, labels, ref_logps, inplace_backward, None, _tokens(lay)))


@options(SimPO)
def simpo(logits, labels, *, clip, beta, gamma_beta_ratio, temperature, ignore_index, validate=True,
          inplace_backward=False, packed=None, process_group=None):
    """Humanline SimPO from ``logits [2P, T, V]`` (a reference of 0; or ``packed``, as for :func:`grpo`); as
    :func:`humanline_kernels.losses.simpo`."""
    p = SimPO(clip=clip, beta=beta, gamma_beta_ratio=gamma_beta_ratio, temperature=temperature,
              ignore_index=ignore_index)
    tp = _sharded(process_group, inplace_backward, validate)
    logits, labels, _, lay = _logits_level(p, logits, labels, None, packed, validate, tp,
                                           inplace_backward=inplace_backward)
    _validation.check_simpo(p, labels.shape[0])
    if tp is not None or not ops.use_kernels(logits):
        return _eager_loss(p, logits, labels, None, None, lay, tp)
    return losses.from_rows(p, *_kernel_rows(p, logits, labels, None, inplace_backward, None, _tokens(lay)))


@options(SLiC)
def slic(logits, labels, *, clip, beta, lambda_coef, temperature, ignore_index, validate=True, inplace_backward=False,
         packed=None, process_group=None):
    """Humanline SLiC from ``logits [2P, T, V]`` (a reference of 0; or ``packed``, as for :func:`grpo`); as
    :func:`humanline_kernels.losses.slic`."""
    p = SLiC(clip=clip, beta=beta, lambda_coef=lambda_coef, temperature=temperature, ignore_index=ignore_index)
    tp = _sharded(process_group, inplace_backward, validate)
    logits, labels, _, lay = _logits_level(p, logits, labels, None, packed, validate, tp,
                                           inplace_backward=inplace_backward)
    _validation.check_slic(p, labels.shape[0])
    if tp is not None or not ops.use_kernels(logits):
        return _eager_loss(p, logits, labels, None, None, lay, tp)
    return losses.from_rows(p, *_kernel_rows(p, logits, labels, None, inplace_backward, None, _tokens(lay)))
