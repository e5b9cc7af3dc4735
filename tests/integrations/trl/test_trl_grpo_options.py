"""Every TRL 1.16 GRPO option through ``HumanlineGRPOTrainer`` with ``humanline=False`` equals TRL's own
``GRPOTrainer`` on the same batch (TRL is the oracle): loss and every parameter's gradient, fp32, 1e-5, at every
``fused`` level; also TRL's logged metrics and its adaptive-entropy controller state. The two trainers are built
once per level; each case sets TRL's options on both (where TRL reads them: the trainer's attributes and its
args) and runs one micro-batch through each ``_compute_loss``."""
import pytest
import torch

pytest.importorskip("trl")
from test_integrations_trl import COMMON, GRPO_KW, TRL_DEPRECATIONS, digit_reward, grpo_data, tiny  # noqa: E402
from test_integrations_trl import tiny_path as tiny_path  # noqa: E402  (the fixture)
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import humanline_kernels as hk  # noqa: E402
from humanline_kernels.integrations.trl import HumanlineGRPOConfig, HumanlineGRPOTrainer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error::FutureWarning", *TRL_DEPRECATIONS)

TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
PPO_CLIP = ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]
FUSED = ["off", "logits", "linear"]
TOL = dict(rtol=1e-5, atol=1e-5)

# TRL's defaults for every option a case may change; each case overrides some of them
TRAINER_DEFAULTS = dict(loss_type="dapo", beta=0.05, epsilon_low=0.2, epsilon_high=0.28,
                        importance_sampling_level="token", off_policy_mask_threshold=None, top_entropy_quantile=1.0,
                        entropy_coef=0.0, use_adaptive_entropy=False, use_vllm=False,
                        vllm_importance_sampling_correction=True, current_gradient_accumulation_steps=1)
ARGS_DEFAULTS = dict(delta=None, use_bias_correction_kl=True, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
                     vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0,
                     entropy_target=0.2, steps_per_generation=1)


@pytest.fixture(scope="module")
def pairs(tiny_path):  # noqa: F811
    """Per fused level: (stock trainer, ours, one generated micro-batch with TRL's extra inputs)."""
    tok = tiny.tiny_tokenizer()
    kw = dict(COMMON, **GRPO_KW, output_dir=tiny_path + "/opts", max_steps=1, beta=0.05)
    out = {}
    for fused in FUSED:
        stock = GRPOTrainer(tiny_path, reward_funcs=digit_reward, args=GRPOConfig(**kw), train_dataset=grpo_data(),
                            processing_class=tok)
        ours = HumanlineGRPOTrainer(tiny_path, reward_funcs=digit_reward, train_dataset=grpo_data(),
                                    args=HumanlineGRPOConfig(**kw, humanline=False, fused=fused), processing_class=tok)
        stock.model.train()
        out[fused] = (stock, ours, _batch(stock))
    return out


def _batch(stock):
    """A generated micro-batch plus what TRL's generation adds in the other settings: old log-probs (off-policy
    generation, vLLM), the sampler's log-probs and vLLM's importance weight, a tool mask, per-token advantages."""
    inputs = stock._prepare_inputs(next(iter(stock.get_train_dataloader())))
    g = torch.Generator().manual_seed(0)
    ref = inputs["ref_per_token_logps"]
    noise = lambda s: s * torch.randn(ref.shape, generator=g)  # noqa: E731
    old = ref + noise(0.3)
    sampling = old + noise(0.5)
    tool = (torch.rand(ref.shape, generator=g) > 0.2).long()
    tool[:, 0] = 1
    extra = {"old_per_token_logps": old, "sampling_per_token_logps": sampling, "tool_mask": tool,
             "advantages_BT": inputs["advantages"][:, None] + noise(0.5)}
    return inputs, extra


def _case_inputs(base, extra, case):
    inputs = dict(base, old_per_token_logps=extra["old_per_token_logps"])
    if case.get("sampling"):
        inputs["sampling_per_token_logps"] = extra["sampling_per_token_logps"]
    if case.get("tool_mask"):
        inputs["tool_mask"] = extra["tool_mask"]
    if case.get("adv_BT"):
        inputs["advantages"] = extra["advantages_BT"]
    if case.get("is_mode"):  # formed as TRL does at generation, over the completion and tool masks
        mode, mask = case["is_mode"], inputs["completion_mask"].bool()
        inputs["importance_sampling_ratio"] = hk.reference.vllm_importance_sampling_ratio(
            extra["old_per_token_logps"], extra["sampling_per_token_logps"],
            mask & extra["tool_mask"].bool() if case.get("tool_mask") else mask, vllm_importance_sampling_mode=mode,
            vllm_importance_sampling_clip_min=0.5 if mode.endswith("mask") else None,
            vllm_importance_sampling_clip_max=2.0)
    return inputs


