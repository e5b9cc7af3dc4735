"""Layouts in the TRL trainers (issue 33, item 3): DPO's ``padding_free=True`` and the fused-linear head's
supervised ranges, on the CPU with the tiny random-init Llama.

* ``completion_ranges`` / ``pack`` / ``LayoutCollator`` against hand-made batches;
* DPO packed against padded on the same collated micro-batch: loss, every parameter's gradient and the logs, at
  the three heads, humanline off and on (a band that clamps), sdpa and eager attention. transformers builds the
  block-diagonal mask of a packed row from its restarting ``position_ids`` (``masking_utils.
  find_packed_sequence_indices``, with no attention mask and no cache); a control shows the comparison fails when
  the sequences see each other; a few optimizer steps packed and padded log the same losses;
* ``fused="linear"``: the collator's (DPO, KTO: rows and KL rows) or the generation's (GRPO) ranges reach
  ``hk.fused_linear.token_logprobs`` as ``supervised=``, fewer positions than dense, and give the dense loss and
  gradients;
* what is refused, and the GPU test: DPO trained with flash-attn varlen packed and padded.
"""
import importlib.util

import pytest
import torch

pytest.importorskip("trl")
import test_integrations_trl as T  # noqa: E402
from datasets import Dataset  # noqa: E402

import humanline_kernels as hk  # noqa: E402
from humanline_kernels import losses  # noqa: E402
from humanline_kernels.integrations.trl import (  # noqa: E402
    HumanlineDPOConfig,
    HumanlineDPOTrainer,
    HumanlineGRPOConfig,
    HumanlineGRPOTrainer,
    HumanlineKTOConfig,
    HumanlineKTOTrainer,
)
from humanline_kernels.integrations.trl._layouts import LayoutCollator, completion_ranges, pack  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("error::FutureWarning", *T.TRL_DEPRECATIONS),
              pytest.mark.slow]  # slow: trainer runs
COMMON, tiny, tiny_path = T.COMMON, T.tiny, T.tiny_path
BAND = dict(log_eps_p=-0.02, log_eps_r=0.02)


def varied_pref_data():
    """Prompts of different lengths (one empty: its first completion token starts a packed sequence)."""
    rows = [("", "abc", "de"), ("12+3=", "15", "16!"), ("7*8-1=", "55", "5"), ("9=", "nine", "ix"),
            ("4+4=", "8", "eight"), ("10-7=", "3", "33?")]
    return Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in rows])


def _perturb(*trainers):
    """The same random step away from the reference in every policy, so the log-ratios are not all 0."""
    g = torch.Generator().manual_seed(1)
    models = [t.model for t in trainers]
    with torch.no_grad():
        for ps in zip(*(m.parameters() for m in models)):
            d = 0.05 * torch.randn(ps[0].shape, generator=g)
            for p in ps:
                p.add_(d)


# ------------------------------------------------------------------------------------- the host helpers
def test_completion_ranges_cover_exactly_the_positions_predicting_completion_tokens():
    masks = torch.tensor([[0, 0, 1, 1, 1, 0],    # prompt, completion, right padding
                          [1, 1, 1, 0, 0, 0],    # empty prompt: token 0 is never predicted
                          [0, 0, 0, 0, 0, 0],    # no completion
                          [0, 0, 0, 0, 0, 1],    # one token, last column
                          [1, 0, 0, 0, 0, 0],    # only token 0: nothing to predict
                          [0, 1, 1, 1, 1, 1]])
    ranges = completion_ranges(masks)
    assert ranges == [[1, 4], [0, 2], [0, 0], [4, 5], [0, 0], [0, 5]]
    for m, (s, e) in zip(masks.tolist(), ranges):
        # the head's position t predicts token t + 1: exactly [s, e) predicts a completion token
        predicting = [t for t in range(len(m) - 1) if m[t + 1]]
        assert list(range(s, e)) == predicting


def _padded_batch():
    ids = torch.tensor([[5, 6, 7, 8, 0], [9, 10, 0, 0, 0], [11, 12, 13, 14, 15]])
    am = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    cm = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 0, 0, 0], [0, 0, 0, 1, 1]])
    return {"input_ids": ids, "attention_mask": am, "completion_mask": cm,
            "hidden": torch.arange(30.0).view(3, 5, 2), "ref_chosen_logps": torch.tensor([-1.0, -2.0, -3.0])}


