"""hk.losses.grpo (the factored per-token-log-prob level the trainers call) against hk.reference.grpo (the ground
truth, oracle-tested against TRL 1.16 in test_reference_trl_oracle.py) for every TRL option: loss, gradients of
the log-probs and of the entropies, metrics; fp32 and fp64; with and without the humanline clamp; all-masked rows.
"""
import itertools
import math

import pytest
import torch

import humanline_kernels as hk
from humanline_kernels._validation import GRPO_PPO_CLIP_TYPES, VLLM_IS_MODES

TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-10, atol=1e-12)}
CLIPS = {"plain": None, "humanline": hk.HumanlineClip(-0.4, 0.35)}  # a narrow band: many tokens outside it


def _inputs(B=6, T=7, seed=0, dtype=torch.float64, adv_dim=1, empty_row=False):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T, dtype=torch.bool)
    for i in range(B):
        mask[i, int(torch.randint(1, T + 1, (1,), generator=g)):] = False
    if empty_row:
        mask[1] = False
    d = lambda x: x.to(dtype)  # noqa: E731
    lp = d(-torch.rand(B, T, generator=g, dtype=torch.float64) * 3)
    ref = d(lp.double() + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5)
    return dict(
        lp=lp, ref=ref, mask=mask,
        kl_ref=d(lp.double() + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4),
        sampling=d(lp.double() + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.6),
        entropies=(torch.rand(B, T, generator=g) * 3).to(dtype),  # fp32-exact: one quantile in both dtypes
        adv=d(torch.randn(*((B,) if adv_dim == 1 else (B, T)), generator=g, dtype=torch.float64)),
        tool_mask=(torch.rand(B, T, generator=g) > 0.25).long(),
        is_tok=d(torch.exp(torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2)),
    )


def _run(fn, x, kw, with_entropies):
    lp = x["lp"].clone().requires_grad_()
    ent = x["entropies"].clone().requires_grad_() if with_entropies else None
    loss, metrics = fn(lp, x["ref"], x["adv"], x["mask"], **kw, **({"entropies": ent} if with_entropies else {}))
    loss.backward()
    return loss, lp.grad, None if ent is None else ent.grad, metrics


def _check(x, **kw):
    """hk.losses.grpo == hk.reference.grpo on ``x``; returns the largest difference seen."""
    needs_entropies = kw.get("top_entropy_quantile", 1.0) < 1 or kw.get("entropy_coef", 0.0) != 0 \
        or kw.get("use_adaptive_entropy", False)
    with_entropies = needs_entropies or kw.pop("with_entropies", False)
    got = _run(hk.losses.grpo, x, kw, with_entropies)
    want = _run(hk.reference.grpo, x, kw, with_entropies)
    tol = TOL[x["lp"].dtype]
    errs = []
    for what, a, b in (("loss", got[0], want[0]), ("grad", got[1], want[1]), ("entropy grad", got[2], want[2])):
        if a is None or b is None:
            assert a is None and b is None, what
            continue
        assert torch.isfinite(a).all(), what
        torch.testing.assert_close(a, b, msg=lambda m, w=what: f"{w}: {m}", **tol)
        errs.append((a.double() - b.double()).abs().max().item())
    assert got[0].dtype == x["lp"].dtype
    assert set(got[3]) == set(want[3]), (set(got[3]) ^ set(want[3]))
    for key in want[3]:
        torch.testing.assert_close(got[3][key].double(), want[3][key].double(), msg=key, **tol)
        assert not got[3][key].requires_grad, key
    return max(errs)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("clip", CLIPS.values(), ids=CLIPS.keys())
@pytest.mark.parametrize("loss_type", TYPES)
def test_loss_types_levels_and_kl(loss_type, clip, dtype):
    eps_high = 1.3 if loss_type == "cispo" else 0.28  # cispo's epsilon_high caps the ratio itself
    for adv_dim, level, (beta, corr) in itertools.product((1, 2), ("token", "sequence"),
                                                         ((0.0, True), (0.04, True), (0.04, False))):
        x = _inputs(seed=1, dtype=dtype, adv_dim=adv_dim)
        _check(x, clip=clip, loss_type=loss_type, importance_sampling_level=level, beta=beta, epsilon_high=eps_high,
               use_bias_correction_kl=corr, kl_ref_logps=x["kl_ref"] if beta else None,
               max_completion_length=9 if loss_type == "dr_grpo" else None)


