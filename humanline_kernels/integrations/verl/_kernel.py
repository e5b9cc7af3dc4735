"""Our fused log-probs in verl's model forward: ``hk.fused_linear.token_logprobs`` in place of verl's
``linear_cross_entropy``.

With ``model.use_fused_kernels=True`` and ``fused_kernel_options.impl_backend=triton``, verl's forward
(``forward_with_triton_backend`` in ``verl/models/transformers/dense_common.py`` and its multimodal twins) imports
``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` inside the function body and calls it as
``(hidden, lm_head.weight, rolled_labels, temperature, "none")``. :func:`rebind` replaces that module attribute,
so every later forward in the process (actor and reference alike) computes its log-probs with our kernel.

verl adds ``-entropy_coeff * entropy`` to the loss (``ppo_loss``). The entropy returned here is differentiable (as
``token_logprobs``' is), so the entropy bonus trains through it (tests/integrations/verl/test_verl_kernel.py and
tests/integrations/verl/test_verl_tensor_parallel.py check its gradient against verl's torch path).

``dist_process_group`` (verl's Megatron forward passes the tensor-parallel group): ``weight`` is this rank's slice of
a vocabulary-parallel lm_head; the log-probs and entropy are the whole vocabulary's, the weight's gradient is the
slice's, the hidden states' is this slice's part (verl's convention: the column-parallel region sums the parts),
as ``hk.fused_linear.token_logprobs(..., process_group=)`` gives them (docs/tensor_parallel.md).
"""
from __future__ import annotations

from ... import fused_linear

__all__ = ["linear_cross_entropy", "rebind", "is_rebound"]


def linear_cross_entropy(hidden, weight, labels, temperature=1.0, reduction="none", dist_process_group=None):
    """verl's ``linear_cross_entropy`` signature on ``hk.fused_linear.token_logprobs``.

    Returns ``(log_probs, entropy)`` shaped like ``labels`` (fp32, as verl's torch backend shapes them); the
    log-probs and the entropy are differentiable with respect to ``hidden`` and ``weight``. ``dist_process_group``:
    ``weight`` is this rank's vocabulary slice (tensor parallelism, module docstring).
    """
    if reduction != "none":
        raise ValueError(f"linear_cross_entropy: only reduction='none' is supported (per-token log-probs), got "
                         f"{reduction!r}")
    # validate=False: the labels are the batch's own input ids, shifted by one, which the embedding already looked
    # up; the range check would be a host sync per forward
    return fused_linear.token_logprobs(hidden, weight, labels, temperature=float(temperature), return_entropy=True,
                                       validate=False, process_group=dist_process_group)


def rebind() -> None:
    """Make verl's fused-kernel forwards in this process call :func:`linear_cross_entropy`."""
    import verl.utils.kernel.linear_cross_entropy as target
    target.linear_cross_entropy = linear_cross_entropy


def is_rebound() -> bool:
    import verl.utils.kernel.linear_cross_entropy as target
    return target.linear_cross_entropy is linear_cross_entropy
