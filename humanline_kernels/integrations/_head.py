"""Route TRL's per-token log-prob call through humanline-kernels.

TRL 1.16 computes every per-token log-prob (policy, reference, KTO's KL rows, GRPO's old/ref) with
``model(..., labels=labels, fused_lm_head=True)``, a forward that ``trl.trainer.utils.add_fused_lm_head``
patches in. :func:`install_head` wraps that forward once more: with ``fused="logits"`` the model's own logits go
through :func:`humanline_kernels.token_logprobs`; with ``fused="linear"`` the backbone's hidden states and the
lm_head weight go through :func:`humanline_kernels.fused_linear.token_logprobs` *inside the model's forward*, so
FSDP's and ZeRO-3's forward hooks have gathered the lm_head weight (FSDP2 DTensors are gathered with
``full_tensor()``, ZeRO-3 with TRL's ``maybe_gather_lm_head_ctx``, as TRL's own head does). ``fused="off"``
leaves TRL's head. The result is TRL's ``FusedCausalLMOutput`` with ``log_probs`` (``[B, L-1]``, 0 where the
label is -100) and, for the policy, a differentiable ``entropy`` (for GRPO's entropy bonus, as TRL's head gives it); the
other per-token fields are None.

Layouts (``fused="linear"``): ``hk_supervised=[[start, end), ...]`` (host ints, one range per row, or per packed
sequence with ``hk_cu_seqlens``, in the head's coordinates: position ``t`` predicts token ``t + 1``) runs the lm_head
on those positions only; ``hk_cu_seqlens`` (host ints) are the packed stream's boundaries, as flash-attn's varlen
takes them. The trainers compute both on the CPU where the batch is collated (:mod:`.trl._layouts`); code that calls
the model itself (TRL's GRPO) passes the ranges through :func:`supervised_rows`.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import types

import torch

FUSED_MODES = ("linear", "logits", "off")
# the ranges of head calls made by code that passes no keyword of ours (TRL's GRPO calls the model itself)
_ROWS = contextvars.ContextVar("hk_supervised_rows", default=None)


def check_head_supported(model, fused: str) -> None:
    """Refuse model features the humanline head does not apply (TRL's own head does), before training."""
    if fused == "off":
        return
    cfg = model.config.get_text_config()
    for name in ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                 "logits_scaling"):
        if getattr(cfg, name, None) not in (None, 1, 1.0):
            raise ValueError(
                f"fused={fused!r} does not apply the model's {name}={getattr(cfg, name)!r} to the logits; "
                "use fused='off' (TRL's log-prob head) for this model")


def install_head(model, fused: str, temperature: float = 1.0, entropy: bool = True) -> None:
    """Wrap ``model.forward`` (already patched by TRL's ``add_fused_lm_head``) to use our fused paths.

    ``entropy``: also return the (differentiable) per-token entropy, as TRL's head does for the policy (True) and not
    for the reference (False). A call can override it with ``hk_entropy=False`` (the lookahead's reference
    forwards through the policy, which need no entropy)."""
    if fused not in FUSED_MODES:
        raise ValueError(f"fused must be one of {FUSED_MODES}, got {fused!r}")
    if fused == "off":
        return
    check_head_supported(model, fused)
    trl_forward = model.forward

    @functools.wraps(type(model).forward)
    def _humanline_forward(self, *args, fused_lm_head=False, labels=None, hk_entropy=None, hk_supervised=None,
                           hk_cu_seqlens=None, **kwargs):
        if not fused_lm_head:
            return trl_forward(*args, labels=labels, **kwargs)
        want_entropy = entropy if hk_entropy is None else hk_entropy
        # traced by torch.compile, the head runs on every position: the ranges are host ints that the graph would be
        # specialised on (a recompile a batch), and the context variable is no tensor Dynamo can read
        layout = (None, None) if torch.compiler.is_compiling() else (
            (_ROWS.get() if hk_supervised is None else hk_supervised), hk_cu_seqlens)
        return _fused_logprobs(self, trl_forward, fused, temperature, want_entropy, args, labels, kwargs, layout)

    model.forward = types.MethodType(_humanline_forward, model)


@contextlib.contextmanager
def supervised_rows(ranges):
    """Every head call inside (with ``fused="linear"``) that is given no ``hk_supervised`` takes ``ranges``, one per
    row of its labels: for TRL code that calls the model itself, once per micro-batch (``None``: dense)."""
    token = _ROWS.set(ranges)
    try:
        yield
    finally:
        _ROWS.reset(token)


def _head_layout(layout, targets):
    """``(supervised, packed)`` keywords of ``token_logprobs`` for the head's ``targets [B, L - 1]``."""
    import humanline_kernels as hk

    ranges, cu = layout
    if ranges is None:
        return {}
    if cu is None:
        if len(ranges) != targets.size(0):
            raise ValueError(f"hk_supervised gives {len(ranges)} ranges for {targets.size(0)} rows of labels")
        return {"supervised": ranges}
    # the stream's last position predicts nothing: the head's [1, N - 1] positions end the last sequence one early
    cu = list(cu)
    cu[-1] -= 1
    return {"supervised": ranges, "packed": hk.Packed(cu)}


def _fused_logprobs(self, trl_forward, fused, temperature, want_entropy, args, labels, kwargs, layout):
    from trl.trainer.utils import FusedCausalLMOutput

    import humanline_kernels as hk

    if kwargs.pop("shift_labels", None) is not None:
        raise ValueError("pre-shifted labels (context/sequence parallelism) are not supported by the humanline head")
    kwargs.pop("num_items_in_batch", None)
    kwargs["use_cache"] = False
    if fused == "logits":
        logits = trl_forward(*args, **kwargs).logits[:, :-1]
        targets = labels[:, 1:].to(logits.device)
        res = hk.token_logprobs(logits, targets, temperature=temperature, return_entropy=want_entropy,
                                validate=False)
    else:
        # Run the backbone here, in the model's forward, so FSDP/ZeRO-3 hooks of the root module have fired.
        hidden = self.base_model(*args, **kwargs).last_hidden_state[:, :-1]
        lm_head = self.get_output_embeddings()
        weight, bias = lm_head.weight, lm_head.bias
        if hasattr(weight, "full_tensor"):  # FSDP2 DTensor: gather the (small) head once, like TRL's head
            weight = weight.full_tensor()
            bias = None if bias is None else bias.full_tensor()
        from trl.trainer.utils import maybe_gather_lm_head_ctx

        # TRL's cast_lm_head_to_fp32 (GRPO) keeps an fp32 head and feeds it fp32 hidden states: do the same, so the
        # fused-linear GEMMs run in fp32 (TF32 where allowed) like TRL's head
        hidden = hidden.to(device=weight.device, dtype=weight.dtype if weight.dtype == torch.float32 else None)
        targets = labels[:, 1:].to(weight.device)
        with maybe_gather_lm_head_ctx(weight, bias):
            res = hk.fused_linear.token_logprobs(hidden, weight, targets, bias=bias, temperature=temperature,
                                                 return_entropy=want_entropy, **_head_layout(layout, targets))
    log_probs, entropy = res if want_entropy else (res, None)
    mask = targets != -100
    loss = -log_probs.sum() / mask.sum().clamp(min=1)
    return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, label_mask=mask)
