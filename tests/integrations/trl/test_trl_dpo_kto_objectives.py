"""Every TRL 1.16 DPO / KTO objective through the humanline trainers (CPU, the tiny random-init Llama).

* ``humanline=False``: loss, gradients and logged metrics equal TRL's stock ``DPOTrainer`` / ``KTOTrainer`` on the
  same batch (fp32, 1e-5) for every loss type, a weighted mixture, RPO, the f-divergences, LD-DPO and WPO, at the
  three log-prob heads (every type at ``fused="linear"``, subsets at the other two);
* ``humanline=True``: the loss a training step computes equals ``hk.reference`` on the trainer's own per-token
  log-probs (the policy's and the synced reference's), with a band narrow enough to clamp;
* every refused setting raises at construction with its reason;
* the loss's one pass over the tokens also feeds the logs (``losses.clip_log_ratio`` runs once per set of rows).
"""
import pytest
import torch

pytest.importorskip("trl")
import test_integrations_trl as T  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer  # noqa: E402

import humanline_kernels as hk  # noqa: E402
from humanline_kernels import losses  # noqa: E402
from humanline_kernels.integrations.trl import (  # noqa: E402
    HumanlineDPOConfig,
    HumanlineDPOTrainer,
    HumanlineKTOConfig,
    HumanlineKTOTrainer,
)

pytestmark = pytest.mark.filterwarnings("error::FutureWarning", *T.TRL_DEPRECATIONS)
COMMON, tiny, tiny_path, pref_data, kto_data = T.COMMON, T.tiny, T.tiny_path, T.pref_data, T.kto_data

ALL_DPO_TYPES = ["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                 "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"]
# the loss types TRL 1.16 reads label_smoothing in, and a value each accepts
SMOOTHED = {"exo_pair": 1e-3, "robust": 0.1, "aot": 0.1, "aot_unpaired": 0.1}
# logged by both (TRL's names); ours adds humanline/*, TRL's fused="off" head adds logits/* and mean_token_accuracy
DPO_LOGS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected", "entropy")
KTO_LOGS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "entropy")