def _configure(trainer, case):
    for k, v in TRAINER_DEFAULTS.items():
        setattr(trainer, k, case.get(k, v))
    for k, v in ARGS_DEFAULTS.items():
        setattr(trainer.args, k, case.get(k, v))
    trainer.use_vllm = "is_mode" in case
    trainer.vllm_importance_sampling_mode = case.get("is_mode", "sequence_mask")
    # TRL's entropy controller state, as GRPOTrainer.__init__ leaves it (or a measurement the case gives)
    trainer._entropy_bonus_enabled = trainer.entropy_coef != 0.0 or trainer.use_adaptive_entropy
    trainer._last_world_entropy = case.get("last_world_entropy", float("inf"))
    trainer._entropy_window_stats = None
    trainer._metrics["train"].clear()


def _run(trainer, inputs):
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _check(pairs, fused, **case):
    stock, ours, (base, extra) = pairs[fused]
    inputs = _case_inputs(base, extra, case)
    results = []
    for trainer in (stock, ours):
        _configure(trainer, case)
        trainer.model.train()
        results.append(_run(trainer, inputs))
    (l_trl, g_trl), (l_ours, g_ours) = results
    torch.testing.assert_close(l_ours, l_trl, **TOL)
    assert g_trl.keys() == g_ours.keys() and g_trl
    err = (l_ours - l_trl).abs().item()
    for n in g_trl:
        torch.testing.assert_close(g_ours[n], g_trl[n], msg=n, **TOL)
        err = max(err, (g_ours[n] - g_trl[n]).abs().max().item())
    _same_metrics(stock, ours, case)
    assert (ours.entropy_coef, ours._last_world_entropy) == pytest.approx((stock.entropy_coef,
                                                                          stock._last_world_entropy))
    return err


def _same_metrics(stock, ours, case):
    keys = ["kl", "entropy", "policy_loss", "entropy_coef"]
    if case.get("importance_sampling_level", "token") == "token":  # (TRL counts sequences at sequence level)
        keys += ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "cispo_clip_ratio",
                 "vespo/phi_seq_mean"]
    m_trl, m_ours = stock._metrics["train"], ours._metrics["train"]
    for k in keys:
        assert (k in m_trl) == (k in m_ours), k
        if k in m_trl:
            assert m_ours[k][-1] == pytest.approx(m_trl[k][-1], rel=1e-5, abs=1e-6), k


def _eps(loss_type):
    return 1.2 if loss_type == "cispo" else 0.28  # cispo's epsilon_high caps the ratio itself


def _needs_differentiable_entropy(fused):
    """The entropy bonus trains through the head's entropy: our fused heads' must carry a gradient."""
    if fused == "off":
        return
    x = torch.zeros(1, 2, 3, requires_grad=True)
    y = torch.zeros(1, 2, dtype=torch.long)
    if fused == "logits":
        ent = hk.token_logprobs(x, y, return_entropy=True)[1]
    else:
        ent = hk.fused_linear.token_logprobs(x, torch.zeros(3, 3, requires_grad=True), y, return_entropy=True)[1]
    if not ent.requires_grad:
        pytest.skip(f"fused={fused!r}: the head's entropy is detached (no differentiable entropy yet)")


OPTIONS = {
    "plain": {},
    "beta0": dict(beta=0.0),
    "no_bias_correction": dict(use_bias_correction_kl=False),
    "sequence_level": dict(importance_sampling_level="sequence"),
    "delta": dict(delta=1.1),
    "off_policy_old": dict(off_policy_mask_threshold=0.02),
    "off_policy_sampling": dict(off_policy_mask_threshold=0.05, sampling=True),
    "top_entropy": dict(top_entropy_quantile=0.4),
    "entropy_bonus": dict(entropy_coef=0.03),
    "entropy_bonus_accum": dict(entropy_coef=0.03, current_gradient_accumulation_steps=3, steps_per_generation=3),
    "adaptive_applies": dict(use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=10.0,
                             last_world_entropy=0.4),
    "adaptive_waits": dict(use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=0.1),
    "tool_mask": dict(tool_mask=True),
    "adv_BT": dict(adv_BT=True),
    "accum": dict(current_gradient_accumulation_steps=4, steps_per_generation=2),
    "sapo_temps": dict(sapo_temperature_pos=0.7, sapo_temperature_neg=1.6),
    "vespo_params": dict(vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.0, vespo_lambda_neg=1.0),
}
for _mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
    OPTIONS["vllm_" + _mode] = dict(is_mode=_mode, sampling=True)
