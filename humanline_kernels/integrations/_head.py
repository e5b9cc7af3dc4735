"""Route TRL's per-token log-prob call through humanline-kernels.

TRL 1.16 computes every per-token log-prob (policy, reference, KTO's KL rows, GRPO's old/ref) with
``model(..., labels=labels, fused_lm_head=True)``, a forward that ``trl.trainer.utils.add_fused_lm_head``
patches in. :func:`install_head` wraps that forward once more: with ``fused="logits"`` the model's own logits go
through :func:`humanline_kernels.token_logprobs`; with ``fused="linear"`` the backbone's hidden states and the
lm_head weight go through :func:`humanline_kernels.fused_linear.token_logprobs` *inside the model's forward*, so
FSDP's and ZeRO-3's forward hooks have gathered the lm_head weight (FSDP2 DTensors are gathered with
``full_tensor()``, ZeRO-3 with TRL's ``maybe_gather_lm_head_ctx``, as TRL's own head does). ``fused="off"``
leaves TRL's head. The result is TRL's ``FusedCausalLMOutput`` with ``log_probs`` (``[B, L-1]``, 0 where the
label is -100) and, for the policy, a detached ``entropy``; the other per-token fields are None.
"""
from __future__ import annotations

import functools
import types

import torch

FUSED_MODES = ("linear", "logits", "off")


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

    ``entropy``: also return the (detached) per-token entropy, as TRL's head does for the policy (True) and not
    for the reference (False). A call can override it with ``hk_entropy=False`` (the lookahead's reference
    forwards through the policy, which need no entropy)."""
    if fused not in FUSED_MODES:
        raise ValueError(f"fused must be one of {FUSED_MODES}, got {fused!r}")
    if fused == "off":
        return
    check_head_supported(model, fused)
    trl_forward = model.forward

    @functools.wraps(type(model).forward)
    def _humanline_forward(self, *args, fused_lm_head=False, labels=None, hk_entropy=None, **kwargs):
        if not fused_lm_head:
            return trl_forward(*args, labels=labels, **kwargs)
        want_entropy = entropy if hk_entropy is None else hk_entropy
        return _fused_logprobs(self, trl_forward, fused, temperature, want_entropy, args, labels, kwargs)

    model.forward = types.MethodType(_humanline_forward, model)


def _fused_logprobs(self, trl_forward, fused, temperature, want_entropy, args, labels, kwargs):
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
                                                 return_entropy=want_entropy)
    log_probs, entropy = res if want_entropy else (res, None)
    mask = targets != -100
    loss = -log_probs.sum() / mask.sum().clamp(min=1)
    return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, label_mask=mask)