def _perturb(stock, ours):
    """The same random step away from the reference in both policies, so the log-ratios are not all 0."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p, q in zip(stock.model.parameters(), ours.model.parameters()):
            p.add_(0.05 * torch.randn(p.shape, generator=g))
            q.copy_(p)


def _same_logs(ours, stock, keys):
    a, b = ours._metrics["train"], stock._metrics["train"]
    for k in keys:
        assert len(a[k]) == len(b[k]) == 1, k
        assert a[k][0] == pytest.approx(b[k][0], rel=1e-5, abs=1e-6), k
    for k in set(a) & set(b):  # whatever else both log (logits/*, mean_token_accuracy with fused="off")
        assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k


def _dpo_matches_trl(path, fused, ours_kw, stock_kw=None, data=pref_data, pairs=3):
    tok = tiny.tiny_tokenizer()
    kw = dict(COMMON, output_dir=path + "/o", per_device_train_batch_size=pairs, max_steps=1)
    stock = DPOTrainer(path, args=DPOConfig(**kw, **(ours_kw if stock_kw is None else stock_kw)),
                       train_dataset=data(), processing_class=tok)
    ours = HumanlineDPOTrainer(path, args=HumanlineDPOConfig(**kw, **ours_kw, humanline=False, fused=fused),
                               train_dataset=data(), processing_class=tok)
    inputs = stock._prepare_inputs(next(iter(stock.get_train_dataloader())))
    _perturb(stock, ours)
    T._assert_same(T._loss_and_grads(ours, inputs), T._loss_and_grads(stock, inputs))
    _same_logs(ours, stock, DPO_LOGS)
    return ours, inputs


def _alone(loss_type, **extra):
    return dict(loss_type=[loss_type], beta=0.3, label_smoothing=SMOOTHED.get(loss_type, 0.0), **extra)


MIXTURE = dict(loss_type=["sigmoid", "exo_pair", "ipo", "sft", "apo_down"], loss_weights=[0.8, 0.3, 0.5, 1.0, 0.2],
               label_smoothing=1e-3)  # "sigmoid" with a label_smoothing that only exo_pair reads, as in TRL
F_DIVERGENCES = {"forward_kl": dict(f_divergence_type="forward_kl", loss_type=["sigmoid", "hinge"]),
                 "js": dict(f_divergence_type="js_divergence", loss_type=["ipo", "sft"], loss_weights=[1.0, 0.3]),
                 "alpha": dict(f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3,
                               loss_type=["discopop", "robust"], label_smoothing=0.1)}
OPTIONS = {"mixture": MIXTURE, **{"f-" + k: v for k, v in F_DIVERGENCES.items()},
           "ld_alpha": dict(ld_alpha=0.4, loss_type=["sigmoid", "aot", "sft"], label_smoothing=0.1),
           "ld_alpha_0": dict(ld_alpha=0.0, loss_type=["sigmoid_norm", "apo_zero"])}
LINEAR = [("type-" + t, _alone(t)) for t in ALL_DPO_TYPES] + list(OPTIONS.items())
OTHERS = [("off", "sigmoid", _alone("sigmoid")), ("off", "aot", _alone("aot")), ("off", "mixture", MIXTURE),
          ("off", "ld_alpha", OPTIONS["ld_alpha"]), ("logits", "ipo", _alone("ipo")),
          ("logits", "hinge", _alone("hinge")), ("logits", "f-js", OPTIONS["f-js"]),
          ("logits", "ld_alpha_0", OPTIONS["ld_alpha_0"])]


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for _, c in LINEAR], ids=[i for i, _ in LINEAR])
def test_dpo_linear_matches_trl(tiny_path, case):
    _dpo_matches_trl(tiny_path, "linear", case)


@pytest.mark.parametrize("fused,case", [(f, c) for f, _, c in OTHERS], ids=[f"{f}-{i}" for f, i, _ in OTHERS])
def test_dpo_off_and_logits_match_trl(tiny_path, fused, case):
    _dpo_matches_trl(tiny_path, fused, case)


@pytest.mark.parametrize("fused", ["linear", "off"])
def test_dpo_rpo_alpha_is_trls_sft_term(tiny_path, fused):
    _dpo_matches_trl(tiny_path, fused, dict(loss_type=["ipo"], rpo_alpha=0.6),
                     stock_kw=dict(loss_type=["ipo", "sft"], loss_weights=[1.0, 0.6]))


@pytest.mark.parametrize("case", [_alone("sigmoid"), dict(loss_type=["ipo", "bco_pair"], loss_weights=[0.5, 1.0])],
                         ids=["sigmoid", "ipo+bco_pair"])
def test_dpo_wpo_matches_trl(tiny_path, case):
    ours, _ = _dpo_matches_trl(tiny_path, "off", dict(case, use_weighting=True))
    assert ours.hk_objective.wpo


def empty_prompt_data():
    """Prompts that tokenize to nothing: TRL's completion mask then starts at position 0 (so does it with
    truncation_mode="keep_end" on long prompts)."""
    return Dataset.from_list([{"prompt": "", "chosen": f"{a}{b}", "rejected": f"{b}{a}x"}
                              for a in range(3) for b in range(3)])


@pytest.mark.parametrize("fused", ["linear", "off"])
def test_dpo_unshifted_counts_of_ipo_and_sigmoid_norm_match_trl(tiny_path, fused):
    """"ipo"/"sigmoid_norm" divide by the unshifted completion mask's count, "sft" by the scored tokens' (one more
    and one fewer where the prompt is empty): both in one mixture, as TRL 1.16 computes them."""
    case = dict(loss_type=["ipo", "sigmoid_norm", "sft"], loss_weights=[1.0, 0.5, 0.7], beta=0.3)
    ours, inputs = _dpo_matches_trl(tiny_path, fused, case, data=empty_prompt_data)
    cm = inputs["completion_mask"]
    assert bool(cm[:, 0].all())  # the case the test is for: the first completion token has no log-prob
    assert [g.unshifted for g in ours.hk_objective.groups] == [True, False]


@pytest.mark.parametrize("fused,loss_type", [("linear", "apo_zero_unpaired"), ("logits", "apo_zero_unpaired"),
                                             ("off", "apo_zero_unpaired"), ("linear", "kto")])
def test_kto_matches_trl(tiny_path, fused, loss_type):
    tok = tiny.tiny_tokenizer()
    kw = dict(COMMON, output_dir=tiny_path + "/o", per_device_train_batch_size=4, max_steps=1, loss_type=loss_type,
              desirable_weight=1.3, undesirable_weight=0.7, beta=0.3)
    stock = KTOTrainer(tiny_path, args=KTOConfig(**kw), train_dataset=kto_data(), processing_class=tok)
    ours = HumanlineKTOTrainer(tiny_path, args=HumanlineKTOConfig(**kw, humanline=False, fused=fused),
                               train_dataset=kto_data(), processing_class=tok)
    assert ours.hk_kl_estimate == "trl" and ours.calculate_KL == (loss_type == "kto")
    inputs = stock._prepare_inputs(next(iter(stock.get_train_dataloader())))
    assert inputs["label"].any() and not inputs["label"].all()
    _perturb(stock, ours)
    T._assert_same(T._loss_and_grads(ours, inputs), T._loss_and_grads(stock, inputs))
    _same_logs(ours, stock, KTO_LOGS)


def test_kto_kl_estimate_is_trls_off_and_halos_on(tiny_path):
    """z0 with an empty KL row (its sum is 0): TRL's mean over every KL row with humanline off, HALOs' mean over the
    non-zero rows with humanline on (the paper's)."""
    g = torch.Generator().manual_seed(0)
    logps, ref = -torch.rand(4, 5, generator=g), -torch.rand(4, 5, generator=g)
    mask, desirable = torch.ones(4, 5, dtype=torch.bool), torch.tensor([True, False, True, False])
    kl_logps, kl_ref = logps.roll(1, 0), ref.flip(0)
    kl_mask = mask.clone()
    kl_mask[2] = False  # a KL row with no completion token
    for humanline in (False, True):
        tr = HumanlineKTOTrainer(tiny_path, args=HumanlineKTOConfig(**COMMON, output_dir=tiny_path + "/k", **BAND,
                                                                    humanline=humanline, per_device_train_batch_size=2),
                                 train_dataset=kto_data(), processing_class=tiny.tiny_tokenizer())
        _, stats = tr._hk_loss(logps, ref, mask, desirable, kl_logps, kl_ref, kl_mask)
        clip = hk.HumanlineClip(**BAND) if humanline else None
        want = {est: hk.reference.kto(logps, ref, mask, desirable, kl_logps, kl_ref, kl_mask, clip=clip,
                                      kl_estimate=est)[1]["kl"] for est in ("trl", "halos")}
        assert want["trl"] < want["halos"]  # the case the test is for: the estimates differ
        torch.testing.assert_close(stats.kl, want["halos" if humanline else "trl"])


@pytest.fixture(scope="module")
def tiny_moe_path(tmp_path_factory):
    """A tiny random-init Mixtral whose config leaves output_router_logits False (the transformers default)."""
    from transformers import MixtralConfig, MixtralForCausalLM
    path = str(tmp_path_factory.mktemp("tinymoe"))
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, pad_token_id=0,
                        eos_token_id=1, bos_token_id=None, tie_word_embeddings=False, router_aux_loss_coef=0.1)
    assert not cfg.output_router_logits
    MixtralForCausalLM(cfg).save_pretrained(path)
    tiny.tiny_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("algo", ["dpo", "kto"])
