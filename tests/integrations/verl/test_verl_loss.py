"""verl's ``loss_mode='humanline'`` against oracles (runs in the verl environment; skipped without verl).

* clamp off and reference == ``old_log_prob``: equals verl's own ``vanilla`` / ``gspo`` / ``sapo`` / ``cispo`` /
  ``geo_mean`` on the same tensors, bit for bit (loss, gradient, the metrics verl reports), in every
  ``loss_agg_mode``, with and without rollout IS weights and with the global-batch normalisers ``ppo_loss`` sets,
  log-ratios beyond verl's [-20, 20] included;
* clamp on: ``vanilla`` equals ``hk.reference.grpo`` (the aggregation modes it has); the mirrored modes equal
  verl's function at the clamped log-probs, with the gradient zero outside the band;
* refusals by name, and the reference hand-over through ``humanline_ppo_loss``.
"""
import pytest

verl = pytest.importorskip("verl")

import torch  # noqa: E402
from verl.trainer.ppo.core_algos import get_policy_loss_fn  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402

import humanline_kernels as hk  # noqa: E402
from humanline_kernels.integrations.verl import (  # noqa: E402
    REFUSED_BASE_MODES,
    HumanlinePolicyLossConfig,
    humanline_policy_loss,
    reference_log_probs,
)

AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
MIRRORED = ["gspo", "sapo", "cispo", "geo_mean"]
# what ppo_loss puts into config.global_batch_info: local normalisers, or a global batch on 2 ranks
BATCH_INFO = {"local": {}, "global": {"dp_size": 2, "batch_num_tokens": 37, "global_batch_size": 9,
                                      "loss_scale_factor": 16}}


def actor_config(base="vanilla", band=(None, None), agg="token-mean", info="local", clip_ratio_c=3.0, **kw):
    pl = HumanlinePolicyLossConfig(base_loss_mode=base, log_eps_p=band[0], log_eps_r=band[1])
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, policy_loss=pl,
                      loss_agg_mode=agg, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=clip_ratio_c, **kw)
    cfg.global_batch_info.update(BATCH_INFO[info])
    return cfg


def batch(seed=0, B=5, T=9, spread=1.0, token_adv=True):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 4 - 0.05
    logp = old + spread * torch.randn(B, T, generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[-1] = 0  # a fully masked row
    mask = torch.arange(T) < lengths[:, None]
    adv = torch.randn(B, T if token_adv else 1, generator=g).expand(B, T).contiguous()
    isw = torch.rand(B, T, generator=g) * 1.5 + 0.25
    return logp, old, adv, mask, isw


def call(fn, logp, old, adv, mask, cfg, isw):
    leaf = logp.clone().requires_grad_(True)
    loss, metrics = fn(old_log_prob=old, log_prob=leaf, advantages=adv, response_mask=mask,
                       loss_agg_mode=cfg.loss_agg_mode, config=cfg, rollout_is_weights=isw)
    loss.backward()
    return loss.detach(), leaf.grad, metrics


def humanline(logp, ref, adv, mask, cfg, isw, old=None):
    with reference_log_probs(ref):
        return call(humanline_policy_loss, logp, ref if old is None else old, adv, mask, cfg, isw)


@pytest.mark.parametrize("info", sorted(BATCH_INFO))
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("weights", [False, True])
def test_vanilla_equals_verl_with_the_clamp_off(agg, info, weights):
    logp, old, adv, mask, isw = batch(seed=1, spread=1.5)  # ratios beyond clip_ratio_c too (dual clip active)
    isw = isw if weights else None
    cfg = actor_config(agg=agg, info=info)
    want_loss, want_grad, want_m = call(get_policy_loss_fn("vanilla"), logp, old, adv, mask, cfg, isw)
    # the old log-probs are never used: the reference is what the ratio is taken against
    loss, grad, m = humanline(logp, old, adv, mask, cfg, isw, old=torch.full_like(old, float("nan")))
    assert torch.equal(loss, want_loss), (loss, want_loss)
    assert torch.equal(grad, want_grad)
    for key in want_m:
        assert m[key] == pytest.approx(want_m[key], rel=1e-6, abs=1e-7), key
    assert m["actor/pg_clipfrac_lower"] > 0 and m["actor/pg_clipfrac"] > 0  # both clips were exercised
    assert m["actor/humanline_unclipped_frac"] == 1.0


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("mode", MIRRORED)
def test_mirrored_modes_equal_verl_with_the_clamp_off(mode, agg):
    logp, old, adv, mask, isw = batch(seed=2, spread=0.3)
    cfg = actor_config(base=mode, agg=agg, info="global")
    want_loss, want_grad, want_m = call(get_policy_loss_fn(mode), logp, old, adv, mask, cfg, isw)
    loss, grad, m = humanline(logp, old, adv, mask, cfg, isw)
    assert torch.equal(loss, want_loss) and torch.equal(grad, want_grad)  # log_prob reaches verl as it is
    assert want_grad.abs().sum() > 0
    assert m == {**want_m, "actor/humanline_unclipped_frac": 1.0}


@pytest.mark.parametrize("mode", ["vanilla", *MIRRORED])
def test_the_clamp_off_is_verls_loss_beyond_its_numerical_clamp(mode):
    """Log-ratios beyond +-20 (verl clamps them in vanilla, SAPO and CISPO's ratio, not in GSPO, GMPO or CISPO's
    log_prob factor): with the clamp off the loss and its gradient are still verl's own (issue 52: a [-20, 20]
    clamp on every mode gave another loss, relative difference up to 0.36)."""
    logp, old, adv, mask, isw = batch(seed=5, spread=1.0)
    logp[0, :3] = old[0, :3] + torch.tensor([25.0, -30.0, 21.0])
    logp[1, :2] = old[1, :2] - 40.0
    cfg = actor_config(base=mode, agg="seq-mean-token-mean", info="global")
    want_loss, want_grad, want_m = call(get_policy_loss_fn(mode), logp, old, adv, mask, cfg, isw)
    loss, grad, m = humanline(logp, old, adv, mask, cfg, isw)
    assert torch.equal(loss, want_loss) and torch.equal(grad, want_grad)
    assert m == {**want_m, "actor/humanline_unclipped_frac": 1.0}


# verl's aggregation -> hk.reference.grpo's loss_type (token-sum is "dapo" normalised by 1)
REFERENCE_AGG = {"token-mean": ("dapo", None), "token-sum": ("dapo", 1.0), "seq-mean-token-mean": ("grpo", None),
                 "seq-mean-token-sum-norm": ("dr_grpo", None)}


@pytest.mark.parametrize("agg", sorted(REFERENCE_AGG))
@pytest.mark.parametrize("band", [(-1.5, 1.5), (-0.3, 0.1)])
def test_vanilla_with_the_clamp_on_equals_hk_reference(agg, band):
    logp, ref, adv, mask, _ = batch(seed=3, spread=1.2, token_adv=False)
    mask[-1, :2] = True  # hk.reference.grpo's dr_grpo divides by all rows: no empty row here
    # clip_ratio_c above exp(log_eps_r): the dual clip never binds, as in hk.reference's GRPO
    cfg = actor_config(band=band, agg=agg, clip_ratio_c=10.0)
    loss, grad, m = humanline(logp, ref, adv, mask, cfg, None)
    loss_type, normalizer = REFERENCE_AGG[agg]
    leaf = logp.clone().requires_grad_(True)
    want, want_m = hk.reference.grpo(leaf, ref, adv[:, 0], mask, clip=hk.HumanlineClip(*band), beta=0.0,
                                     epsilon_low=0.2, epsilon_high=0.28, loss_type=loss_type, normalizer=normalizer)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-6, atol=1e-7)
    assert m["actor/humanline_unclipped_frac"] == pytest.approx(want_m["unclipped_frac"].item())
    assert 0.1 < m["actor/humanline_unclipped_frac"] < 0.95  # the band clamps some tokens and not others


