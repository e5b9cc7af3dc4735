"""Our fused log-probs in verl's model forward: ``hk.fused_linear.token_logprobs`` in place of verl's
``linear_cross_entropy``.

With ``model.use_fused_kernels=True`` and ``fused_kernel_options.impl_backend=triton``, verl's forward
(``forward_with_triton_backend`` in ``verl/models/transformers/dense_common.py`` and its multimodal twins) imports
``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` inside the function body and calls it as
``(hidden, lm_head.weight, rolled_labels, temperature, "none")``. :func:`rebind` replaces that module attribute,
so every later forward in the process (actor and reference alike) computes its log-probs with our kernel.

verl adds ``-entropy_coeff * entropy`` to the loss (``ppo_loss``). The entropy returned here is differentiable (as
``token_logprobs``' is), but its gradient through verl's entropy bonus is not checked against verl's kernel yet
(tests/integrations/verl/test_verl_kernel.py backpropagates the log-probs only), so the worker still refuses
``entropy_coeff != 0`` with this path.
"""
from __future__ import annotations

import torch

from ... import fused_linear

__all__ = ["linear_cross_entropy", "rebind", "is_rebound"]


def linear_cross_entropy(hidden, weight, labels, temperature=1.0, reduction="none", dist_process_group=None):
    """verl's ``linear_cross_entropy`` signature on ``hk.fused_linear.token_logprobs``.

    Returns ``(log_probs, entropy)`` shaped like ``labels`` (fp32, as verl's torch backend shapes them); the
    log-probs and the entropy are differentiable with respect to ``hidden`` and ``weight``.
    """
    if reduction != "none":
        raise ValueError(f"linear_cross_entropy: only reduction='none' is supported (per-token log-probs), got "
                         f"{reduction!r}")
    if dist_process_group is not None and torch.distributed.get_world_size(dist_process_group) > 1:
        raise ValueError("linear_cross_entropy: a vocabulary-parallel lm_head (dist_process_group of size > 1) is "
                         "not supported by hk.fused_linear.token_logprobs; keep verl's kernel for tensor parallelism")
    # validate=False: the labels are the batch's own input ids, shifted by one, which the embedding already looked
    # up; the range check would be a host sync per forward
    return fused_linear.token_logprobs(hidden, weight, labels, temperature=float(temperature), return_entropy=True,
                                       validate=False)


def rebind() -> None:
    """Make verl's fused-kernel forwards in this process call :func:`linear_cross_entropy`."""
    import verl.utils.kernel.linear_cross_entropy as target
    target.linear_cross_entropy = linear_cross_entropy


def is_rebound() -> bool:
    import verl.utils.kernel.linear_cross_entropy as target
    return target.linear_cross_entropy is linear_cross_entropy
