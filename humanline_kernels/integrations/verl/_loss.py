r"""The ``humanline`` policy loss for verl, and the actor loss function that hands it the reference log-probs.

verl calls a registered policy loss with ``(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
config, rollout_is_weights)`` (``verl/workers/utils/losses.py::ppo_loss``); the reference log-probs are not among
them (ppo_loss gives ``ref_log_prob`` to its KL term only). :func:`humanline_ppo_loss` is the actor's loss
function: it reads ``ref_log_prob`` from the micro-batch, makes it visible to :func:`humanline_policy_loss` for
the duration of verl's own ``ppo_loss`` (a context variable) and otherwise leaves ``ppo_loss`` (entropy bonus,
KL loss, metrics) as it is.

Per token, with :math:`\ell` = ``log_prob``, :math:`\ell_{ref}` = ``ref_log_prob``, ``m`` = ``response_mask``:
:math:`\hat\Delta = \mathrm{clamp}(\ell - \ell_{ref}, p, r)` (:func:`humanline_kernels.losses.clip_log_ratio`; 0
where masked). ``old_log_prob`` is not used: the ratio's denominator is the synced reference.

* ``base_loss_mode='vanilla'``: :math:`\rho = e^{\hat\Delta}`, :math:`u = -\min(A\rho, A\,\mathrm{clip}(\rho,
  1-\epsilon_{low}, 1+\epsilon_{high}))` (:func:`humanline_kernels.losses.grpo_token_terms`), then verl's dual clip
  :math:`u \leftarrow \min(u, -A c)` where :math:`A < 0` (``clip_ratio_c``), times ``rollout_is_weights``, reduced
  by verl's ``agg_loss`` in the configured ``loss_agg_mode``.
* ``gspo``, ``sapo``, ``cispo``, ``geo_mean``: verl's own registered function, called with
  ``old_log_prob = ref`` and ``log_prob = ref + Delta_hat``. Each of them uses ``log_prob`` only through
  ``log_prob - old_log_prob`` (which is then :math:`\hat\Delta`, up to one fp32 rounding of the sum) and through
  the gradient of ``log_prob`` (which is then :math:`\partial\hat\Delta`: zero outside the band); CISPO also
  multiplies ``log_prob`` itself by a detached weight, so its value uses :math:`\ell_{ref} + \hat\Delta` in place
  of :math:`\ell` and its gradient vanishes outside the band, as the humanline clamp's gradient does.
* the clamp off (``log_eps_p = log_eps_r = None``): verl's own ``base_loss_mode`` function (``vanilla`` included),
  called with ``old_log_prob = ref`` and ``log_prob`` itself, so exactly verl's loss against the reference (with
  ``ref + Delta`` instead, a token with ``|Delta| > 20`` would leave verl's formula in the modes whose log-ratio
  verl does not clamp to [-20, 20] itself: GSPO, CISPO's ``log_prob`` factor, GMPO).
"""
from __future__ import annotations

import contextlib
import contextvars

import torch
from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn
from verl.workers.utils.losses import ppo_loss

from ...losses import clip_log_ratio, grpo_token_terms
from ._config import HumanlinePolicyLossConfig

__all__ = ["humanline_policy_loss", "humanline_ppo_loss", "reference_log_probs", "LOSS_MODE"]

LOSS_MODE = "humanline"
_REF = contextvars.ContextVar("humanline_ref_log_prob", default=None)


@contextlib.contextmanager
def reference_log_probs(ref_log_prob: torch.Tensor):
    """Within the block, :func:`humanline_policy_loss` takes ``ref_log_prob`` ``[B, T]`` as its reference."""
    token = _REF.set(ref_log_prob)
    try:
        yield
    finally:
        _REF.reset(token)


def humanline_ppo_loss(config, model_output, data, dp_group=None):
    """verl's ``ppo_loss`` with the micro-batch's ``ref_log_prob`` handed to the ``humanline`` policy loss."""
    if "ref_log_prob" not in data.keys():
        raise ValueError("loss_mode='humanline' needs the reference log-probs, which verl computes only with "
                         "actor.use_kl_loss=True (set kl_loss_coef=0 for no KL term)")
    ref = data.select("ref_log_prob").to_padded_tensor()["ref_log_prob"]  # as ppo_loss pads its own fields
    with reference_log_probs(ref):
        return ppo_loss(config, model_output, data, dp_group)