OPTIONS = {
    "delta": lambda x: dict(delta=1.1),
    "off_policy_sampling": lambda x: dict(off_policy_mask_threshold=0.05, sampling_per_token_logps=x["sampling"]),
    "top_entropy": lambda x: dict(top_entropy_quantile=0.4),
    "entropy_bonus": lambda x: dict(entropy_coef=0.03),
    "entropy_bonus_top": lambda x: dict(entropy_coef=0.03, top_entropy_quantile=0.3),
    "adaptive_applies": lambda x: dict(use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=0.5,
                                       last_world_entropy=0.4),
    "adaptive_waits": lambda x: dict(use_adaptive_entropy=True, entropy_coef=0.05, last_world_entropy=math.inf),
    "adaptive_at_target": lambda x: dict(use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=0.5,
                                         last_world_entropy=0.5),  # at the target the bonus applies
    "entropies_metric_only": lambda x: dict(with_entropies=True),
    "tool_mask": lambda x: dict(tool_mask=x["tool_mask"]),
    "tool_mask_bool": lambda x: dict(tool_mask=x["tool_mask"].bool()),
    "normalizer": lambda x: dict(normalizer=torch.tensor(37.0, dtype=x["lp"].dtype)),
    "normalizer_number": lambda x: dict(normalizer=23.5),
    "sapo_temps": lambda x: dict(sapo_temperature_pos=0.7, sapo_temperature_neg=1.6),
    "vespo_params": lambda x: dict(vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.0, vespo_lambda_neg=1.0),
    "is_token": lambda x: dict(importance_sampling_ratio=x["is_tok"]),
    "is_sequence_B1": lambda x: dict(importance_sampling_ratio=x["is_tok"][:, :1].clone()),
    "is_sequence_B": lambda x: dict(importance_sampling_ratio=x["is_tok"][:, 0].clone()),
}
SKIP = {"delta": set(TYPES) - set(GRPO_PPO_CLIP_TYPES), "normalizer": {"grpo", "dr_grpo", "sapo", "luspo"},
        "normalizer_number": {"grpo", "dr_grpo", "sapo", "luspo"}, "is_sequence_B1": {"vespo"},
        "is_sequence_B": {"vespo"}}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("loss_type", TYPES)
def test_each_option(loss_type, option, dtype):
    if loss_type in SKIP.get(option, ()):
        pytest.skip("refused for this loss type (tested in test_refusals)")
    for clip, adv_dim, level in itertools.product(CLIPS.values(), (1, 2), ("token", "sequence")):
        x = _inputs(seed=2, dtype=dtype, adv_dim=adv_dim)
        _check(x, clip=clip, loss_type=loss_type, importance_sampling_level=level, beta=0.02,
               epsilon_high=1.3 if loss_type == "cispo" else 0.28, **OPTIONS[option](x))


def test_off_policy_mask_reads_ref_logps_without_sampler_logps():
    # humanline off: TRL's fallback, the old log-probs (here ref_logps) as the sampler's
    for loss_type in TYPES:
        x = _inputs(seed=3)
        _check(x, clip=None, loss_type=loss_type, off_policy_mask_threshold=0.02,
               epsilon_high=1.3 if loss_type == "cispo" else 0.2)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("loss_type", TYPES)
def test_all_options_at_once_with_an_empty_row(loss_type, dtype):
    for clip, level in itertools.product(CLIPS.values(), ("token", "sequence")):
        x = _inputs(B=7, T=8, seed=4, dtype=dtype, adv_dim=2, empty_row=True)
        kw = dict(clip=clip, loss_type=loss_type, importance_sampling_level=level, beta=0.03,
                  kl_ref_logps=x["kl_ref"], use_bias_correction_kl=True, off_policy_mask_threshold=0.01,
                  sampling_per_token_logps=x["sampling"], top_entropy_quantile=0.6, entropy_coef=0.02,
                  tool_mask=x["tool_mask"], importance_sampling_ratio=x["is_tok"],
                  epsilon_high=1.3 if loss_type == "cispo" else 0.28)
        if loss_type in GRPO_PPO_CLIP_TYPES:
            kw["delta"] = 1.15
        _check(x, **kw)


@pytest.mark.parametrize("loss_type", TYPES)
def test_all_masked_rows_give_no_nan(loss_type):
    x = _inputs(B=3, T=4, seed=5)
    x["mask"][:] = False
    lp = x["lp"].clone().requires_grad_()
    ent = x["entropies"].clone().requires_grad_()
    loss, metrics = hk.losses.grpo(lp, x["ref"], x["adv"], x["mask"], loss_type=loss_type, beta=0.1,
                                   top_entropy_quantile=0.5, entropies=ent, entropy_coef=0.1,
                                   importance_sampling_level="sequence",
                                   epsilon_high=1.3 if loss_type == "cispo" else 0.2)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.isfinite(lp.grad).all() and not lp.grad.any() and not ent.grad.any()
    assert all(torch.isfinite(v) for v in metrics.values()), metrics
    _check(_inputs(B=3, T=4, seed=5) | {"mask": x["mask"]}, loss_type=loss_type, beta=0.1, entropy_coef=0.1,
           epsilon_high=1.3 if loss_type == "cispo" else 0.2)