def test_moe_router_aux_loss_matches_trl(tiny_moe_path, algo):
    """router_aux_loss_coef: the policy forward asks for the router logits as TRL's does, and the weighted router
    loss is added and logged ("aux_loss"); fused="off" (the fused heads refuse MoE aux losses)."""
    stock_cls, stock_cfg, ours_cls, ours_cfg, data = (
        (DPOTrainer, DPOConfig, HumanlineDPOTrainer, HumanlineDPOConfig, pref_data) if algo == "dpo" else
        (KTOTrainer, KTOConfig, HumanlineKTOTrainer, HumanlineKTOConfig, kto_data))
    kw = dict(COMMON, output_dir=tiny_moe_path + "/o", per_device_train_batch_size=4, max_steps=1)
    tok = tiny.tiny_tokenizer()
    stock = stock_cls(tiny_moe_path, args=stock_cfg(**kw), train_dataset=data(), processing_class=tok)
    ours = ours_cls(tiny_moe_path, args=ours_cfg(**kw, humanline=False, fused="off"), train_dataset=data(),
                    processing_class=tok)
    assert ours.aux_loss_enabled and ours.router_aux_loss_coef == 0.1
    inputs = stock._prepare_inputs(next(iter(stock.get_train_dataloader())))
    _perturb(stock, ours)
    T._assert_same(T._loss_and_grads(ours, inputs), T._loss_and_grads(stock, inputs))
    _same_logs(ours, stock, ("aux_loss",))


