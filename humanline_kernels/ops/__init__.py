"""Kernel dispatch: Triton for CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``), eager otherwise.

``logprobs_fwd`` / ``logprobs_bwd`` take canonical 3-D views ``logits [B, T, V]`` (last stride 1) and
``labels [B, T]``; see :mod:`humanline_kernels.ops.eager` for the math and the exact signatures.
``token_terms_fwd`` (per-token DPO/KTO/GRPO terms in the log-prob pass), ``grpo_fwd_grad`` (GRPO gradient
formed in the forward), ``grpo_row_weights`` and ``scale_rows_`` serve the fused losses; the ``torch.library``
registrations are in :mod:`.custom_ops`. fp64 logits always take the eager path.
"""
from __future__ import annotations

import importlib.util
import os

import torch

from . import eager

MODE_RATIO, MODE_GRPO = 1, 2  # token_terms_fwd modes: clipped log-ratio (DPO/KTO), GRPO term
# the metrics that the finalize ops return, in the order of their ``metrics`` tensor
METRICS = {
    "dpo": ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy", "unclipped_frac"),
    "kto": ("kl", "rewards_desirable", "rewards_undesirable", "unclipped_frac"),
    "grpo": ("unclipped_frac", "kl", "clip_frac_low", "clip_frac_high"),
}
GRPO_LOSS_TYPES = {"dapo": 0, "bnpo": 0, "grpo": 1, "dr_grpo": 2}


def named_metrics(kind, met):
    """The API's metrics dict of a finalize op's ``metrics`` tensor (0-d views, in :data:`METRICS` order)."""
    return dict(zip(METRICS[kind], met.unbind(0)))


_JIT = None  # the ops._jit module once triton imported, False when it cannot


def triton_available() -> bool:
    global _JIT
    if _JIT is None:
        try:
            from . import _jit  # imports triton
            _JIT = _jit
        except Exception:  # pragma: no cover - triton missing or broken
            _JIT = False
    return _JIT is not False


# CPU tensors take the interpreted kernels when TRITON_INTERPRET=1 (read at call time); while the variable is unset,
# this default decides. A GPU machine's test suite sets it instead of the variable, which would also make Triton
# build other libraries' kernels (Inductor's, Liger's) as interpreted ones.
INTERPRET_CPU_DEFAULT = False


def use_triton(t: torch.Tensor) -> bool:
    """True when ``t`` should go through the Triton kernels: compiled for CUDA tensors, interpreted for CPU
    tensors under ``TRITON_INTERPRET=1`` (see :mod:`._jit`)."""
    if not triton_available():
        return False
    if t.device.type in _JIT.COMPILED_DEVICES:
        return True
    if t.device.type != "cpu":
        return False
    flag = os.environ.get("TRITON_INTERPRET")
    if flag is None:
        return INTERPRET_CPU_DEFAULT
    if flag == "1" and not _numpy_available():
        raise ModuleNotFoundError(
            "TRITON_INTERPRET=1 runs the Triton kernels in Triton's interpreter, which needs NumPy: "
            "pip install numpy (or unset TRITON_INTERPRET to use the eager CPU path)", name="numpy")
    return flag == "1"


_NUMPY = importlib.util.find_spec("numpy") is not None  # looked up once: torch.compile cannot trace find_spec


def _numpy_available() -> bool:
    return _NUMPY


def _eager(name):
    if triton_available():
        _JIT.count_eager(name)


def _triton_ok(logits: torch.Tensor) -> bool:
    # fp64 has no Triton path (the eager one accumulates in fp64)
    return logits.dtype != torch.float64 and use_triton(logits)


def kernels_ok(x, *logps) -> bool:
    """The losses' kernel path: Triton for ``x``'s device and dtype, and fp32 log-prob inputs (``None`` allowed;
    fp64 ones keep the eager path, which accumulates in fp64)."""
    return _triton_ok(x) and all(t is None or t.dtype == torch.float32 for t in logps)


def logprobs_fwd(logits, labels, temperature, ignore_index, return_entropy):
    """``(logp [B, T] fp32, lse [B, T] fp32, entropy [B, T] or None)`` of ``logits [B, T, V]`` / ``labels [B, T]``."""
    if _triton_ok(logits):
        from . import logprobs
        return logprobs.logprobs_fwd(logits, labels, temperature, ignore_index, return_entropy)
    _eager("logprobs_fwd")
    return eager.logprobs_fwd(logits, labels, temperature, ignore_index, return_entropy)