def _settings(config) -> HumanlinePolicyLossConfig:
    pl = getattr(config, "policy_loss", None)
    if not isinstance(pl, HumanlinePolicyLossConfig):
        raise ValueError("loss_mode='humanline' needs actor.policy_loss._target_="
                         "humanline_kernels.integrations.verl.HumanlinePolicyLossConfig (it carries the clamp band and "
                         f"the sync period), got {type(pl).__name__}")
    return pl


def _reference(log_prob):
    ref = _REF.get()
    if ref is None:
        raise ValueError("loss_mode='humanline' got no reference log-probs: the actor's loss function must be "
                         "humanline_kernels.integrations.verl.humanline_ppo_loss, which the humanline worker installs "
                         "(trainer.v1.trainer_mode=humanline_sync or humanline_colocate_async)")
    if ref.shape != log_prob.shape:
        raise ValueError(f"ref_log_prob has shape {tuple(ref.shape)}, log_prob {tuple(log_prob.shape)}")
    return ref.to(device=log_prob.device, dtype=log_prob.dtype)


def humanline_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                          config=None, rollout_is_weights=None):
    """verl policy loss ``humanline``: the configured base mode on the clamped log-ratio against the reference.

    Returns ``(loss, metrics)`` as verl's losses do; metrics add ``actor/humanline_unclipped_frac`` (the share of
    response tokens strictly inside the band).
    """
    settings = _settings(config)
    ref = _reference(log_prob)
    mask = response_mask.bool()
    if settings.clip is None:  # no clamp: verl's loss as it is, against the reference
        base = get_policy_loss_fn(settings.base_loss_mode)
        loss, metrics = base(old_log_prob=ref, log_prob=log_prob, advantages=advantages, response_mask=response_mask,
                             loss_agg_mode=loss_agg_mode, config=config, rollout_is_weights=rollout_is_weights)
        metrics["actor/humanline_unclipped_frac"] = 1.0
        return loss, metrics
    delta_hat, n_in, n = clip_log_ratio(log_prob, ref, mask, settings.clip)
    if settings.base_loss_mode == "vanilla":
        loss, metrics = _vanilla(log_prob, delta_hat, ref, advantages, mask, loss_agg_mode, config, rollout_is_weights)
    else:
        base = get_policy_loss_fn(settings.base_loss_mode)
        loss, metrics = base(old_log_prob=ref, log_prob=ref + delta_hat, advantages=advantages,
                             response_mask=response_mask, loss_agg_mode=loss_agg_mode, config=config,
                             rollout_is_weights=rollout_is_weights)
    metrics["actor/humanline_unclipped_frac"] = torch.where(n > 0, n_in / n.clamp(min=1), 1.0).item()
    return loss, metrics


def _vanilla(log_prob, delta_hat, ref, advantages, mask, loss_agg_mode, config, rollout_is_weights):
    """PPO's clipped term on ``exp(Delta_hat)`` with verl's dual clip, IS weights and aggregation."""
    eps = config.clip_ratio
    eps_low = config.clip_ratio_low if config.clip_ratio_low is not None else eps
    eps_high = config.clip_ratio_high if config.clip_ratio_high is not None else eps
    c = config.get("clip_ratio_c", 3.0)
    if not c > 1.0:
        raise ValueError(f"actor.clip_ratio_c (the dual-clip bound) must be > 1, got {c!r}")
    u, _, low, high = grpo_token_terms(log_prob, delta_hat, ref, advantages, mask, beta=0.0,
                                       epsilon_low=eps_low, epsilon_high=eps_high)
    dual = -advantages * c
    negative = advantages < 0
    per_token = torch.where(negative, torch.minimum(u, dual), u)
    if rollout_is_weights is not None:
        per_token = per_token * rollout_is_weights
    loss = agg_loss(loss_mat=per_token, loss_mask=mask, loss_agg_mode=loss_agg_mode, **config.global_batch_info)
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        metrics = {
            "actor/pg_clipfrac": ((low | high).sum() / n).item(),
            "actor/ppo_kl": (torch.where(mask, -delta_hat, 0.0).sum() / n).item(),
            "actor/pg_clipfrac_lower": ((mask & negative & (u > dual)).sum() / n).item(),
        }
    return loss, metrics