# ------------------------------------------------------------------------------------------------ humanline on
BAND = dict(log_eps_p=-0.02, log_eps_r=0.02)


def _train_recording(trainer_cls, config_cls, path, data, fused, cfg, steps=2, batch=2):
    """Train with humanline on; return per micro-batch what ``_hk_loss`` got and gave, and the trainer."""
    seen = []
    loss_fn = trainer_cls._hk_loss

    def recording(self, *args):
        loss, stats = loss_fn(self, *args)
        seen.append(([a.detach().clone() if torch.is_tensor(a) else a for a in args], loss.detach().clone()))
        return loss, stats
    args = config_cls(**COMMON, output_dir=path + "/on", per_device_train_batch_size=batch, max_steps=steps,
                      learning_rate=5e-2, fused=fused, **BAND, **cfg)
    tr = trainer_cls(path, args=args, train_dataset=data(), processing_class=tiny.tiny_tokenizer())
    mp = pytest.MonkeyPatch()
    mp.setattr(trainer_cls, "_hk_loss", recording)
    try:
        tr.train()
    finally:
        mp.undo()
    assert len(seen) == steps
    return tr, seen


HUMANLINE_DPO = [("linear", dict(loss_type=["sigmoid"])),
                 ("linear", dict(loss_type=["hinge", "sft"], loss_weights=[1.0, 0.5], ld_alpha=0.5)),
                 ("logits", dict(loss_type=["sigmoid_norm"], f_divergence_type="forward_kl")),
                 ("off", dict(loss_type=["robust", "sigmoid"], label_smoothing=0.1, use_weighting=True))]


@pytest.mark.parametrize("fused,cfg", HUMANLINE_DPO, ids=["sigmoid", "hinge+sft-ld", "sigmoid_norm-fkl", "wpo"])
def test_dpo_humanline_loss_is_the_reference_on_the_trainers_logps(tiny_path, fused, cfg):
    tr, seen = _train_recording(HumanlineDPOTrainer, HumanlineDPOConfig, tiny_path, pref_data, fused, cfg)
    clip = hk.HumanlineClip(**BAND)
    kw = {k: v for k, v in cfg.items() if k != "label_smoothing"}
    for step, ((logps, ref, mask, _, lssp), loss) in enumerate(seen):
        if "robust" in cfg["loss_type"]:  # "sigmoid" reads no label_smoothing (TRL's), "robust" does
            want = (hk.reference.dpo(logps, ref, mask, clip=clip, loss_type="robust", label_smoothing=0.1,
                                     use_weighting=True, log_sum_sq_probs=lssp)[0]
                    + hk.reference.dpo(logps, ref, mask, clip=clip, use_weighting=True, log_sum_sq_probs=lssp)[0])
        else:
            want, met = hk.reference.dpo(logps, ref, mask, clip=clip, **kw)
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6, msg=f"step {step}")
    # the reference lags the policy and the band clamps: the test is not of the plain loss
    assert tr.hk_sync.num_syncs == 2 and any((lp - r)[m].abs().max() > 0.02 for (lp, r, m, *_), _ in seen[1:])
    logged = [h for h in tr.state.log_history if "rewards/chosen" in h]
    _, met = hk.reference.dpo(*seen[-1][0][:3], clip=clip, ld_alpha=cfg.get("ld_alpha"))
    assert logged[-1]["rewards/chosen"] == pytest.approx(met["rewards_chosen"].item(), rel=1e-5, abs=1e-6)
    assert logged[-1]["humanline/unclipped_frac"] == pytest.approx(met["unclipped_frac"].item(), rel=1e-6)
    assert logged[-1]["humanline/unclipped_frac"] < 1.0


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_humanline_loss_is_the_reference_on_the_trainers_logps(tiny_path, loss_type):
    tr, seen = _train_recording(HumanlineKTOTrainer, HumanlineKTOConfig, tiny_path, kto_data, "linear",
                                dict(loss_type=loss_type, beta=0.3, desirable_weight=1.2), batch=4)
    assert tr.hk_kl_estimate == "halos"
    clip = hk.HumanlineClip(**BAND)
    for step, ((logps, ref, mask, desirable, *kl), loss) in enumerate(seen):
        assert (kl[0] is not None) == (loss_type == "kto")
        kl_rows = tuple(kl) if kl[0] is not None else ()
        want, met = hk.reference.kto(logps, ref, mask, desirable, *kl_rows, clip=clip, beta=0.3,
                                     desirable_weight=1.2, loss_type=loss_type)
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6, msg=f"step {step}")
        logged = [h["kl"] for h in tr.state.log_history if "kl" in h]
        assert logged[step] == pytest.approx(met["kl"].item(), rel=1e-5, abs=1e-7)
    assert any((lp - r)[m].abs().max() > 0.02 for (lp, r, m, *_), _ in seen[1:])