ENTROPY_BONUS = {"entropy_bonus", "entropy_bonus_accum", "adaptive_applies", "adaptive_waits"}


def _applies(option, loss_type):
    if option == "delta" and loss_type not in PPO_CLIP:
        return False  # refused at construction (TRL would ignore it)
    return not (loss_type == "vespo" and option.startswith("vllm_sequence"))  # refused by TRL itself


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("loss_type", TYPES)
def test_each_option_matches_trl_fused_off(pairs, loss_type, option):
    if not _applies(option, loss_type):
        pytest.skip("refused for this loss type")
    _check(pairs, "off", loss_type=loss_type, epsilon_high=_eps(loss_type), **OPTIONS[option])


# At the fused levels (our kernels on the Triton interpreter: slower) each option once, the loss types in turn.
@pytest.mark.slow
@pytest.mark.parametrize("fused", ["logits", "linear"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_each_option_matches_trl_fused(pairs, fused, option):
    if option in ENTROPY_BONUS:
        _needs_differentiable_entropy(fused)
    loss_type = TYPES[list(OPTIONS).index(option) % len(TYPES)]
    if not _applies(option, loss_type):
        loss_type = "dapo"
    _check(pairs, fused, loss_type=loss_type, epsilon_high=_eps(loss_type), **OPTIONS[option])


@pytest.mark.slow
@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("loss_type", TYPES)
def test_all_options_at_once_match_trl(pairs, fused, loss_type):
    _needs_differentiable_entropy(fused)
    case = dict(loss_type=loss_type, epsilon_high=_eps(loss_type), beta=0.03, off_policy_mask_threshold=0.01,
                sampling=True, top_entropy_quantile=0.6, entropy_coef=0.02, tool_mask=True, adv_BT=True,
                is_mode="token_truncate", current_gradient_accumulation_steps=2, steps_per_generation=2,
                importance_sampling_level="sequence" if loss_type in ("grpo", "luspo", "sapo") else "token")
    if loss_type in PPO_CLIP:
        case["delta"] = 1.15
    _check(pairs, fused, **case)


def test_adaptive_entropy_controller_steps_like_trls(pairs):
    """Three optimizer steps of two micro-batches each: the coefficient and the last world entropy follow TRL's."""
    stock, ours, (base, extra) = pairs["off"]
    case = dict(use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=2.0, top_entropy_quantile=0.5,
                current_gradient_accumulation_steps=2)
    for trainer in (stock, ours):
        _configure(trainer, case)
    for _ in range(3):
        for micro in range(2):
            inputs = _case_inputs(base, extra, dict(tool_mask=micro == 1))
            for trainer in (stock, ours):
                trainer.accelerator.gradient_state._set_sync_gradients(micro == 1)
                _run(trainer, inputs)
        assert ours.entropy_coef == pytest.approx(stock.entropy_coef)
        assert ours._last_world_entropy == pytest.approx(stock._last_world_entropy)
    assert stock.entropy_coef != 0.05  # the controller moved
    for trainer in (stock, ours):
        trainer.accelerator.gradient_state._set_sync_gradients(True)


def test_missing_vllm_weight_is_a_clear_error(pairs):
    _, ours, (base, extra) = pairs["off"]
    _configure(ours, dict(is_mode="token_mask"))
    inputs = _case_inputs(base, extra, {})
    with pytest.raises(ValueError, match="importance_sampling_ratio"):
        ours.compute_loss(ours.model, inputs)
    _configure(ours, {})


# ---------------------------------------------------------------------------------------------------------------
# humanline on: TRL's formula for each option, with its log-ratio replaced by the clamped one against the reference


@pytest.fixture(scope="module")
def humanline_trainer(tiny_path):  # noqa: F811
    kw = dict(COMMON, **GRPO_KW, output_dir=tiny_path + "/opts-hl", max_steps=1, beta=0.05)
    tr = HumanlineGRPOTrainer(tiny_path, reward_funcs=digit_reward, train_dataset=grpo_data(),
                              args=HumanlineGRPOConfig(**kw, fused="off", log_eps_p=-0.3, log_eps_r=0.3),
                              processing_class=tiny.tiny_tokenizer())
    with torch.no_grad():  # the policy away from its reference, so that the clamp binds on some tokens
        for p in tr.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return tr


def _expected_humanline_loss(tr, inputs, captured, case):
    """hk.reference.grpo on the trainer's own per-token outputs: the policy's log-probs and entropies, the reference
    model's log-probs as the denominator (clamped), TRL's options and normalisation."""
    logps, entropies, _ = captured[tr.model]
    ref = captured[tr.ref_model][0]
    accum = case.get("current_gradient_accumulation_steps", 1)
    normalizer, scale, coef = None, 1.0 / accum, case.get("entropy_coef", 0.0)
    if tr.loss_type in ("dapo", "cispo", "vespo"):
        normalizer = inputs["num_items_in_batch"].float() * accum / case.get("steps_per_generation", 1)
        scale, coef = 1.0, coef / accum
    mask = inputs["completion_mask"].bool()
    old = inputs["old_per_token_logps"]
    options = {k: case[k] for k in ("delta", "top_entropy_quantile", "off_policy_mask_threshold",
                                    "importance_sampling_level", "use_adaptive_entropy", "last_world_entropy",
                                    "entropy_target") if k in case}
    if "off_policy_mask_threshold" in case:
        options["sampling_per_token_logps"] = inputs.get("sampling_per_token_logps", old)
    loss, _ = hk.reference.grpo(
        logps, ref, inputs["advantages"], mask, clip=tr.hk_clip, beta=tr.beta, epsilon_low=0.2,
        epsilon_high=case["epsilon_high"], loss_type=case["loss_type"], normalizer=normalizer,
        max_completion_length=tr.max_completion_length, tool_mask=inputs.get("tool_mask"), entropies=entropies,
        importance_sampling_ratio=inputs.get("importance_sampling_ratio"), entropy_coef=coef,
        use_bias_correction_kl=case.get("use_bias_correction_kl", True), **options)
    return loss * scale


HUMANLINE_CASES = {
    "plain": {},
    "sequence_level_no_bias_correction": dict(importance_sampling_level="sequence", use_bias_correction_kl=False),
    "all": dict(off_policy_mask_threshold=0.01, sampling=True, top_entropy_quantile=0.6, entropy_coef=0.02,
                tool_mask=True, adv_BT=True, is_mode="token_mask", current_gradient_accumulation_steps=2,
                steps_per_generation=2),
    "off_policy_old": dict(off_policy_mask_threshold=0.0),  # the old log-probs as the sampler's (TRL's fallback)
}


@pytest.mark.parametrize("case_name", list(HUMANLINE_CASES))
@pytest.mark.parametrize("loss_type", TYPES)
def test_humanline_options_are_trls_formula_on_the_clamped_ratio(pairs, humanline_trainer, loss_type, case_name):
    tr = humanline_trainer
    _, _, (base, extra) = pairs["off"]
    case = dict(HUMANLINE_CASES[case_name], loss_type=loss_type, epsilon_high=_eps(loss_type))
    if case_name == "all" and loss_type in PPO_CLIP:
        case["delta"] = 1.15
    inputs = _case_inputs(base, extra, case)
    captured, per_token = {}, type(tr)._get_per_token_logps_and_entropies

    def capture(model, *args, **kwargs):
        captured[model] = per_token(tr, model, *args, **kwargs)
        return captured[model]
    _configure(tr, case)
    tr.model.train()
    tr._get_per_token_logps_and_entropies = capture
    try:
        loss = tr.compute_loss(tr.model, inputs)
    finally:
        del tr._get_per_token_logps_and_entropies
    assert captured.keys() == {tr.model, tr.ref_model}  # one reference forward (at training time), one policy's
    want = _expected_humanline_loss(tr, inputs, captured, case)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-7)
    frac = tr._metrics["train"]["humanline/unclipped_frac"][-1]
    assert 0.0 < frac < 1.0  # the clamp binds on some tokens and not on others


@pytest.mark.parametrize("fused", ["logits", "linear"])
def test_entropy_extras_cost_no_extra_vocabulary_pass(pairs, monkeypatch, fused):
    """The high-entropy mask and the entropy bonus read the entropy of the log-prob pass: one head call per
    micro-batch, with the entropy (item 3 of issue 37)."""
    _needs_differentiable_entropy(fused)
    _, ours, (base, extra) = pairs[fused]
    owner, name = (hk, "token_logprobs") if fused == "logits" else (hk.fused_linear, "token_logprobs")
    calls, real = [], getattr(owner, name)

    def counting(*args, **kwargs):
        calls.append(kwargs.get("return_entropy", False))
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, counting)
    _configure(ours, dict(top_entropy_quantile=0.5, entropy_coef=0.03, loss_type="grpo"))
    ours.model.train()
    _run(ours, _case_inputs(base, extra, {}))
    assert calls == [True]
