"""hk.reference against TRL 1.16's own loss code, humanline off (``clip=None``): loss, gradients and metrics.

TRL is driven, not re-typed: each test builds a ``DPOTrainer`` / ``KTOTrainer`` / ``GRPOTrainer`` without running
its ``__init__`` (no model, no dataset), sets the attributes its ``_compute_loss`` reads, and gives it a stub model
that returns our per-token log-probs (a differentiable leaf) the way TRL's fused LM head does (0 where the label is
-100). The same leaf values go to hk.reference; loss and ``.grad`` must agree to 1e-5 (fp32 and fp64 inputs).
"""
import contextlib
import itertools
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

trl = pytest.importorskip("trl")
from trl import DPOTrainer, GRPOTrainer, KTOTrainer  # noqa: E402

import humanline_kernels as hk  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)
DTYPES = [torch.float32, torch.float64]
DTYPE_IDS = ["fp32", "fp64"]


class _Accelerator:
    """Single-process stand-in for the ``accelerate.Accelerator`` calls in the trainers' loss code."""
    device = torch.device("cpu")
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x

    def unwrap_model(self, model):
        return model

    def autocast(self):
        return contextlib.nullcontext()


class _FusedHeadStub(torch.nn.Module):
    """What ``model(..., labels=..., fused_lm_head=True)`` returns after TRL's ``add_fused_lm_head``: per-token
    outputs of shape ``(B, L - 1)``. ``by_input`` maps an ``input_ids`` tensor (by identity) to its outputs."""
    is_gradient_checkpointing = False

    def __init__(self, by_input):
        super().__init__()
        self.by_input = by_input

    def forward(self, input_ids=None, labels=None, fused_lm_head=False, **kwargs):
        assert fused_lm_head
        for ids, out in self.by_input:
            if ids is input_ids:
                return SimpleNamespace(aux_loss=None, **out)
        raise AssertionError("unexpected input_ids")


def _bare(cls, **attrs):
    trainer = object.__new__(cls)
    trainer.accelerator = _Accelerator()
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer._total_train_tokens = 0
    trainer._tp_size = 1
    trainer.aux_loss_enabled = False
    trainer.precompute_ref_logps = False
    for k, v in attrs.items():
        setattr(trainer, k, v)
    return trainer