# ------------------------------------------------------------------------------------------------ refusals
DPO_REFUSED = [
    (dict(label_smoothing=0.1), "read by none of loss_type"),
    (dict(label_smoothing=0.1, loss_type=["sigmoid", "hinge"]), "TRL 1.16's 'sigmoid' ignores it"),
    (dict(use_weighting=True, fused="linear"), "use_weighting=True .WPO. needs each token's log sum_v p_v"),
    (dict(use_weighting=True, fused="logits"), "fused='off'"),
    (dict(loss_type=["aot"], label_smoothing=0.1), "'aot' has no humanline form"),
    (dict(loss_type=["sigmoid", "dpop"]), "loss_type must be in"),
    (dict(loss_type=["bco_pair"], f_divergence_type="js_divergence"), "no f-divergence form"),
    (dict(f_divergence_type="tv"), "f_divergence_type must be in"),
    (dict(loss_type=["exo_pair"]), "label_smoothing must be > 0 for loss_type 'exo_pair'"),
    (dict(loss_type=["robust"], label_smoothing=0.5), "label_smoothing must be < 0.5 for loss_type 'robust'"),
    (dict(loss_type=["ipo"], beta=0.0), "they divide by beta"),
    (dict(ld_alpha=1.5), "ld_alpha must be <= 1"),
    (dict(loss_type=["discopop"], discopop_tau=0.0), "discopop_tau must be > 0"),
    (dict(precompute_ref_log_probs=True), "precompute_ref_log_probs"),
    (dict(sync_ref_model=True), "sync_ref_model"),
]


@pytest.mark.parametrize("cfg,match", DPO_REFUSED, ids=[m[:24] for _, m in DPO_REFUSED])
def test_dpo_refusals(tiny_path, cfg, match):
    with pytest.raises(ValueError, match=f"HumanlineDPOTrainer: .*{match}"):
        HumanlineDPOTrainer(tiny_path, args=HumanlineDPOConfig(**COMMON, output_dir=tiny_path + "/r", **cfg),
                            train_dataset=pref_data(), processing_class=tiny.tiny_tokenizer())


@pytest.mark.parametrize("value, match", [(-0.5, "rpo_alpha must be >= 0"), ("x", "rpo_alpha must be a finite real")])
def test_rpo_alpha_refused_by_the_config_and_the_trainer(tiny_path, value, match):
    """rpo_alpha, a field of ours, is checked at construction with the others (it was only when the trainer was
    built); one set afterwards is still the trainer's to refuse."""
    with pytest.raises(ValueError, match=match):
        HumanlineDPOConfig(**COMMON, output_dir=tiny_path + "/r", rpo_alpha=value)
    cfg = HumanlineDPOConfig(**COMMON, output_dir=tiny_path + "/r")
    cfg.rpo_alpha = value
    with pytest.raises(ValueError, match=f"HumanlineDPOTrainer: .*{match}"):
        HumanlineDPOTrainer(tiny_path, args=cfg, train_dataset=pref_data(), processing_class=tiny.tiny_tokenizer())