def logprobs_bwd(logits, labels, lse, grad_logp, temperature, ignore_index, out=None):
    """``dlogits = g * (onehot - softmax) / temperature`` in the logits' dtype; into ``out`` (may be ``logits``)."""
    if _triton_ok(logits):
        from . import logprobs
        return logprobs.logprobs_bwd(logits, labels, lse, grad_logp, temperature, ignore_index, out=out)
    _eager("logprobs_bwd")
    return eager.logprobs_bwd(logits, labels, lse, grad_logp, temperature, ignore_index, out=out)


def loss_bwd(logits, labels, lse, coef, row_weight, grad_loss, temperature, ignore_index, out=None):
    """Backward of a fused loss: ``dlogits = grad_loss * row_weight[b] * coef[b, t] * (onehot - softmax) / T``
    (one launch; ``grad_loss`` 0-d, read on the device); into ``out`` (may be ``logits``)."""
    if _triton_ok(logits):
        from . import logprobs
        return logprobs.logprobs_bwd(logits, labels, lse, coef, temperature, ignore_index, out=out,
                                     row_weight=row_weight, grad_loss=grad_loss)
    _eager("loss_bwd")
    g = coef * row_weight.to(coef.dtype).unsqueeze(1) * grad_loss.to(coef.dtype)
    return eager.logprobs_bwd(logits, labels, lse, g, temperature, ignore_index, out=out)


def _finalize(name, val, aux, labels, *args, **kw):
    """``(loss 0-d, metrics [K] in METRICS order, w [B])`` by the finalize kernel, or eagerly through
    :mod:`humanline_kernels.losses` (the same math, which tests pin to the reference). Kernel path: fp32 ``val``
    on a Triton device; ``val=None`` (GRPO's row weights alone) goes by the labels' device."""
    if use_triton(labels if val is None else val) and (val is None or val.dtype == torch.float32):
        from . import finalize_kernels
        return getattr(finalize_kernels, name)(val, aux, labels, *args, **kw)
    from . import terms_eager
    _eager(name)
    return getattr(terms_eager, name)(val, aux, labels, *args, **kw)


def dpo_finalize(val, aux, labels, *, ignore_index, beta, label_smoothing):
    """DPO from the token terms ``val [2P, T]`` / ``aux [4, 2P, T]`` of :func:`token_terms_fwd`: ``(loss,
    metrics, w)`` with ``d loss / d val[b, t] = w[b]`` on masked tokens. See :mod:`.finalize_kernels`."""
    return _finalize("dpo_finalize", val, aux, labels, ignore_index=ignore_index, beta=beta,
                     label_smoothing=label_smoothing)


def kto_finalize(val, aux, labels, desirable, kl_logps=None, kl_ref_logps=None, kl_mask=None, z0=None, *,
                 ignore_index, beta, desirable_weight, undesirable_weight, clip):
    """KTO from the token terms; the baseline from the KL rows ``kl_*`` (clipped with ``clip``) or ``z0``."""
    return _finalize("kto_finalize", val, aux, labels, desirable, kl_logps, kl_ref_logps, kl_mask, z0,
                     ignore_index=ignore_index, beta=beta, desirable_weight=desirable_weight,
                     undesirable_weight=undesirable_weight, clip=clip)


def grpo_finalize(val, aux, labels, *, ignore_index, loss_type, normalizer=None, max_completion_length=None):
    """GRPO aggregation of the token terms; ``val=None``: only ``w`` (= :func:`grpo_row_weights`), loss and
    metrics 0."""
    return _finalize("grpo_finalize", val, aux, labels, ignore_index=ignore_index, loss_type=loss_type,
                     normalizer=normalizer, max_completion_length=max_completion_length)