def test_pack_lays_the_rows_end_to_end_and_round_trips():
    b = _padded_batch()
    p = pack(b, pad_token_id=0)
    assert "attention_mask" not in p
    assert p["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]
    assert p["completion_mask"].tolist() == [[0, 0, 1, 1, 0, 1, 0, 0, 0, 1, 1]]
    assert p["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 4]]
    assert p["seq_idx"].tolist() == [[0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2]]
    assert p["hk_cu_seqlens"] == [0, 4, 6, 11]
    assert p["cu_seq_lens_q"].dtype == torch.int32 and p["cu_seq_lens_k"].tolist() == [0, 4, 6, 11]
    assert p["max_length_q"] == p["max_length_k"] == 5
    assert p["hidden"].shape == (1, 11, 2) and p["ref_chosen_logps"] is b["ref_chosen_logps"]  # per row: passes
    # back to the padded rows (the library's unpacking, as the DPO trainer does it): the rows, 0 in the padding
    packed = hk.Packed(p["hk_cu_seqlens"])
    ids, cm = losses.unpacked(packed, p["input_ids"], p["completion_mask"])
    assert torch.equal(ids, b["input_ids"] * b["attention_mask"]) and torch.equal(cm, b["completion_mask"])
    assert hk.Packed.from_position_ids(p["position_ids"]).host_cu() == p["hk_cu_seqlens"]


def test_pack_pads_the_stream_to_a_multiple_as_the_last_sequences_continuation():
    p = pack(_padded_batch(), pad_token_id=3, pad_to_multiple_of=8)
    assert p["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 3, 3, 3, 3, 3]]
    assert p["completion_mask"][0, 11:].tolist() == [0] * 5 and p["hidden"].shape == (1, 16, 2)
    assert p["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert p["hk_cu_seqlens"] == [0, 4, 6, 16] and p["max_length_q"] == 10


def test_pack_refuses_left_padding_and_a_batch_without_attention_mask():
    b = _padded_batch()
    b["attention_mask"] = b["attention_mask"].flip(1)
    with pytest.raises(ValueError, match="right-padded rows"):
        pack(b, pad_token_id=0)
    with pytest.raises(ValueError, match="lacks"):
        pack({"input_ids": torch.ones(2, 3, dtype=torch.long)}, pad_token_id=0)


def test_layout_collator_adds_the_ranges_of_each_completion_mask():
    b = _padded_batch()
    b["KL_completion_mask"] = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    out = LayoutCollator(lambda ex: dict(b), prefixes=("", "KL_"))(None)
    assert out["hk_supervised"] == [[1, 3], [0, 1], [2, 4]] and out["hk_KL_supervised"] == [[0, 2], [0, 0], [0, 4]]
    packed = LayoutCollator(lambda ex: dict(b), ranges=False, packed=True)(None)
    assert "hk_supervised" not in packed and packed["hk_cu_seqlens"] == [0, 4, 6, 11]


# ------------------------------------------------------------------------- DPO: packed against padded
def _dpo_pair(path, fused, humanline, attn=None, peft_config=None, **cfg):
    """(padded trainer, packed trainer, their collated micro-batches of the same examples, on the device)."""
    out = []
    for padding_free in (False, True):
        kw = dict(COMMON, output_dir=path + "/pf", per_device_train_batch_size=6, max_steps=1, **cfg)
        args = HumanlineDPOConfig(**kw, humanline=humanline, fused=fused, padding_free=padding_free,
                                  **(BAND if humanline else {}),
                                  model_init_kwargs={"attn_implementation": attn} if attn else None)
        out.append(HumanlineDPOTrainer(path, args=args, train_dataset=varied_pref_data(),
                                       processing_class=tiny.tiny_tokenizer(),
                                       peft_config=peft_config() if peft_config else None))
    padded, packed = out
    examples = [padded.train_dataset[i] for i in range(6)]
    _perturb(padded, packed)
    return padded, packed, [t._prepare_inputs(t.data_collator(examples)) for t in out]


def _same_logs(a, b):
    ma, mb = a._metrics["train"], b._metrics["train"]
    assert ma.keys() == mb.keys() and "rewards/margins" in ma
    for k in ma:
        assert ma[k] == pytest.approx(mb[k], rel=1e-5, abs=1e-6), k


@pytest.mark.parametrize("humanline", [False, True], ids=["humanline_off", "humanline_on"])
@pytest.mark.parametrize("fused", ["off", "logits", "linear"])
def test_dpo_packed_equals_padded(tiny_path, fused, humanline):
    padded, packed, (b_pad, b_pack) = _dpo_pair(tiny_path, fused, humanline)
    assert b_pack["input_ids"].shape[0] == 1 and "attention_mask" not in b_pack
    assert b_pack["input_ids"].numel() == b_pad["attention_mask"].sum()  # no padding left
    a = T._loss_and_grads(padded, b_pad)
    T._assert_same(T._loss_and_grads(packed, b_pack), a)
    _same_logs(packed, padded)
    if humanline:  # the band clamps: not the plain loss
        assert padded._metrics["train"]["humanline/unclipped_frac"][0] < 1.0


def test_dpo_packed_equals_padded_with_a_lora_policy(tiny_path):
    """A LoRA policy with humanline on: the reference is the synced "ref" adapter, run packed as well."""
    peft = pytest.importorskip("peft")
    lora = lambda: peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)  # noqa: E731
    padded, packed, (b_pad, b_pack) = _dpo_pair(tiny_path, "linear", True, peft_config=lora)
    assert padded.ref_model is None and "ref" in packed.model.peft_config
    T._assert_same(T._loss_and_grads(packed, b_pack), T._loss_and_grads(padded, b_pad))
    assert padded._metrics["train"]["humanline/unclipped_frac"][0] < 1.0


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_dpo_packed_attention_is_per_sequence(tiny_path, attn):
    """The comparison can fail: with positions that do not restart, the packed row is one causal sequence and
    every later sequence attends to the earlier ones (its loss differs); with restarting positions each attends
    to itself only, under both attention implementations on the CPU."""
    padded, packed, (b_pad, b_pack) = _dpo_pair(tiny_path, "logits", False, attn=attn, loss_type=["ipo"])
    assert padded.model.config._attn_implementation == packed.model.config._attn_implementation == attn
    want = T._loss_and_grads(padded, b_pad)
    T._assert_same(T._loss_and_grads(packed, b_pack), want)
    mixed = dict(b_pack, position_ids=torch.arange(b_pack["input_ids"].size(1))[None])
    assert not torch.allclose(T._loss_and_grads(packed, mixed)[0], want[0], rtol=1e-3, atol=1e-4)


def test_dpo_packed_first_tokens_are_never_scored_across_sequences(tiny_path):
    """An empty prompt's first completion token starts its packed sequence: the previous sequence's last position
    must not score it (the padded rows never do), so its label is masked at ``position_ids == 0``."""
    _, packed, (_, b_pack) = _dpo_pair(tiny_path, "logits", False)
    kw, labels, mask, pk = packed._hk_inputs(b_pack)
    starts = pk.host_cu()[:-1]
    assert b_pack["completion_mask"][0, starts].any()  # the data has such a sequence
    assert (labels[0, starts] == -100).all() and not mask[0, [s - 1 for s in starts[1:]]].any()
    assert not mask[0, -1]  # the stream's last position predicts nothing


def _train_losses(path, padding_free, attn=None, device_kw=None, steps=3, **cfg):
    """(trainer, logged loss and margin of each optimizer step) of a short DPO run (2 micro-batches a step)."""
    device_kw = device_kw or {}
    init = {"attn_implementation": attn, **({"dtype": "bfloat16"} if device_kw.get("bf16") else {})} if attn else None
    args = HumanlineDPOConfig(**dict(COMMON, **device_kw), output_dir=path + "/tr", padding_free=padding_free,
                              per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=steps,
                              learning_rate=5e-2, model_init_kwargs=init, **cfg)
    tr = HumanlineDPOTrainer(path, args=args, train_dataset=varied_pref_data(), processing_class=tiny.tiny_tokenizer())
    tr.train()
    logs = [h for h in tr.state.log_history if "loss" in h and "rewards/margins" in h]
    assert len(logs) == steps
    return tr, [h[k] for h in logs for k in ("loss", "rewards/margins")]


@pytest.mark.parametrize("reference", ["sync", "lookahead"])
def test_dpo_trains_alike_packed_and_padded(tiny_path, reference):
    """Optimizer steps of two accumulated micro-batches, humanline on (a reference synced, or the lookahead's),
    fused="linear": the logged losses and margins agree step for step."""
    cfg = dict(fused="linear", sync_every=1, humanline_reference=reference, **BAND)
    _, padded = _train_losses(tiny_path, False, **cfg)
    tr, packed = _train_losses(tiny_path, True, **cfg)
    assert tr.padding_free
    assert len({round(x, 4) for x in padded[::2]}) > 1  # the steps differ: the comparison is not of one number
    assert packed == pytest.approx(padded, rel=1e-4, abs=1e-5)



def test_dpo_evaluates_alike_packed_and_padded(tiny_path):
    """Evaluation packs too (the collator serves both loaders) and returns the model's outputs
    (``return_outputs``): the same metrics."""
    got = []
    for padding_free in (False, True):
        args = HumanlineDPOConfig(**COMMON, output_dir=tiny_path + "/ev", padding_free=padding_free, fused="linear",
                                  per_device_eval_batch_size=3, prediction_loss_only=False, **BAND)
        tr = HumanlineDPOTrainer(tiny_path, args=args, train_dataset=varied_pref_data(),
                                 eval_dataset=varied_pref_data(), processing_class=tiny.tiny_tokenizer())
        _perturb(tr)
        got.append({k: v for k, v in tr.evaluate().items() if "runtime" not in k and "per_second" not in k})
    assert got[0].keys() == got[1].keys() and "eval_rewards/margins" in got[0]
    assert got[1] == pytest.approx(got[0], rel=1e-5, abs=1e-6)

# ------------------------------------------------------------------- the supervised ranges reach the head
@pytest.fixture
def head_calls(monkeypatch):
    """Every ``hk.fused_linear.token_logprobs`` call: its targets' shape and its ``supervised`` ranges."""
    calls, fn = [], hk.fused_linear.token_logprobs

    def spy(hidden, weight, targets, **kw):
        calls.append((tuple(targets.shape), kw.get("supervised"), kw.get("packed")))
        return fn(hidden, weight, targets, **kw)
    monkeypatch.setattr(hk.fused_linear, "token_logprobs", spy)
    return calls


def _positions(calls):
    """(supervised positions, all positions) of the recorded head calls; every call had ranges."""
    assert calls and all(r is not None for _, r, _ in calls), calls
    return sum(e - s for _, r, _ in calls for s, e in r), sum(shape[0] * shape[1] for shape, _, _ in calls)


def _dense(inputs, keys):
    return {k: v for k, v in inputs.items() if k not in keys}


def _supervised_equals_dense(trainer, inputs, keys, head_calls, n_calls):
    got = T._loss_and_grads(trainer, inputs)
    n_sup, n_all = _positions(head_calls)
    assert len(head_calls) == n_calls and n_sup < n_all / 2, (n_sup, n_all)
    head_calls.clear()
    want = T._loss_and_grads(trainer, _dense(inputs, keys))
    assert len(head_calls) == n_calls and all(r is None for _, r, _ in head_calls)  # dense: no ranges
    T._assert_same(got, want)


@pytest.mark.parametrize("humanline", [False, True], ids=["humanline_off", "humanline_on"])
def test_dpo_supervised_ranges_reach_the_head_and_equal_dense(tiny_path, head_calls, humanline):
    padded, packed, (b_pad, b_pack) = _dpo_pair(tiny_path, "linear", humanline)
    assert b_pad["hk_supervised"] == completion_ranges(padded.data_collator.collator(
        [padded.train_dataset[i] for i in range(6)])["completion_mask"])
    _supervised_equals_dense(padded, b_pad, {"hk_supervised"}, head_calls, 2)  # reference, policy
    head_calls.clear()
    T._loss_and_grads(packed, b_pack)  # packed: the ranges with the stream's boundaries (one position short)
    cu = b_pack["hk_cu_seqlens"]
    assert [p.host_cu() for _, _, p in head_calls] == [cu[:-1] + [cu[-1] - 1]] * 2
    assert all(shape == (1, cu[-1] - 1) for shape, _, _ in head_calls)


@pytest.mark.parametrize("humanline", [False, True], ids=["humanline_off", "humanline_on"])
def test_kto_supervised_ranges_of_rows_and_kl_rows(tiny_path, head_calls, humanline):
    kw = dict(COMMON, output_dir=tiny_path + "/kto", per_device_train_batch_size=4, max_steps=1)
    tr = HumanlineKTOTrainer(tiny_path, args=HumanlineKTOConfig(**kw, humanline=humanline, fused="linear",
                                                                **(BAND if humanline else {})),
                             train_dataset=T.kto_data(), processing_class=tiny.tiny_tokenizer())
    assert tr.calculate_KL
    _perturb(tr)
    inputs = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    assert inputs["hk_KL_supervised"] == completion_ranges(inputs["KL_completion_mask"].cpu())
    assert inputs["hk_KL_supervised"] != inputs["hk_supervised"]  # (the KL rows' completions are other rows')
    # reference (KL rows, rows), policy (KL rows, rows)
    _supervised_equals_dense(tr, inputs, {"hk_supervised", "hk_KL_supervised"}, head_calls, 4)


@pytest.mark.parametrize("humanline", [False, True], ids=["humanline_off", "humanline_on"])
def test_grpo_supervised_ranges_from_the_generation(tiny_path, head_calls, humanline):
    # EOS made likely, so that completions end early and their rows are right-padded
    kw = dict(COMMON, **T.GRPO_KW, output_dir=tiny_path + "/grpo", max_steps=1, beta=0.05,
              generation_kwargs={"sequence_bias": [[[1], 4.0]]})
    tr = HumanlineGRPOTrainer(tiny_path, reward_funcs=T.digit_reward, train_dataset=T.grpo_data(),
                              args=HumanlineGRPOConfig(**kw, humanline=humanline, fused="linear",
                                                       **(BAND if humanline else {})),
                              processing_class=tiny.tiny_tokenizer())
    tr.model.train()
    inputs = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    lens, cm = inputs["hk_completion_lens"], inputs["completion_mask"]
    assert lens == cm.sum(1).tolist() and min(lens) < cm.size(1)  # some right padding to skip
    _perturb(tr)
    head_calls.clear()
    with torch.no_grad():  # ratio != 1
        inputs["old_per_token_logps"] = tr._hk_batch_logps(tr.model, inputs) + 0.1
    n_sup, _ = _positions(head_calls)
    assert n_sup == sum(lens)
    P = inputs["prompt_ids"].size(1)  # (left-padded prompts: every completion starts at column P)
    assert head_calls[0][1] == [[P - 1, P - 1 + n] for n in lens]
    head_calls.clear()
    _supervised_equals_dense(tr, inputs, {"hk_completion_lens"}, head_calls, 2 if humanline else 1)


# ----------------------------------------------------------------------------------------- refusals
def test_prompt_learning_adapter_runs_dense_and_is_refused_packed(tiny_path, head_calls):
    """Prompt tuning prepends virtual tokens to every row: the ranges (counted on the rows) are left out, the head
    runs dense; a packed row has no place for them, so padding_free is refused."""
    peft = pytest.importorskip("peft")
    kw = dict(COMMON, output_dir=tiny_path + "/pt", per_device_train_batch_size=2, max_steps=1)
    cfg = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)
    tr = HumanlineDPOTrainer(tiny_path, args=HumanlineDPOConfig(**kw, humanline=False, fused="linear"),
                             peft_config=cfg, train_dataset=varied_pref_data(), processing_class=tiny.tiny_tokenizer())
    assert not tr.hk_supervised
    inputs = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    assert "hk_supervised" not in inputs
    assert torch.isfinite(T._loss_and_grads(tr, inputs)[0]) and head_calls and head_calls[0][1] is None
    with pytest.raises(ValueError, match="padding_free=True with a prompt-learning PEFT adapter"):
        HumanlineDPOTrainer(tiny_path, args=HumanlineDPOConfig(**kw, humanline=False, padding_free=True),
                            peft_config=cfg, train_dataset=varied_pref_data(), processing_class=tiny.tiny_tokenizer())


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("fused", ["logits", "linear"])
def test_dpo_flash_attention_packed_trains_like_padded_cuda(tiny_path, fused):
    """flash-attn 2 on the GPU (bf16): packed micro-batches go through its varlen kernel (cu_seq_lens_q/k from
    the collator), padded ones through its unpadding of the attention mask; a few optimizer steps log the same
    losses up to bf16 rounding."""
    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("needs flash_attn")
    cfg = dict(fused=fused, sync_every=1, **BAND)
    gpu = dict(use_cpu=False, bf16=True)
    tr, padded = _train_losses(tiny_path, False, "flash_attention_2", gpu, **cfg)
    assert tr.model.config._attn_implementation == "flash_attention_2" and next(tr.model.parameters()).is_cuda
    _, packed = _train_losses(tiny_path, True, "flash_attention_2", gpu, **cfg)
    assert packed == pytest.approx(padded, rel=2e-2, abs=2e-2)