def _completion_batch(B, L, seed, dtype, *, min_len=1):
    """Token ids and a completion mask in TRL's layout (prompt, completion, padding), with per-token log-probs:
    ``lp`` and ``ref`` ``[B, L - 1]``, ``mask = completion_mask[:, 1:]``. Every prompt is non-empty."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 50, (B, L), generator=g)
    completion_mask = torch.zeros(B, L, dtype=torch.long)
    for i in range(B):
        start = int(torch.randint(1, 3, (1,), generator=g))
        length = int(torch.randint(min_len, L - start + 1, (1,), generator=g))
        completion_mask[i, start:start + length] = 1
    mask = completion_mask[:, 1:].bool()
    lp = -torch.rand(B, L - 1, generator=g, dtype=torch.float64).to(dtype) * 3
    ref = (lp.double() + torch.randn(B, L - 1, generator=g, dtype=torch.float64) * 0.7).to(dtype)
    extra = {
        "entropy": torch.rand(B, L - 1, generator=g).to(dtype) * 4,
        "mean_logits": torch.randn(B, L - 1, generator=g).to(dtype),
        "is_top1": torch.rand(B, L - 1, generator=g) > 0.5,
        "log_sum_sq_probs": (-torch.rand(B, L - 1, generator=g, dtype=torch.float64) * 2).to(dtype),
    }
    return input_ids, completion_mask, mask, lp, ref, extra


def _assert_same(got, want, what):
    err = (got.detach().double() - want.detach().double()).abs().max().item()
    torch.testing.assert_close(got.detach().double(), want.detach().double(), msg=lambda m: f"{what}: {m}", **TOL)
    return err


# ---------------------------------------------------------------------------------------------------------------
# DPO: DPOTrainer._compute_loss


def _trl_dpo(P, L, seed, dtype, *, loss_type, loss_weights=None, beta=0.1, label_smoothing=0.0, ld_alpha=None,
             f_divergence_type="reverse_kl", f_alpha_divergence_coef=0.5, use_weighting=False, discopop_tau=0.05,
             chosen_shift=0.0):
    input_ids, completion_mask, mask, lp0, ref, extra = _completion_batch(2 * P, L, seed, dtype)
    ref[:P] -= chosen_shift  # raises the chosen rows' log-ratios (to reach the alpha-divergence's exponent cap)
    lp_trl = lp0.clone().requires_grad_()
    policy = _FusedHeadStub([(input_ids, {"log_probs": lp_trl * mask, **extra})])
    reference = _FusedHeadStub([(input_ids, {"log_probs": ref * mask})])
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    trainer = _bare(DPOTrainer, model=policy, ref_model=reference, beta=beta, loss_types=types,
                    loss_weights=loss_weights or [1.0] * len(types), ld_alpha=ld_alpha,
                    f_divergence_type=f_divergence_type, f_alpha_divergence_coef=f_alpha_divergence_coef,
                    label_smoothing=label_smoothing, use_weighting=use_weighting,
                    args=SimpleNamespace(discopop_tau=discopop_tau, gradient_checkpointing_kwargs=None))
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
              "completion_mask": completion_mask}
    loss = trainer._compute_loss(policy, inputs, return_outputs=False)
    loss.backward()
    return loss, lp_trl.grad, trainer._metrics["train"], (lp0, ref, mask, extra["log_sum_sq_probs"])


def _check_dpo(P=3, L=9, seed=0, dtype=torch.float64, ours=None, **kw):
    kw_ours = {k: v for k, v in kw.items() if k != "chosen_shift"}
    trl_loss, trl_grad, trl_metrics, (lp0, ref, mask, lss) = _trl_dpo(P, L, seed, dtype, **kw)
    ours = dict(ours or {})
    for k in ("beta", "label_smoothing", "ld_alpha", "f_divergence_type", "f_alpha_divergence_coef", "discopop_tau",
              "use_weighting", "loss_type", "loss_weights"):
        if k in kw_ours and k not in ours:
            ours[k] = kw_ours[k]
    if ours.get("use_weighting"):
        ours["log_sum_sq_probs"] = lss
    lp = lp0.clone().requires_grad_()
    loss, metrics = hk.reference.dpo(lp, ref, mask, clip=None, **ours)
    loss.backward()
    assert loss.dtype == dtype
    errs = [_assert_same(loss, trl_loss, "loss"), _assert_same(lp.grad, trl_grad, "grad")]
    for ours_key, trl_key in (("rewards_chosen", "rewards/chosen"), ("rewards_rejected", "rewards/rejected"),
                              ("reward_margin", "rewards/margins"), ("reward_accuracy", "rewards/accuracies")):
        assert metrics[ours_key].item() == pytest.approx(trl_metrics[trl_key][-1], rel=1e-5, abs=1e-6), ours_key
    return max(errs)


ALL_DPO_TYPES = ["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                 "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"]
# TRL 1.16 reads label_smoothing only in these; "sigmoid" is compared at 0 (see the cDPO test below)
SMOOTHED = {"exo_pair": 1e-3, "robust": 0.1, "aot": 0.1, "aot_unpaired": 0.1}


def test_every_trl_dpo_loss_type_is_covered():
    assert tuple(ALL_DPO_TYPES) == hk._validation.DPO_LOSS_TYPES


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("loss_type", ALL_DPO_TYPES)
def test_dpo_each_loss_type_matches_trl(loss_type, dtype):
    _check_dpo(dtype=dtype, loss_type=loss_type, beta=0.3, label_smoothing=SMOOTHED.get(loss_type, 0.0), seed=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_dpo_weighted_mixtures_match_trl(dtype):
    # MPO's mixture; then every loss type at once with distinct weights, in two halves: exo_pair needs
    # label_smoothing > 0, which our "sigmoid" reads (cDPO) and TRL's ignores
    _check_dpo(dtype=dtype, loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0], seed=2)
    for dropped, ls in (("exo_pair", 0.0), ("sigmoid", 1e-3)):
        mix = [t for t in ALL_DPO_TYPES if t != dropped]
        _check_dpo(dtype=dtype, loss_type=mix, loss_weights=[0.1 * (k + 1) for k in range(len(mix))], beta=0.2,
                   label_smoothing=ls, seed=3)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rpo_alpha", [0.5, 1.0])
def test_dpo_rpo_alpha_is_trls_sft_term(dtype, rpo_alpha):
    # TRL 1.16 has no rpo_alpha: RPO is loss_type [..., "sft"] with loss_weights [..., alpha]
    _check_dpo(dtype=dtype, loss_type=["sigmoid", "sft"], loss_weights=[1.0, rpo_alpha], seed=4,
               ours={"loss_type": "sigmoid", "rpo_alpha": rpo_alpha, "loss_weights": None})
    _check_dpo(dtype=dtype, loss_type=["ipo", "sft"], loss_weights=[0.7, rpo_alpha], seed=5,
               ours={"loss_type": ["ipo"], "loss_weights": [0.7], "rpo_alpha": rpo_alpha})


F_DIV_TYPES = ["sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"]


@pytest.mark.parametrize("f_div,coef", [("forward_kl", 0.5), ("js_divergence", 0.5), ("alpha_divergence", 0.5),
                                        ("alpha_divergence", 1.0), ("alpha_divergence", 1.7),
                                        ("reverse_kl", 0.5)])
@pytest.mark.parametrize("loss_type", F_DIV_TYPES)
def test_dpo_f_divergences_match_trl(f_div, coef, loss_type):
    # fp32: TRL's alpha-divergence looks its exponent cap up by dtype and has no float64 entry
    _check_dpo(dtype=torch.float32, loss_type=loss_type, f_divergence_type=f_div, f_alpha_divergence_coef=coef,
               label_smoothing=SMOOTHED.get(loss_type, 0.0), beta=0.5, seed=6)


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "discopop"])
def test_dpo_alpha_divergence_exponent_cap_matches_trl(loss_type):
    # chosen log-ratio sums of ~100: (alpha - 1) s passes TRL's cap of 80 on the chosen rows only
    _check_dpo(dtype=torch.float32, loss_type=loss_type, f_divergence_type="alpha_divergence",
               f_alpha_divergence_coef=1.9, beta=1e-36, chosen_shift=25.0, seed=6)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("ld_alpha", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "aot", "apo_down", "sft", "sigmoid_norm"])
def test_dpo_ld_alpha_matches_trl(dtype, ld_alpha, loss_type):
    _check_dpo(dtype=dtype, loss_type=loss_type, ld_alpha=ld_alpha, label_smoothing=SMOOTHED.get(loss_type, 0.0),
               L=12, seed=7)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "nca_pair", "discopop", ["sigmoid", "bco_pair"]])
def test_dpo_wpo_weighting_matches_trl(dtype, loss_type):
    _check_dpo(dtype=dtype, loss_type=loss_type, use_weighting=True, seed=8)


def test_dpo_wpo_with_sft_crashes_in_trl_but_not_here():
    # TRL multiplies the expanded (stride-0) sft tensor in place: RuntimeError. Ours is the evident formula.
    with pytest.raises(RuntimeError):
        _trl_dpo(2, 6, 0, torch.float64, loss_type="sft", use_weighting=True)
    _, _, _, (lp, ref, mask, lss) = _trl_dpo(2, 6, 0, torch.float64, loss_type="sigmoid")
    loss, _ = hk.reference.dpo(lp, ref, mask, clip=None, loss_type="sft", use_weighting=True, log_sum_sq_probs=lss)
    w = torch.exp(torch.where(mask, lp - lss, 0.0).sum(1) / mask.sum(1))
    nll = -torch.where(mask[:2], lp[:2], 0.0).sum() / mask[:2].sum()
    torch.testing.assert_close(loss, (nll * w[:2] * w[2:]).mean())


def test_dpo_sigmoid_label_smoothing_is_cdpo_while_trl_ignores_it():
    trl_loss, _, _, (lp, ref, mask, _) = _trl_dpo(3, 8, 9, torch.float64, loss_type="sigmoid", label_smoothing=0.2)
    plain, _ = hk.reference.dpo(lp, ref, mask, clip=None)
    cdpo, _ = hk.reference.dpo(lp, ref, mask, clip=None, label_smoothing=0.2)
    torch.testing.assert_close(plain, trl_loss.detach())
    assert abs(cdpo.item() - trl_loss.item()) > 1e-3


# ---------------------------------------------------------------------------------------------------------------
# KTO: KTOTrainer._compute_loss (and _compute_kl_logps)


def _check_kto(loss_type, dtype, label, *, beta=0.2, desirable_weight=1.3, undesirable_weight=0.6, seed=0,
               kl_estimate="trl"):
    B, L = len(label), 8
    input_ids, completion_mask, mask, lp0, ref, extra = _completion_batch(B, L, seed, dtype)
    kl_ids, kl_completion_mask, kl_mask, kl_lp, kl_ref, _ = _completion_batch(B, L, seed + 100, dtype)
    calculate_kl = loss_type == "kto"
    lp_trl = lp0.clone().requires_grad_()
    policy = _FusedHeadStub([(input_ids, {"log_probs": lp_trl * mask, **extra}),
                             (kl_ids, {"log_probs": kl_lp * kl_mask})])
    reference = _FusedHeadStub([(input_ids, {"log_probs": ref * mask}), (kl_ids, {"log_probs": kl_ref * kl_mask})])
    trainer = _bare(KTOTrainer, model=policy, ref_model=reference, beta=beta, loss_type=loss_type,
                    desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
                    calculate_KL=calculate_kl, args=SimpleNamespace(gradient_checkpointing_kwargs=None))
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "completion_mask": completion_mask,
             "label": torch.tensor(label)}
    if calculate_kl:
        batch.update(KL_input_ids=kl_ids, KL_attention_mask=torch.ones_like(kl_ids),
                     KL_completion_mask=kl_completion_mask)
    trl_loss = trainer._compute_loss(policy, batch, return_outputs=False)
    trl_loss.backward()
    lp = lp0.clone().requires_grad_()
    kl_args = (kl_lp, kl_ref, kl_mask) if calculate_kl else ()
    loss, metrics = hk.reference.kto(lp, ref, mask, torch.tensor(label), *kl_args, clip=None, beta=beta,
                                     desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
                                     loss_type=loss_type, kl_estimate=kl_estimate)
    loss.backward()
    errs = [_assert_same(loss, trl_loss, "loss"), _assert_same(lp.grad, lp_trl.grad, "grad")]
    assert metrics["kl"].item() == pytest.approx(trainer._metrics["train"]["kl"][-1], rel=1e-5, abs=1e-7)
    return max(errs)


LABELS = {"mixed": [True, False, True, True, False], "all_desirable": [True] * 4, "all_undesirable": [False] * 3}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("labels", list(LABELS), ids=list(LABELS))
@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_loss_types_match_trl(loss_type, labels, dtype):
    for seed in (0, 1, 2):
        _check_kto(loss_type, dtype, LABELS[labels], seed=seed)


def test_kto_halos_and_trl_kl_estimates_agree_without_empty_kl_rows():
    # no KL row sums to exactly 0 here, so HALOs' mean over non-zero rows is TRL's mean over all rows
    _check_kto("kto", torch.float64, LABELS["mixed"], seed=3, kl_estimate="halos")


def test_kto_kl_estimates_differ_on_an_empty_kl_row():
    lp, ref, mask = -torch.rand(2, 3, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.float64), \
        torch.ones(2, 3, dtype=torch.bool)
    kl = torch.tensor([[0.4, 0.2], [0.0, 0.0]], dtype=torch.float64)  # row sums 0.6 and 0 (an empty row)
    args = (lp, ref, mask, torch.tensor([True, False]), kl, torch.zeros_like(kl), torch.ones(2, 2, dtype=torch.bool))
    assert hk.reference.kto(*args, clip=None)[1]["kl"].item() == pytest.approx(0.6)
    assert hk.reference.kto(*args, clip=None, kl_estimate="trl")[1]["kl"].item() == pytest.approx(0.3)


# ---------------------------------------------------------------------------------------------------------------
# GRPO: GRPOTrainer._compute_loss


GRPO_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]


def _grpo_inputs(B, T, seed, dtype, *, adv_dim):
    g = torch.Generator().manual_seed(seed)
    completion_mask = torch.ones(B, T, dtype=torch.long)
    for i in range(B):  # every row keeps at least 2 tokens: TRL's "grpo" averages empty rows as 0, ours skips them
        completion_mask[i, int(torch.randint(2, T + 1, (1,), generator=g)):] = 0
    lp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).to(dtype)
    old = (lp.double() + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3).to(dtype)
    ref = (lp.double() + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    sampling = (old.double() + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.6).to(dtype)
    # fp32-exact entropies, so that TRL's float32 quantile and ours pick the same tokens in fp64 too
    entropies = (torch.rand(B, T, generator=g) * 3).to(dtype)
    shape = (B,) if adv_dim == 1 else (B, T)
    advantages = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    tool_mask = (torch.rand(B, T, generator=g) > 0.2).long()
    tool_mask[:, :2] = 1
    return dict(completion_mask=completion_mask, lp=lp, old=old, ref=ref, sampling=sampling, entropies=entropies,
                advantages=advantages, tool_mask=tool_mask)


# one GRPO case: TRL's settings, each read by both sides below ("vespo" holds the vespo_* values by name)
GRPO_CASE = dict(importance_sampling_level="token", beta=0.0, epsilon_low=0.2, epsilon_high=0.28, delta=None,
                 use_bias_correction_kl=True, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo={},
                 importance_sampling_ratio=None, use_tool_mask=False, off_policy_mask_threshold=None,
                 use_sampling=False, top_entropy_quantile=1.0, entropy_coef=0.0, use_adaptive_entropy=False,
                 entropy_target=0.2, last_world_entropy=float("inf"), num_items_in_batch=None,
                 max_completion_length=7, gradient_accumulation_steps=1)


def _trl_grpo(x, **case):
    c = SimpleNamespace(**{**GRPO_CASE, **case})
    B, T = x["lp"].shape
    lp = x["lp"].clone().requires_grad_()
    ent = x["entropies"].clone().requires_grad_()
    vespo = {"vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0, **c.vespo}
    args = SimpleNamespace(
        delta=c.delta, use_bias_correction_kl=c.use_bias_correction_kl, sapo_temperature_pos=c.sapo_temperature_pos,
        sapo_temperature_neg=c.sapo_temperature_neg, steps_per_generation=1, entropy_target=c.entropy_target,
        entropy_coef_delta=0.005, entropy_coef_min=0.0, entropy_coef_max=1.0, **vespo)
    trainer = _bare(
        GRPOTrainer, model=torch.nn.Module(), args=args, loss_type=c.loss_type, beta=c.beta,
        epsilon_low=c.epsilon_low, epsilon_high=c.epsilon_high, importance_sampling_level=c.importance_sampling_level,
        off_policy_mask_threshold=c.off_policy_mask_threshold, top_entropy_quantile=c.top_entropy_quantile,
        entropy_coef=c.entropy_coef, use_adaptive_entropy=c.use_adaptive_entropy,
        _entropy_bonus_enabled=c.entropy_coef != 0.0 or c.use_adaptive_entropy,
        _last_world_entropy=c.last_world_entropy, _entropy_window_stats=None,
        use_vllm=c.importance_sampling_ratio is not None, vllm_importance_sampling_correction=True,
        current_gradient_accumulation_steps=c.gradient_accumulation_steps,
        max_completion_length=c.max_completion_length)
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (lp, ent, None)
    mask = x["completion_mask"] * (x["tool_mask"] if c.use_tool_mask else 1)
    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": x["completion_mask"],
              "advantages": x["advantages"], "old_per_token_logps": x["old"], "ref_per_token_logps": x["ref"],
              "num_items_in_batch": mask.sum() if c.num_items_in_batch is None else c.num_items_in_batch}
    if c.importance_sampling_ratio is not None:
        inputs["importance_sampling_ratio"] = c.importance_sampling_ratio
    if c.use_tool_mask:
        inputs["tool_mask"] = x["tool_mask"]
    if c.use_sampling:
        inputs["sampling_per_token_logps"] = x["sampling"]
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss, lp.grad, ent.grad, trainer


def _ours_grpo(x, **case):
    c = SimpleNamespace(**{**GRPO_CASE, **case})
    lp = x["lp"].clone().requires_grad_()
    ent = x["entropies"].clone().requires_grad_()
    mask = x["completion_mask"].bool()
    tool_mask = x["tool_mask"] if c.use_tool_mask else None
    needs_entropies = c.top_entropy_quantile < 1.0 or c.entropy_coef != 0.0 or c.use_adaptive_entropy
    normalizer = None
    if c.loss_type in ("dapo", "cispo", "vespo"):  # TRL's global token count; bnpo uses the local one
        combined = mask if tool_mask is None else mask & tool_mask.bool()
        normalizer = (combined.sum() if c.num_items_in_batch is None else c.num_items_in_batch).clamp(min=1)
    loss, metrics = hk.reference.grpo(
        lp, x["old"], x["advantages"], mask, clip=None, beta=c.beta, epsilon_low=c.epsilon_low,
        epsilon_high=c.epsilon_high, kl_ref_logps=x["ref"], loss_type=c.loss_type, normalizer=normalizer,
        max_completion_length=c.max_completion_length if c.loss_type == "dr_grpo" else None,
        importance_sampling_level=c.importance_sampling_level, delta=c.delta,
        sapo_temperature_pos=c.sapo_temperature_pos, sapo_temperature_neg=c.sapo_temperature_neg, **c.vespo,
        importance_sampling_ratio=c.importance_sampling_ratio, tool_mask=tool_mask,
        off_policy_mask_threshold=c.off_policy_mask_threshold,
        sampling_per_token_logps=x["sampling"] if c.use_sampling else None,
        top_entropy_quantile=c.top_entropy_quantile, entropies=ent if needs_entropies else None,
        entropy_coef=c.entropy_coef, use_adaptive_entropy=c.use_adaptive_entropy, entropy_target=c.entropy_target,
        last_world_entropy=c.last_world_entropy, use_bias_correction_kl=c.use_bias_correction_kl)
    loss.backward()
    return loss, lp.grad, ent.grad, metrics


def _check_grpo(x, **kw):
    trl_loss, trl_grad, trl_ent_grad, trainer = _trl_grpo(x, **kw)
    loss, grad, ent_grad, metrics = _ours_grpo(x, **kw)
    errs = [_assert_same(loss, trl_loss, "loss"), _assert_same(grad, trl_grad, "grad")]
    if trl_ent_grad is not None or ent_grad is not None:
        errs.append(_assert_same(ent_grad, trl_ent_grad, "entropy grad"))
    trl_metrics = trainer._metrics["train"]
    if kw.get("beta", 0.0) != 0.0:
        assert metrics["kl"].item() == pytest.approx(trl_metrics["kl"][-1], rel=1e-5, abs=1e-7)
    token_level = kw.get("importance_sampling_level", "token") == "token"
    if token_level and kw["loss_type"] in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        assert metrics["clip_frac_low"].item() == pytest.approx(trl_metrics["clip_ratio/low_mean"][-1], abs=1e-7)
        assert metrics["clip_frac_high"].item() == pytest.approx(trl_metrics["clip_ratio/high_mean"][-1], abs=1e-7)
    if token_level and kw["loss_type"] == "cispo":
        assert metrics["clip_frac_high"].item() == pytest.approx(trl_metrics["cispo_clip_ratio"][-1], abs=1e-7)
    return max(errs), trainer, metrics


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("adv_dim", [1, 2], ids=["adv_B", "adv_BT"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", GRPO_TYPES)
def test_grpo_loss_types_and_levels_match_trl(loss_type, level, adv_dim, dtype):
    x = _grpo_inputs(6, 7, seed=11, dtype=dtype, adv_dim=adv_dim)
    eps_high = 5.0 if loss_type == "cispo" else 0.28
    _check_grpo(x, loss_type=loss_type, importance_sampling_level=level, epsilon_high=eps_high, beta=0.0)
    _check_grpo(x, loss_type=loss_type, importance_sampling_level=level, epsilon_high=eps_high, beta=0.04,
                use_bias_correction_kl=True)
    _check_grpo(x, loss_type=loss_type, importance_sampling_level=level, epsilon_high=eps_high, beta=0.04,
                use_bias_correction_kl=False)


# one option at a time, then all at once, on every loss type (fp32: the brief's tolerance at the lower precision)
OPTIONS = {
    "delta": dict(delta=1.1),
    "off_policy_old": dict(off_policy_mask_threshold=0.1),  # thresholds where the two masks differ on this data
    "off_policy_sampling": dict(off_policy_mask_threshold=0.2, use_sampling=True),
    "top_entropy": dict(top_entropy_quantile=0.4),
    "entropy_bonus": dict(entropy_coef=0.03),
    "entropy_bonus_top": dict(entropy_coef=0.03, top_entropy_quantile=0.3),
    "adaptive_applies": dict(use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=0.5,
                             last_world_entropy=0.4),
    "adaptive_waits": dict(use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=0.5,
                           last_world_entropy=float("inf")),
    "tool_mask": dict(use_tool_mask=True),
    "normalizer": dict(num_items_in_batch=torch.tensor(37.0)),
    "sapo_temps": dict(sapo_temperature_pos=0.7, sapo_temperature_neg=1.6),
    "vespo_params": dict(vespo={"vespo_k_pos": 1.5, "vespo_lambda_pos": 2.5, "vespo_k_neg": 2.0,
                                "vespo_lambda_neg": 1.0}),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("loss_type", GRPO_TYPES)
def test_grpo_options_match_trl(loss_type, option, dtype):
    kw = dict(OPTIONS[option])
    if option == "delta" and loss_type not in hk._validation.GRPO_PPO_CLIP_TYPES:
        pytest.skip("delta applies to the PPO-clip loss types only (refused for the others)")
    if option == "normalizer" and loss_type not in ("dapo", "cispo", "vespo"):
        pytest.skip("TRL's num_items_in_batch is read by dapo/cispo/vespo only")
    for adv_dim, level in itertools.product((1, 2), ("token", "sequence")):
        x = _grpo_inputs(6, 7, seed=12, dtype=dtype, adv_dim=adv_dim)
        _check_grpo(x, loss_type=loss_type, importance_sampling_level=level, beta=0.02,
                    epsilon_high=5.0 if loss_type == "cispo" else 0.28, **kw)


def _is_ratio(x, mode, clip_min=None, clip_max=1.3, use_tool_mask=False):
    # TRL forms the weight over completion_mask * tool_mask (1 on the other tokens)
    mask = x["completion_mask"].bool() & (x["tool_mask"].bool() if use_tool_mask else True)
    return hk.reference.vllm_importance_sampling_ratio(
        x["old"], x["sampling"], mask, vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min,
        vllm_importance_sampling_clip_max=clip_max)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("loss_type", GRPO_TYPES)
def test_grpo_vllm_importance_sampling_weight_matches_trl(loss_type, mode, dtype):
    if loss_type == "vespo" and mode.startswith("sequence"):
        pytest.skip("TRL refuses VESPO with the sequence_* modes (and so do we: the shape is checked)")
    x = _grpo_inputs(6, 7, seed=13, dtype=dtype, adv_dim=1)
    weight = _is_ratio(x, mode, clip_min=0.8 if mode.endswith("mask") else None)
    assert weight.shape == ((6, 7) if mode.startswith("token") else (6, 1))
    for level in ("token", "sequence"):
        _check_grpo(x, loss_type=loss_type, importance_sampling_level=level, beta=0.02,
                    importance_sampling_ratio=weight, epsilon_high=5.0 if loss_type == "cispo" else 0.28)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("loss_type", GRPO_TYPES)
def test_grpo_all_options_at_once_match_trl(loss_type, dtype):
    x = _grpo_inputs(8, 9, seed=14, dtype=dtype, adv_dim=2)
    weight = _is_ratio(x, "token_truncate", clip_min=0.5, clip_max=1.2, use_tool_mask=True)
    kw = dict(loss_type=loss_type, beta=0.03, off_policy_mask_threshold=0.01, use_sampling=True,
              top_entropy_quantile=0.6, entropy_coef=0.02, use_tool_mask=True, importance_sampling_ratio=weight,
              epsilon_high=5.0 if loss_type == "cispo" else 0.28)
    if loss_type in hk._validation.GRPO_PPO_CLIP_TYPES:
        kw["delta"] = 1.15
    for level in ("token", "sequence"):
        _check_grpo(x, importance_sampling_level=level, **kw)


def test_grpo_adaptive_entropy_state_follows_trls_controller():
    # TRL updates its coefficient at the optimizer-step boundary; adaptive_entropy_coef is that update, and the
    # window totals it reads are our metrics entropy_sum / entropy_tokens
    x = _grpo_inputs(6, 7, seed=15, dtype=torch.float64, adv_dim=1)
    for target, coef in ((10.0, 0.05), (0.1, 0.05), (10.0, 0.999), (0.1, 0.002)):
        _, trainer, metrics = _check_grpo(x, loss_type="dapo", use_adaptive_entropy=True, entropy_coef=coef,
                                          entropy_target=target, last_world_entropy=0.0, top_entropy_quantile=0.5)
        world = (metrics["entropy_sum"] / metrics["entropy_tokens"]).item()
        assert trainer._last_world_entropy == pytest.approx(world)
        assert trainer.entropy_coef == pytest.approx(hk.reference.adaptive_entropy_coef(
            coef, world, entropy_target=target, entropy_coef_delta=0.005, entropy_coef_min=0.0, entropy_coef_max=1.0))


def test_grpo_gradient_accumulation_scaling_is_the_trainers():
    # TRL divides grpo/bnpo/dr_grpo/luspo/sapo by the accumulation steps; the reference gives one micro-batch's loss
    x = _grpo_inputs(6, 7, seed=16, dtype=torch.float64, adv_dim=1)
    for loss_type in ("grpo", "bnpo", "dr_grpo", "luspo", "sapo"):
        trl_loss, *_ = _trl_grpo(x, loss_type=loss_type, gradient_accumulation_steps=4)
        loss, *_ = _ours_grpo(x, loss_type=loss_type)
        torch.testing.assert_close(loss.detach() / 4, trl_loss.detach())


def test_grpo_empty_row_grpo_mean_differs_from_trl_by_design():
    x = _grpo_inputs(4, 5, seed=17, dtype=torch.float64, adv_dim=1)
    x["completion_mask"][1] = 0
    trl_loss, *_ = _trl_grpo(x, loss_type="grpo")
    loss, *_ = _ours_grpo(x, loss_type="grpo")
    torch.testing.assert_close(loss.detach() * 3 / 4, trl_loss.detach())  # TRL averages the empty row in as 0