def token_terms_fwd(logits, labels, ref_logps, *, mode, clip, temperature, ignore_index, kl_ref_logps=None,
                    advantages=None, beta=0.0, epsilon_low=0.2, epsilon_high=0.2, row_weight=None, grad_out=None,
                    out=None):
    """Per-token humanline terms of ``logits [B, T, V]`` in one pass: ``(val, coef, lse, aux)``.

    ``mode`` 1 (DPO/KTO): ``val`` = masked clipped log-ratio; 2 (GRPO): ``val`` = masked per-token GRPO term
    ``u + beta * k3``. ``coef = d val / d logp`` (apply it in the backward: ``grad_logp = grad_val * coef``),
    ``lse`` the per-row logsumexp, ``aux [4, B, T]`` = (inside the clip band, GRPO low clip, high clip, k3).
    ``ref_logps``, ``kl_ref_logps`` ``[B, T]``, ``advantages [B]``; ``clip`` a HumanlineClip or None.
    ``out``: ``(val, coef, lse, aux)`` to write into. See :mod:`.losses_kernels` for the exact math.
    """
    kw = dict(mode=mode, clip=clip, temperature=temperature, ignore_index=ignore_index, kl_ref_logps=kl_ref_logps,
              advantages=advantages, beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
              row_weight=row_weight, grad_out=grad_out, out=out)
    if _triton_ok(logits):
        from . import losses_kernels
        return losses_kernels.token_terms_fwd(logits, labels, ref_logps, **kw)
    from . import terms_eager
    _eager("token_terms")
    return terms_eager.token_terms_fwd(logits, labels, ref_logps, **kw)


def grpo_fwd_grad(logits, labels, ref_logps, advantages, row_weight, *, out, clip, temperature, ignore_index,
                  kl_ref_logps=None, beta=0.0, epsilon_low=0.2, epsilon_high=0.2):
    """GRPO with the gradient formed in the forward pass (one sweep of the logits for the softmax statistics, one
    more that writes the gradient). Returns ``(per_token [B, T], coef [B, T], lse [B, T], aux [4, B, T])`` and
    writes ``out[b, t, :] = row_weight[b] * coef[b, t] * (onehot(y) - softmax(z / T)) / T`` in the logits' dtype,
    i.e. the gradient of ``sum(row_weight[b] * per_token[b, t])`` w.r.t. the logits. ``out`` may be ``logits``
    itself (in place). ``row_weight [B]`` is ``d loss / d per_token`` of the aggregation, see
    :func:`grpo_row_weights`; multiply by the upstream gradient later with :func:`scale_rows_`.
    """
    return token_terms_fwd(logits, labels, ref_logps, mode=2, clip=clip, temperature=temperature,
                           ignore_index=ignore_index, kl_ref_logps=kl_ref_logps, advantages=advantages, beta=beta,
                           epsilon_low=epsilon_low, epsilon_high=epsilon_high, row_weight=row_weight, grad_out=out)


def grpo_row_weights(mask, *, loss_type, normalizer=None, max_completion_length=None):
    """``w [B]`` fp32 with ``d loss / d per_token[b, t] = w[b]`` (masked tokens) for ``grpo_aggregate``; on device.

    "dapo"/"bnpo": ``1 / (normalizer or sum(mask))``; "grpo": ``1 / (row_count_b * #non-empty rows)``;
    "dr_grpo": ``1 / (B * (max_completion_length or T))``. No host sync.
    """
    B, T = mask.shape
    f = mask.to(torch.float32)
    if loss_type in ("dapo", "bnpo"):
        if normalizer is None:
            den = f.sum().clamp(min=1)
        elif isinstance(normalizer, torch.Tensor):
            den = normalizer.to(torch.float32).reshape(())
        else:  # a fill, not a host-to-device copy (which a CUDA graph capture refuses)
            den = torch.full((), float(normalizer), dtype=torch.float32, device=mask.device)
        return (1.0 / den).expand(B).contiguous()
    if loss_type == "grpo":
        row_n = f.sum(1)
        return 1.0 / (row_n.clamp(min=1) * (row_n > 0).sum().to(torch.float32).clamp(min=1))
    return torch.full((B,), 1.0 / (B * (T if max_completion_length is None else max_completion_length)),
                      dtype=torch.float32, device=mask.device)


def scale_rows_(x, scale):
    """``x [B, T, V] *= scale`` in place (``scale`` a 0-d tensor); the Triton version skips the work on the device
    when ``scale == 1`` (no host sync)."""
    if _triton_ok(x):
        from . import logprobs
        return logprobs.scale_rows_(x, scale)
    return x.mul_(scale.to(x.dtype))
