"""``HumanlinePolicyLossConfig``: the humanline settings, carried in verl's ``actor.policy_loss``.

verl builds ``actor.policy_loss`` from the class named by its ``_target_`` (hydra ``instantiate``, through
``verl.utils.config.omega_conf_to_dataclass``), so a subclass of ``PolicyLossConfig`` brings the extra fields to
every worker. Every check runs in ``__post_init__``: a bad value fails when verl builds the actor config, before a
model is loaded.

Which verl loss modes have a humanline variant: the ones whose only use of ``log_prob`` is the log-ratio
``log_prob - old_log_prob`` (and its gradient), or, for CISPO, ``log_prob`` itself under a detached weight. The
humanline change replaces that log-ratio by ``clamp(log pi - log pi_ref, log_eps_p, log_eps_r)`` against the
synced reference. The other modes are refused by name, with the reason, in :data:`REFUSED_BASE_MODES`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from verl.workers.config import PolicyLossConfig

from ..._clip import HumanlineClip

__all__ = ["HumanlinePolicyLossConfig", "SUPPORTED_BASE_MODES", "REFUSED_BASE_MODES", "REFERENCE_MODES"]

# verl 0.9.1's registered modes (verl/trainer/ppo/core_algos.py), each with what the humanline variant does.
SUPPORTED_BASE_MODES = {
    "vanilla": "PPO clip (+ dual clip clip_ratio_c) on exp(Delta_hat): humanline_kernels.losses.grpo_token_terms",
    "gspo": "verl's GSPO on the sequence ratio exp(mean_t Delta_hat)",
    "sapo": "verl's SAPO gates on exp(Delta_hat)",
    "cispo": "verl's CISPO: detached clip(exp(Delta_hat)) times A times (log pi_ref + Delta_hat)",
    "geo_mean": "verl's GMPO on the token-clipped Delta_hat",
}
REFUSED_BASE_MODES = {
    "dppo_tv": "its trust region is the total variation between the absolute probabilities pi and pi_old, not a "
               "function of the log-ratio, so the humanline clamp has no defined place in it",
    "dppo_kl": "its trust region is the binary KL between the absolute probabilities pi and pi_old, not a "
               "function of the log-ratio, so the humanline clamp has no defined place in it",
    "gpg": "it has no importance ratio (REINFORCE on log pi): there is no log-ratio to clamp",
    "clip_cov": "it picks the tokens it clips by the covariance of the advantage with log pi itself (and at "
                "random), not by the log-ratio, so it cannot be written on the clamped log-ratio",
    "kl_cov": "it picks the tokens it penalises by the covariance of the advantage with log pi itself, not by "
              "the log-ratio, so it cannot be written on the clamped log-ratio",
    "dro": "its penalty 0.5*beta*(log pi - log pi_old)^2 is a trust region on the log-ratio itself: clamping that "
           "log-ratio zeroes the penalty's gradient exactly where it should act",
    "bypass_mode": "it recomputes rollout-correction weights from log pi against the rollout policy inside the loss "
                   "and dispatches to vanilla/reinforce; use the decoupled mode (rollout_is_weights are applied "
                   "by base_loss_mode='vanilla')",
    "humanline": "the humanline loss cannot wrap itself",
}
# "sync": verl's reference engine, synced from the actor every sync_every optimizer steps (humanline);
# "frozen": verl's reference as it is (never synced): only the clamp, against the initial policy.
REFERENCE_MODES = ("sync", "frozen")


@dataclass
class HumanlinePolicyLossConfig(PolicyLossConfig):
    """``actor.policy_loss`` for ``loss_mode='humanline'``.

    Args:
        loss_mode: must be ``"humanline"`` (the registered mode that reads these fields).
        base_loss_mode: the verl loss whose humanline variant is trained (:data:`SUPPORTED_BASE_MODES`).
        log_eps_p, log_eps_r: the clamp band of ``log pi - log pi_ref`` (the paper's -1.5, 1.5; it must hold 0).
            Both ``None`` turns the clamp off: the loss is then verl's own ``base_loss_mode`` function with the
            reference as ``old_log_prob`` and ``log_prob`` as it is, in every mode (its own numerical clamps, e.g.
            vanilla's [-20, 20], included; GSPO, CISPO and GMPO have none on the token log-ratio).
        sync_every: k, the sync period in optimizer steps (``engine.optimizer_step`` calls: mini-batches times
            ``ppo_epochs`` per verl step). Optimizer step t (counted from 0 over the run) syncs when
            ``t % k == 0``, before its update.
        reference: ``"sync"`` (humanline syncing) or ``"frozen"`` (clamp only, the reference never moves).
        fused_logprobs: route verl's fused-kernel forward (``model.use_fused_kernels=True`` with
            ``fused_kernel_options.impl_backend=triton``) through ``hk.fused_linear.token_logprobs``.
        save_reference: write the reference's shards into each actor checkpoint (``<local_path>/humanline``), so a
            resumed run is exactly the uninterrupted one; ``False`` saves the counter only (a resume restarts the
            reference from the resumed actor, with a warning).
    """

    loss_mode: str = "humanline"
    base_loss_mode: str = "vanilla"
    log_eps_p: Optional[float] = -1.5
    log_eps_r: Optional[float] = 1.5
    sync_every: int = 1
    reference: str = "sync"
    fused_logprobs: bool = False
    save_reference: bool = True

    def __post_init__(self):
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        if self.loss_mode != "humanline":
            raise ValueError(f"policy_loss.loss_mode must be 'humanline' with HumanlinePolicyLossConfig (its fields "
                             f"are read only by that mode), got {self.loss_mode!r}")
        if self.base_loss_mode in REFUSED_BASE_MODES:
            raise ValueError(f"policy_loss.base_loss_mode={self.base_loss_mode!r} has no humanline variant: "
                             f"{REFUSED_BASE_MODES[self.base_loss_mode]}")
        if self.base_loss_mode not in SUPPORTED_BASE_MODES:
            raise ValueError(f"policy_loss.base_loss_mode must be one of {sorted(SUPPORTED_BASE_MODES)}, got "
                             f"{self.base_loss_mode!r} (a mode outside this list has not been checked for what it "
                             "does with log_prob)")
        self.clip  # noqa: B018 - validates the band
        k = self.sync_every
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"policy_loss.sync_every must be a positive int, got {k!r}")
        if self.reference not in REFERENCE_MODES:
            raise ValueError(f"policy_loss.reference must be one of {REFERENCE_MODES}, got {self.reference!r}")
        for flag in ("fused_logprobs", "save_reference"):  # (a string from an override would pass as true)
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"policy_loss.{flag} must be a bool, got {getattr(self, flag)!r}")

    @property
    def clip(self) -> Optional[HumanlineClip]:
        """The band, or None with the clamp off (the loss is then verl's own ``base_loss_mode``)."""
        p, r = self.log_eps_p, self.log_eps_r
        if (p is None) != (r is None):
            raise ValueError("policy_loss.log_eps_p and log_eps_r must both be numbers or both be None (clamp off), "
                             f"got log_eps_p={p!r}, log_eps_r={r!r}")
        if p is None:
            return None
        try:
            return HumanlineClip(p, r)
        except ValueError as e:
            raise ValueError(f"policy_loss: {e}") from None
