"""Humanline GRPO as the paper runs it: completions sampled every N optimizer steps (TRL's generation buffer), the
reference synced every k steps. At every micro-batch of every step, the trainer's loss equals a recomputation from
snapshots: the policy of that step, the reference the snapshot of the last sync step before it (the initial policy
at step 0), through eager logits and hk.reference.grpo. humanline_reference="lookahead" (no reference model)
trains exactly like "sync". CPU, tiny random-init Llama."""
import pytest
import torch

pytest.importorskip("trl")
from test_integrations_trl import COMMON, GRPO_KW, TRL_DEPRECATIONS, digit_reward, grpo_data, tiny  # noqa: E402
from test_integrations_trl import tiny_path as tiny_path  # noqa: E402  (the fixture)
from transformers import AutoModelForCausalLM, TrainerCallback  # noqa: E402

import humanline_kernels as hk  # noqa: E402
import humanline_kernels.integrations.trl as hk_trl  # noqa: E402
from humanline_kernels.integrations.trl import HumanlineGRPOConfig, HumanlineGRPOTrainer  # noqa: E402
from humanline_kernels.integrations.trl._grpo_lookahead import BufferLookahead  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("error::FutureWarning", *TRL_DEPRECATIONS),
              pytest.mark.slow]  # slow: trainer runs

CLIP = hk.HumanlineClip(-0.05, 0.05)  # narrow: the clamp is active once the policy has moved
STEPS = 9  # three generations of 4 steps (the last one cut short): crossings at steps 4 and 8


def _train(monkeypatch, tiny_path, reference, *, fused, every, num_iterations, accum=1, loss_type="dapo", beta=0.04,
           steps=STEPS):
    """Train with a generation every 4 optimizer steps; return the trainer, what each micro-batch's loss saw and
    the policy's parameters at the start of every step."""
    spg = 4 * accum // num_iterations
    args = HumanlineGRPOConfig(
        **COMMON, **GRPO_KW, output_dir=f"{tiny_path}/off-{reference}", max_steps=steps, learning_rate=5e-2,
        beta=beta, loss_type=loss_type, gradient_accumulation_steps=accum, steps_per_generation=spg,
        num_iterations=num_iterations, sync_every=every, humanline_reference=reference, fused=fused,
        log_eps_p=CLIP.log_eps_p, log_eps_r=CLIP.log_eps_r)
    tr = HumanlineGRPOTrainer(tiny_path, reward_funcs=digit_reward, args=args, train_dataset=grpo_data(),
                              processing_class=tiny.tiny_tokenizer())
    seen, loss_fn, compute = [], hk_trl.losses.grpo, tr._compute_loss

    def recording_loss(logps, ref_logps, advantages, mask, **kw):
        loss, met = loss_fn(logps, ref_logps, advantages, mask, **kw)
        seen[-1].update(ref=ref_logps.detach().clone(), kw=kw)
        return loss, met

    def recording_compute(model, inputs):
        seen.append(dict(step=tr.state.global_step, micro=tr._step,
                         inputs={k: v.detach().clone() for k, v in inputs.items() if torch.is_tensor(v)}))
        loss = compute(model, inputs)
        seen[-1]["loss"] = loss.detach().clone()  # what the trainer backpropagates (accumulation scaling included)
        return loss

    monkeypatch.setattr(hk_trl.losses, "grpo", recording_loss)
    tr._compute_loss = recording_compute
    params = []

    class Snap(TrainerCallback):
        def on_step_begin(self, *a, **k):
            params.append({n: p.detach().clone() for n, p in tr.model.named_parameters()})
    tr.add_callback(Snap())
    torch.manual_seed(0)  # the completions are sampled from the global RNG: the same start in every run
    tr.train()
    monkeypatch.undo()
    return tr, seen, params


