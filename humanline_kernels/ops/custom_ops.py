"""``torch.library`` custom ops (namespace ``humanline``) around the kernels, so ``torch.compile(fullgraph=True)``
traces a training step that calls them (they stay opaque: Inductor calls them as they are, on the strided views).

Each op dispatches at run time like :mod:`humanline_kernels.ops`: Triton for CUDA tensors (CPU tensors under
``TRITON_INTERPRET=1``), eager otherwise. Optional outputs are returned as empty tensors (a custom op returns
tensors only). Ops whose name ends in ``_`` write into their first tensor argument.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import custom_op

from .._clip import HumanlineClip
from . import (METRICS, dpo_finalize, eager, grpo_finalize, kto_finalize, logprobs_bwd, logprobs_fwd, loss_bwd,
               scale_rows_, token_terms_fwd)


# ---------------------------------------------------------------- log-probs
@custom_op("humanline::logprobs_fwd", mutates_args=())
def logprobs_fwd_op(logits: Tensor, labels: Tensor, temperature: float, ignore_index: int,
                    return_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    logp, lse, ent = logprobs_fwd(logits, labels, temperature, ignore_index, return_entropy)
    return logp, lse, (logp.new_empty(0) if ent is None else ent)


@logprobs_fwd_op.register_fake
def _(logits, labels, temperature, ignore_index, return_entropy):
    dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    B, T = labels.shape
    out = logits.new_empty((B, T), dtype=dt)
    return out, torch.empty_like(out), (out.new_empty((B, T)) if return_entropy else out.new_empty(0))


@custom_op("humanline::logprobs_bwd", mutates_args=())
def logprobs_bwd_op(logits: Tensor, labels: Tensor, lse: Tensor, grad_logp: Tensor, temperature: float,
                    ignore_index: int) -> Tensor:
    return logprobs_bwd(logits, labels, lse, grad_logp, temperature, ignore_index)


@logprobs_bwd_op.register_fake
def _(logits, labels, lse, grad_logp, temperature, ignore_index):
    return logits.new_empty(logits.shape)


@custom_op("humanline::logprobs_bwd_", mutates_args=("logits",))
def logprobs_bwd_inplace_op(logits: Tensor, labels: Tensor, lse: Tensor, grad_logp: Tensor, temperature: float,
                            ignore_index: int) -> None:
    logprobs_bwd(logits, labels, lse, grad_logp, temperature, ignore_index, out=logits)


@custom_op("humanline::scale_rows_", mutates_args=("x",))
def scale_rows_op(x: Tensor, scale: Tensor) -> None:
    scale_rows_(x, scale)


# ---------------------------------------------------------------- per-token loss terms
def _kw(mode, clip, clip_lo, clip_hi, epsilon_low, epsilon_high, beta, temperature, ignore_index):
    return dict(mode=mode, clip=HumanlineClip(clip_lo, clip_hi) if clip else None, temperature=temperature,
                ignore_index=ignore_index, beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high)


def _terms_fake(logits, labels):
    dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    B, T = labels.shape
    val = logits.new_empty((B, T), dtype=dt)
    return val, torch.empty_like(val), torch.empty_like(val), logits.new_empty((4, B, T), dtype=dt)


@custom_op("humanline::token_terms", mutates_args=())
def token_terms_op(logits: Tensor, labels: Tensor, ref_logps: Tensor, kl_ref_logps: Optional[Tensor],
                   advantages: Optional[Tensor], mode: int, clip: bool, clip_lo: float, clip_hi: float,
                   epsilon_low: float, epsilon_high: float, beta: float, temperature: float,
                   ignore_index: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return token_terms_fwd(logits, labels, ref_logps, kl_ref_logps=kl_ref_logps, advantages=advantages,
                           **_kw(mode, clip, clip_lo, clip_hi, epsilon_low, epsilon_high, beta, temperature,
                                 ignore_index))


@token_terms_op.register_fake
def _(logits, labels, *args):
    return _terms_fake(logits, labels)


@custom_op("humanline::grpo_grad_fwd", mutates_args=("grad",))
def grpo_grad_fwd_op(logits: Tensor, labels: Tensor, ref_logps: Tensor, kl_ref_logps: Optional[Tensor],
                     advantages: Tensor, row_weight: Tensor, grad: Tensor, clip: bool, clip_lo: float,
                     clip_hi: float, epsilon_low: float, epsilon_high: float, beta: float, temperature: float,
                     ignore_index: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return token_terms_fwd(logits, labels, ref_logps, kl_ref_logps=kl_ref_logps, advantages=advantages,
                           row_weight=row_weight, grad_out=grad,
                           **_kw(2, clip, clip_lo, clip_hi, epsilon_low, epsilon_high, beta, temperature,
                                 ignore_index))


@grpo_grad_fwd_op.register_fake
def _(logits, labels, *args):
    return _terms_fake(logits, labels)


@custom_op("humanline::grpo_grad_fwd_", mutates_args=("logits",))
def grpo_grad_fwd_inplace_op(logits: Tensor, labels: Tensor, ref_logps: Tensor, kl_ref_logps: Optional[Tensor],
                             advantages: Tensor, row_weight: Tensor, clip: bool, clip_lo: float, clip_hi: float,
                             epsilon_low: float, epsilon_high: float, beta: float, temperature: float,
                             ignore_index: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return token_terms_fwd(logits, labels, ref_logps, kl_ref_logps=kl_ref_logps, advantages=advantages,
                           row_weight=row_weight, grad_out=logits,
                           **_kw(2, clip, clip_lo, clip_hi, epsilon_low, epsilon_high, beta, temperature,
                                 ignore_index))


@grpo_grad_fwd_inplace_op.register_fake
def _(logits, labels, *args):
    return _terms_fake(logits, labels)


# ---------------------------------------------------------------- the [B, T] tail of the losses and their backward
@custom_op("humanline::loss_bwd", mutates_args=())
def loss_bwd_op(logits: Tensor, labels: Tensor, lse: Tensor, coef: Tensor, row_weight: Tensor, grad_loss: Tensor,
                temperature: float, ignore_index: int) -> Tensor:
    return loss_bwd(logits, labels, lse, coef, row_weight, grad_loss, temperature, ignore_index)


@loss_bwd_op.register_fake
def _(logits, *args):
    return logits.new_empty(logits.shape)


@custom_op("humanline::loss_bwd_", mutates_args=("logits",))
def loss_bwd_inplace_op(logits: Tensor, labels: Tensor, lse: Tensor, coef: Tensor, row_weight: Tensor,
                        grad_loss: Tensor, temperature: float, ignore_index: int) -> None:
    loss_bwd(logits, labels, lse, coef, row_weight, grad_loss, temperature, ignore_index, out=logits)


def _finalize_fake(name, val, labels):
    dt = torch.float64 if val is not None and val.dtype == torch.float64 else torch.float32
    return (labels.new_empty((), dtype=dt), labels.new_empty((len(METRICS[name]),), dtype=dt),
            labels.new_empty((labels.shape[0],), dtype=dt))


@custom_op("humanline::dpo_finalize", mutates_args=())
def dpo_finalize_op(val: Tensor, aux: Tensor, labels: Tensor, ignore_index: int, beta: float,
                    label_smoothing: float) -> tuple[Tensor, Tensor, Tensor]:
    return dpo_finalize(val, aux, labels, ignore_index=ignore_index, beta=beta, label_smoothing=label_smoothing)


@dpo_finalize_op.register_fake
def _(val, aux, labels, *args):
    return _finalize_fake("dpo", val, labels)


@custom_op("humanline::kto_finalize", mutates_args=())
def kto_finalize_op(val: Tensor, aux: Tensor, labels: Tensor, desirable: Tensor, kl_logps: Optional[Tensor],
                    kl_ref_logps: Optional[Tensor], kl_mask: Optional[Tensor], z0: Optional[Tensor],
                    ignore_index: int, beta: float, desirable_weight: float, undesirable_weight: float, clip: bool,
                    clip_lo: float, clip_hi: float) -> tuple[Tensor, Tensor, Tensor]:
    return kto_finalize(val, aux, labels, desirable, kl_logps, kl_ref_logps, kl_mask, z0, ignore_index=ignore_index,
                        beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
                        clip=HumanlineClip(clip_lo, clip_hi) if clip else None)


@kto_finalize_op.register_fake
def _(val, aux, labels, *args):
    return _finalize_fake("kto", val, labels)


@custom_op("humanline::grpo_finalize", mutates_args=())
def grpo_finalize_op(val: Optional[Tensor], aux: Optional[Tensor], labels: Tensor, normalizer: Optional[Tensor],
                     normalizer_value: Optional[float], ignore_index: int, loss_type: str,
                     max_completion_length: Optional[int]) -> tuple[Tensor, Tensor, Tensor]:
    return grpo_finalize(val, aux, labels, ignore_index=ignore_index, loss_type=loss_type,
                         normalizer=normalizer if normalizer is not None else normalizer_value,
                         max_completion_length=max_completion_length)


@grpo_finalize_op.register_fake
def _(val, aux, labels, *args):
    return _finalize_fake("grpo", val, labels)


__all__ = ["logprobs_fwd_op", "logprobs_bwd_op", "logprobs_bwd_inplace_op",
           "scale_rows_op", "token_terms_op", "grpo_grad_fwd_op", "grpo_grad_fwd_inplace_op",
           "loss_bwd_op", "loss_bwd_inplace_op", "dpo_finalize_op", "kto_finalize_op", "grpo_finalize_op"]