def test_dpo_refusals_of_trl_itself(tiny_path):
    """What TRL 1.16 refuses stays refused, with TRL's reason (WPO with the sorting loss types)."""
    cfg = HumanlineDPOConfig(**COMMON, output_dir=tiny_path + "/r", loss_type=["aot_unpaired"], use_weighting=True,
                             humanline=False, fused="off")
    with pytest.raises(NotImplementedError, match="sort"):
        HumanlineDPOTrainer(tiny_path, args=cfg, train_dataset=pref_data(), processing_class=tiny.tiny_tokenizer())
    with pytest.raises(ValueError, match="loss_weights"):
        HumanlineDPOConfig(**COMMON, output_dir=tiny_path + "/r", loss_type=["sigmoid", "sft"], loss_weights=[1.0])


@pytest.mark.parametrize("cfg,match", [(dict(loss_type="bco"), "loss_type must be in"),
                                       (dict(sync_ref_model=True), "sync_ref_model"),
                                       (dict(precompute_ref_log_probs=True), "precompute_ref_log_probs")])
def test_kto_refusals(tiny_path, cfg, match):
    with pytest.raises(ValueError, match=f"HumanlineKTOTrainer: .*{match}"):
        HumanlineKTOTrainer(tiny_path, args=HumanlineKTOConfig(**COMMON, output_dir=tiny_path + "/r", **cfg,
                                                               per_device_train_batch_size=2),
                            train_dataset=kto_data(), processing_class=tiny.tiny_tokenizer())


def test_dpo_padding_free_packs_where_trl_falls_back_to_padding(tiny_path):
    """TRL 1.16's DPOTrainer turns padding_free off with a warning and trains padded; ours packs each micro-batch
    into one row (tests/integrations/trl/test_trl_layouts.py: the same loss and gradients as padded)."""
    tr = HumanlineDPOTrainer(tiny_path, args=HumanlineDPOConfig(**COMMON, output_dir=tiny_path + "/p",
                                                                padding_free=True, humanline=False),
                             train_dataset=pref_data(), processing_class=tiny.tiny_tokenizer())
    assert tr.padding_free is True and tr.args.padding_free is True
    batch = next(iter(tr.get_train_dataloader()))
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch and "position_ids" in batch


# ------------------------------------------------------------------------------------------------ one pass
@pytest.mark.parametrize("algo,calls", [("dpo", 1), ("kto", 2)])
def test_logs_reuse_the_losss_rows(monkeypatch, tiny_path, algo, calls):
    """One clamp per set of rows a step (DPO: the pairs; KTO: its rows and its KL rows): the logs read the rows
    the loss formed rather than clamping again."""
    trainer_cls, config_cls, data = ((HumanlineDPOTrainer, HumanlineDPOConfig, pref_data) if algo == "dpo" else
                                     (HumanlineKTOTrainer, HumanlineKTOConfig, kto_data))
    tr = trainer_cls(tiny_path, args=config_cls(**COMMON, output_dir=tiny_path + "/c", per_device_train_batch_size=4,
                                                 **BAND), train_dataset=data(), processing_class=tiny.tiny_tokenizer())
    inputs = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    clamp, seen = losses.clip_log_ratio, []

    def counting(logps, *args):
        seen.append(logps.shape)
        return clamp(logps, *args)
    monkeypatch.setattr(losses, "clip_log_ratio", counting)
    _perturb(tr, tr)  # (policy only: the reference keeps the initial weights)
    T._loss_and_grads(tr, inputs)
    assert len(seen) == calls
    assert set(tr._metrics["train"]) >= {"rewards/chosen", "logps/chosen", "humanline/unclipped_frac"}
    assert tr._metrics["train"]["humanline/unclipped_frac"][0] < 1.0