def _eager_logps(model, params, inputs, train):
    """Per-token log-probs of the micro-batch's completions under ``params`` through the model's logits."""
    model.load_state_dict(params)
    model.train(train)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    T = inputs["completion_ids"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=att).logits[:, -T - 1:-1]
    labels = inputs["completion_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
    return hk.reference.token_logprobs(logits, labels)


def _check_against_snapshots(tiny_path, tr, seen, params, every):
    """Each micro-batch's reference log-probs and loss against the snapshots (the oracle)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    args, accum = tr.args, tr.args.gradient_accumulation_steps
    assert len(params) == args.max_steps and len(seen) == args.max_steps * accum
    lag_seen = 0.0
    for rec in seen:
        t, inp = rec["step"], rec["inputs"]
        s = 0 if t == 0 else every * ((t - 1) // every)
        ref = _eager_logps(model, params[s], inp, train=False)
        mask = inp["completion_mask"].bool()
        torch.testing.assert_close(rec["ref"], ref, rtol=1e-5, atol=1e-5, msg=f"step {t}: reference")
        logps = _eager_logps(model, params[t], inp, train=True)
        lag_seen = max(lag_seen, (torch.where(mask, logps - ref, 0.0)).abs().max().item())
        normalizer, scale = None, 1.0 / accum
        if args.loss_type == "dapo":
            normalizer = inp["num_items_in_batch"].float() * accum / args.steps_per_generation
            scale = 1.0
        want, _ = hk.reference.grpo(logps, ref, inp["advantages"], mask, clip=CLIP, beta=args.beta,
                                    epsilon_low=args.epsilon, epsilon_high=args.epsilon, loss_type=args.loss_type,
                                    normalizer=normalizer, max_completion_length=args.max_completion_length,
                                    use_bias_correction_kl=args.use_bias_correction_kl)
        torch.testing.assert_close(rec["loss"], want * scale, rtol=1e-5, atol=1e-6, msg=f"step {t}: loss")
        assert "old_per_token_logps" not in inp  # humanline: TRL's old log-probs are neither needed nor computed
    assert lag_seen > 1e-3  # the reference lagged the policy: a wrong snapshot would have shown


# (fused, sync_every, num_iterations): every pair of k in {1, 3} and num_iterations in {1, 2} with TRL's head;
# our fused heads (the Triton interpreter on CPU: slower) with one each
CASES = [("off", 1, 1), ("off", 3, 1), ("off", 1, 2), ("off", 3, 2), ("logits", 3, 2), ("linear", 1, 1),
         ("linear", 3, 2)]


@pytest.mark.parametrize("fused,every,num_iterations", CASES)
def test_offpolicy_losses_match_snapshots_and_lookahead_matches_sync(monkeypatch, tiny_path, fused, every,
                                                                    num_iterations):
    tr, seen, params = _train(monkeypatch, tiny_path, "sync", fused=fused, every=every, num_iterations=num_iterations)
    assert tr.ref_model is not None and tr.hk_sync.num_syncs == len(range(0, STEPS, every))
    _check_against_snapshots(tiny_path, tr, seen, params, every)
    la, la_seen, la_params = _train(monkeypatch, tiny_path, "lookahead", fused=fused, every=every,
                                    num_iterations=num_iterations)
    assert la.ref_model is None and la.hk_sync is None and la.hk_la_syncs == len(range(0, STEPS, every))
    assert len(la_seen) == len(seen)
    for a, b in zip(la_seen, seen):
        assert (a["step"], a["micro"]) == (b["step"], b["micro"])
        for key in ("completion_ids", "advantages"):  # the same completions were sampled
            torch.testing.assert_close(a["inputs"][key], b["inputs"][key], rtol=0, atol=0)
        torch.testing.assert_close(a["ref"], b["ref"], rtol=0, atol=0, msg=f"step {a['step']}: reference")
        torch.testing.assert_close(a["loss"], b["loss"], rtol=0, atol=0, msg=f"step {a['step']}: loss")
    for a, b in zip(la_params, params):
        for n in b:
            torch.testing.assert_close(a[n], b[n], rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("reference", ["sync", "lookahead"])
def test_offpolicy_with_accumulation_and_grpo_loss(monkeypatch, tiny_path, reference):
    """Two micro-batches per step, a buffer of 8 micro-batches (4 steps), TRL's "grpo" aggregation (divided by the
    accumulation steps), k = 2."""
    tr, seen, params = _train(monkeypatch, tiny_path, reference, fused="off", every=2, num_iterations=1, accum=2,
                              loss_type="grpo", steps=6)
    _check_against_snapshots(tiny_path, tr, seen, params, 2)


def test_lookahead_keeps_no_reference_and_frees_its_snapshot(monkeypatch, tiny_path):
    """Across a generation the lookahead holds the trainable parameters of one sync on the host, and drops them
    once their window is done; no reference model, no reference adapter."""
    tr, _, _ = _train(monkeypatch, tiny_path, "lookahead", fused="off", every=3, num_iterations=1, steps=6)
    assert tr.ref_model is None and not hasattr(tr.model, "peft_config")
    assert tr.hk_la.snapshot is None and not tr.hk_la.refs  # nothing left over at the end
    logs = [h["humanline/num_syncs"] for h in tr.state.log_history if "humanline/num_syncs" in h]
    assert logs[-1] == 2  # windows computed at the sync steps 0 and 3


def test_bad_settings_are_refused(tiny_path):
    tok = tiny.tiny_tokenizer()
    kw = dict(COMMON, **GRPO_KW, output_dir=tiny_path + "/bad", max_steps=1)
    for bad in (dict(steps_per_generation=1), dict(gradient_accumulation_steps=2, steps_per_generation=3)):
        with pytest.raises(ValueError, match="next step's completions do not exist yet"):
            HumanlineGRPOConfig(**kw, **bad, humanline_reference="lookahead")
    with pytest.raises(ValueError, match="needs humanline=True"):
        HumanlineGRPOConfig(**kw, steps_per_generation=4, humanline=False, humanline_reference="lookahead")
    args = HumanlineGRPOConfig(**kw, steps_per_generation=4, humanline_reference="lookahead")
    with pytest.raises(ValueError, match="uses no reference model"):
        HumanlineGRPOTrainer(tiny_path, reward_funcs=digit_reward, args=args, train_dataset=grpo_data(),
                             processing_class=tok, ref_model=tiny.tiny_model())
    with pytest.raises(ValueError, match="evaluation needs reference log-probs"):
        HumanlineGRPOTrainer(tiny_path, reward_funcs=digit_reward, train_dataset=grpo_data(), processing_class=tok,
                             eval_dataset=grpo_data(), args=HumanlineGRPOConfig(
                                 **kw, steps_per_generation=4, humanline_reference="lookahead",
                                 eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4))
    for bad, match in ((dict(loss_type="ppo"), "loss_type must be one of"),
                       (dict(loss_type="cispo", delta=1.5), "delta .* loss_type='cispo'"),
                       (dict(importance_sampling_level="row"), "importance_sampling_level")):
        with pytest.raises(ValueError, match=match):
            HumanlineGRPOTrainer(tiny_path, reward_funcs=digit_reward, train_dataset=grpo_data(),
                                 processing_class=tok, args=HumanlineGRPOConfig(**kw, **bad))


def test_peft_policy_lookahead_matches_its_reference_adapter(tiny_path):
    """A PEFT policy: "sync" keeps a synced "ref" adapter, "lookahead" none (its crossing snapshot holds the adapter
    weights only); the same training."""
    peft = pytest.importorskip("peft")
    losses = {}
    for reference in ("sync", "lookahead"):
        args = HumanlineGRPOConfig(**COMMON, **GRPO_KW, output_dir=f"{tiny_path}/peft-{reference}", max_steps=6,
                                   learning_rate=5e-2, steps_per_generation=4, sync_every=2, fused="off",
                                   humanline_reference=reference, log_eps_p=-0.05, log_eps_r=0.05)
        tr = HumanlineGRPOTrainer(tiny_path, reward_funcs=digit_reward, args=args, train_dataset=grpo_data(),
                                  processing_class=tiny.tiny_tokenizer(),
                                  peft_config=peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
        assert ("ref" in tr.model.peft_config) == (reference == "sync")
        if reference == "lookahead":
            tr.train = _checking_snapshot_size(tr)
        torch.manual_seed(0)
        tr.train()
        losses[reference] = [h["loss"] for h in tr.state.log_history if "loss" in h]
    assert len(losses["sync"]) == 6 and losses["lookahead"] == losses["sync"]


def _checking_snapshot_size(tr):
    """``tr.train`` that checks that every crossing snapshot holds the trainable (adapter) parameters only."""
    train, sizes, real_window = tr.train, [], BufferLookahead._window
    adapter = sum(p.numel() for p in tr.model.parameters() if p.requires_grad)

    def window(self, *args):
        real_window(self, *args)
        if self.snapshot is not None:
            sizes.append(sum(v.numel() for v in self.snapshot[1]))

    def run(*a, **k):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(BufferLookahead, "_window", window)
            out = train(*a, **k)
        assert sizes and set(sizes) == {adapter}, (sizes, adapter)
        return out
    return run