def test_entropy_mask_keyword_is_the_callers_high_entropy_mask():
    """A caller's mask (TRL's, over every rank) replaces this batch's quantile: with the quantile's own mask, the
    same loss; with another, the loss follows the mask given."""
    x = _inputs(seed=6)
    kw = dict(loss_type="dapo", top_entropy_quantile=0.4, entropy_coef=0.05, entropies=x["entropies"])
    own = hk.losses.grpo_high_entropy_mask(x["entropies"], x["mask"], 0.4)
    a, _ = hk.losses.grpo(x["lp"], x["ref"], x["adv"], x["mask"], **kw)
    b, _ = hk.losses.grpo(x["lp"], x["ref"], x["adv"], x["mask"], **kw, entropy_mask=own)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    other = x["mask"] & (torch.arange(x["mask"].shape[1]) % 2 == 0)
    c, _ = hk.losses.grpo(x["lp"], x["ref"], x["adv"], x["mask"], **kw, entropy_mask=other)
    want, _ = hk.losses.grpo(x["lp"], x["ref"], x["adv"], x["mask"] & other,
                             **dict(kw, top_entropy_quantile=1.0, entropy_coef=0.0), normalizer=x["mask"].sum())
    want = want - 0.05 * x["entropies"][other].mean()
    torch.testing.assert_close(c, want)
    with pytest.raises(ValueError, match="entropy_mask .* needs top_entropy_quantile < 1"):
        hk.losses.grpo(x["lp"], x["ref"], x["adv"], x["mask"], entropy_mask=own)


def test_default_options_are_the_kernels_loss():
    """The params' new fields default to the kernels' loss: compute() with GRPO() equals the four-type loss."""
    from humanline_kernels import _params as P
    x = _inputs(seed=7)
    for loss_type in ("dapo", "bnpo", "grpo", "dr_grpo"):
        p = P.GRPO(loss_type=loss_type, beta=0.05)
        loss, met = hk.losses.compute(p, x["lp"], x["ref"], x["mask"], P.GRPOInputs(x["adv"]))
        want, want_met = hk.reference.grpo(x["lp"], x["ref"], x["adv"], x["mask"], loss_type=loss_type, beta=0.05)
        torch.testing.assert_close(loss, want)
        assert set(met) == {"unclipped_frac", "kl", "clip_frac_low", "clip_frac_high"}


def test_refusals():
    x = _inputs(seed=8)
    args = (x["lp"], x["ref"], x["adv"], x["mask"])
    with pytest.raises(ValueError, match="loss_type must be one of"):
        hk.losses.grpo(*args, loss_type="ppo")
    with pytest.raises(ValueError, match="delta .* applies to loss_type"):
        hk.losses.grpo(*args, loss_type="sapo", delta=1.2)
    with pytest.raises(ValueError, match="needs sampling_per_token_logps"):  # humanline: no sampler in ref_logps
        hk.losses.grpo(*args, off_policy_mask_threshold=0.1)
    with pytest.raises(ValueError, match="entropies"):
        hk.losses.grpo(*args, entropy_coef=0.1)
    with pytest.raises(ValueError, match="vespo"):
        hk.losses.grpo(*args, loss_type="vespo", importance_sampling_ratio=x["is_tok"][:, :1])
    with pytest.raises(ValueError, match="normalizer applies"):
        hk.losses.grpo(*args, loss_type="luspo", normalizer=3.0)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        hk.losses.grpo(*args, importance_sampling_level="row")
    with pytest.raises(ValueError, match="kl_ref_logps"):
        hk.losses.grpo(*args, kl_ref_logps=x["ref"][:, :3])
    with pytest.raises(ValueError, match="tool_mask"):
        hk.losses.grpo(*args, tool_mask=x["is_tok"])


def test_vllm_weight_modes_through_the_loss():
    """The four vLLM importance-sampling modes' weights ([B, T] token_*, [B, 1] sequence_*) as the loss's weight."""
    for mode in VLLM_IS_MODES:
        x = _inputs(seed=9)
        w = hk.reference.vllm_importance_sampling_ratio(x["ref"], x["sampling"], x["mask"],
                                                        vllm_importance_sampling_mode=mode,
                                                        vllm_importance_sampling_clip_min=0.8)
        for loss_type in TYPES:
            if loss_type == "vespo" and mode.startswith("sequence"):
                continue
            _check(x, clip=CLIPS["humanline"], loss_type=loss_type, importance_sampling_ratio=w,
                   epsilon_high=1.3 if loss_type == "cispo" else 0.2)