@pytest.mark.parametrize("mode", MIRRORED)
def test_mirrored_modes_with_the_clamp_on(mode):
    """verl's function at the clamped log-probs ``ref + clamp(log_prob - ref)``, gradient zero outside the band."""
    logp, ref, adv, mask, isw = batch(seed=4, spread=1.0)
    p, r = -0.4, 0.3
    cfg = actor_config(base=mode, band=(p, r), agg="seq-mean-token-mean")
    loss, grad, _ = humanline(logp, ref, adv, mask, cfg, isw)
    delta = logp - ref
    inside = (delta >= p) & (delta <= r)
    clamped = ref + torch.where(mask, delta.clamp(p, r), 0.0)
    want_loss, want_grad, _ = call(get_policy_loss_fn(mode), clamped, ref, adv, mask, cfg, isw)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, torch.where(inside, want_grad, 0.0), rtol=1e-5, atol=1e-6)
    assert (grad[mask & ~inside] == 0).all() and grad[mask & inside].abs().sum() > 0
    assert (mask & ~inside).any()


@pytest.mark.parametrize("mode", sorted(REFUSED_BASE_MODES))
def test_refused_modes_are_named_with_the_reason(mode):
    with pytest.raises(ValueError, match=f"base_loss_mode='{mode}' has no humanline variant: "):
        HumanlinePolicyLossConfig(base_loss_mode=mode)


@pytest.mark.parametrize("kw, match", [
    ({"base_loss_mode": "my_loss"}, "must be one of"),
    ({"log_eps_p": -1.0, "log_eps_r": None}, "both be numbers or both be None"),
    ({"log_eps_p": 1.0, "log_eps_r": -1.0}, "log_eps_p must be <= log_eps_r"),
    ({"log_eps_p": 0.5, "log_eps_r": 1.0}, r"policy_loss: log_eps_p <= 0 <= log_eps_r must hold"),
    ({"sync_every": 0}, "sync_every must be a positive int"),
    ({"reference": "lookahead"}, "reference must be one of"),
    ({"loss_mode": "vanilla"}, "loss_mode must be 'humanline'"),
    ({"fused_logprobs": "no"}, "policy_loss.fused_logprobs must be a bool"),
    ({"save_reference": 1}, "policy_loss.save_reference must be a bool"),
    ({"log_eps_r": 1e300}, r"policy_loss: log_eps_r must be -inf, inf \(no bound on that side\)"),
])
def test_bad_settings_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        HumanlinePolicyLossConfig(**kw)


def test_the_loss_needs_its_reference_and_its_config():
    logp, old, adv, mask, _ = batch()
    with pytest.raises(ValueError, match="got no reference log-probs"):
        call(humanline_policy_loss, logp, old, adv, mask, actor_config(), None)
    plain = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    with pytest.raises(ValueError, match="HumanlinePolicyLossConfig"), reference_log_probs(old):
        call(humanline_policy_loss, logp, old, adv, mask, plain, None)
    with pytest.raises(ValueError, match="ref_log_prob has shape"), reference_log_probs(old[:, :-1]):
        call(humanline_policy_loss, logp, old, adv, mask, actor_config(), None)
