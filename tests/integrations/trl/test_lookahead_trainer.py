"""``humanline_reference="lookahead"`` in the humanline DPO / KTO trainers: step for step the same training as
``humanline_reference="sync"`` (a reference model copied from the policy, synced every ``sync_every`` steps before
the update), with gradient accumulation and across epoch boundaries; no reference model nor second copy of the
parameters; GRPO with a generation per step and bad values refused."""
import gc

import pytest
import torch

pytest.importorskip("trl")
from test_integrations_trl import COMMON, TRL_DEPRECATIONS, kto_data, pref_data, tiny, tiny_path  # noqa: E402,F401
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig  # noqa: E402

import humanline_kernels.integrations.trl as hk_trl  # noqa: E402
from humanline_kernels.integrations.trl import (  # noqa: E402
    HumanlineDPOConfig,
    HumanlineDPOTrainer,
    HumanlineGRPOConfig,
    HumanlineGRPOTrainer,
    HumanlineKTOConfig,
    HumanlineKTOTrainer,
)

pytestmark = [pytest.mark.filterwarnings("error::FutureWarning", *TRL_DEPRECATIONS),
              pytest.mark.slow]  # slow: trainer runs

TRAINERS = {"dpo": (HumanlineDPOTrainer, HumanlineDPOConfig, pref_data),
            "kto": (HumanlineKTOTrainer, HumanlineKTOConfig, kto_data)}


def _train(monkeypatch, tiny_path, algo, reference, *, every, accum, batch, steps, fused, peft_config=None,
           model_path=None, **extra):
    """Train; return per micro-batch what the loss got (reference log-probs, KTO's KL rows' too, loss) and the
    parameters after every optimizer step."""
    trainer_cls, config_cls, data = TRAINERS[algo]
    loss_fn = trainer_cls._hk_loss  # the trainers' loss on the per-token log-probs: (loss, what the logs read)
    seen = []

    def recording(self, logps, ref_logps, *args, **kwargs):
        loss, stats = loss_fn(self, logps, ref_logps, *args, **kwargs)
        kl_ref = args[3] if algo == "kto" else None  # kto: (logps, ref, mask, desirable, kl, kl_ref, kl_mask)
        seen.append((ref_logps.clone(), None if kl_ref is None else kl_ref.clone(), loss.detach().clone(),
                     logps.detach().clone()))
        return loss, stats
    monkeypatch.setattr(trainer_cls, "_hk_loss", recording)
    kw = dict(COMMON, output_dir=tiny_path + f"/{algo}-{reference}", per_device_train_batch_size=batch,
              max_steps=steps, learning_rate=5e-2, gradient_accumulation_steps=accum, **extra)
    args = config_cls(**kw, sync_every=every, humanline_reference=reference, fused=fused)
    tr = trainer_cls(model_path or tiny_path, args=args, train_dataset=data(), processing_class=tiny.tiny_tokenizer(),
                     peft_config=peft_config)
    params = []

    class Snap(TrainerCallback):
        def on_step_end(self, *a, **k):  # (the trained parameters: not a PEFT policy's reference adapter)
            params.append([p.detach().clone() for n, p in tr.model.named_parameters() if ".ref." not in n])
    tr.add_callback(Snap())
    # the data order is args.seed's (accelerate's seedable sampler, its own generator); the global RNG gives the
    # dropout masks (and the data loader's base seed): the same start in both runs
    torch.manual_seed(0)
    tr.train()
    monkeypatch.undo()
    return tr, seen, params


def _same(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=what)


# dpo: 12 pairs. batch 2 -> 6 micro-batches an epoch, 3 steps of 2; batch 4 -> 3 micro-batches, steps of 2 then 1
# (the epoch's remainder). kto: 16 rows, batch 4 -> 4 micro-batches, 2 steps of 2. The "off" cases cross epochs,
# and every > 1 makes windows that straddle an epoch boundary. fused="off" (TRL's log-prob head, plain torch) keeps
# them fast on CPU; the last case runs our fused-linear head (Triton's interpreter on CPU: slow, so within an epoch).
CASES = [("dpo", 1, 2, 2, 4, "off"), ("dpo", 3, 2, 4, 5, "off"), ("kto", 2, 2, 4, 4, "off"),
         ("kto", 2, 1, 4, 3, "linear")]


@pytest.mark.parametrize("algo,every,accum,batch,steps,fused", CASES)
def test_lookahead_trains_like_a_synced_reference(monkeypatch, tiny_path, algo, every, accum, batch, steps, fused):
    run = dict(every=every, accum=accum, batch=batch, steps=steps, fused=fused)
    sync, s_seen, s_params = _train(monkeypatch, tiny_path, algo, "sync", **run)
    look, l_seen, l_params = _train(monkeypatch, tiny_path, algo, "lookahead", **run)
    assert sync.ref_model is not None and look.ref_model is None
    assert look.state.global_step == steps and (look.state.epoch > 1 or fused != "off")
    assert len(s_seen) == len(l_seen) == sum(len(x) for x in _step_sizes(look, steps))
    for i, (a, b) in enumerate(zip(s_seen, l_seen)):
        _same(a[0], b[0], f"micro-batch {i}: reference log-probs")
        _same(a[1], b[1], f"micro-batch {i}: KL rows' reference log-probs")
        _same(a[2], b[2], f"micro-batch {i}: loss")
        _same(a[3], b[3], f"micro-batch {i}: policy log-probs")
    assert len(s_params) == len(l_params) == steps
    for t, (a, b) in enumerate(zip(s_params, l_params)):
        for x, y in zip(a, b):
            _same(x, y, f"parameters after step {t}")
    # the test can fail: the reference lags the policy (a lookahead on the current policy would give ref == logps)
    assert any(not torch.allclose(r, lp) for r, _, _, lp in s_seen[accum:])
    assert look.hk_la_syncs == sync.hk_sync.num_syncs == len(range(0, steps, every))
    if algo == "kto":
        assert all(r[1] is not None for r in l_seen)  # the KL baseline's rows had lookahead reference log-probs


@pytest.fixture(scope="module")
def dropout_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tinydrop"))
    model = tiny.tiny_model()
    model.config.attention_dropout = 0.3
    model.save_pretrained(path)
    tiny.tiny_tokenizer().save_pretrained(path)
    return path


def test_lookahead_with_dropout_trains_like_a_synced_reference(monkeypatch, tiny_path, dropout_path):
    """Dropout on in training (disable_dropout=False): the same masks as "sync", step for step. 12 pairs, batch 4:
    3 steps an epoch; sync_every=2: step 2's window (steps 3, 4) is drawn from epoch 1 at step 2, before that
    step's dropout; the data loader's seed draw for epoch 1 must still come where the stock loop makes it.
    Also: the window forwards run in eval mode (no dropout: they would differ from the eval-mode reference model of
    "sync", and draw from the RNG, shifting the later masks)."""
    run = dict(every=2, accum=1, batch=4, steps=5, fused="off", model_path=dropout_path, disable_dropout=False)
    sync, s_seen, s_params = _train(monkeypatch, tiny_path, "dpo", "sync", **run)
    modes = []
    reference_of = hk_trl.HumanlineDPOTrainer._hk_reference_of

    def recording(self, policy, inputs):
        modes.append(any(m.training for m in policy.modules()))
        return reference_of(self, policy, inputs)
    monkeypatch.setattr(hk_trl.HumanlineDPOTrainer, "_hk_reference_of", recording)
    look, l_seen, l_params = _train(monkeypatch, tiny_path, "dpo", "lookahead", **run)
    assert look.state.epoch > 1 and len(modes) == 5 and not any(modes)
    assert not sync.ref_model.training and look.model.training
    # dropout is on: step 0's policy log-probs (θ_0, train mode) differ from its reference (θ_0, eval mode)
    assert not torch.allclose(l_seen[0][0], l_seen[0][3])
    assert len(s_seen) == len(l_seen) == 5 and len(s_params) == len(l_params) == 5
    for i, (a, b) in enumerate(zip(s_seen, l_seen)):
        _same(a[0], b[0], f"step {i}: reference log-probs")
        _same(a[2], b[2], f"step {i}: loss")
        _same(a[3], b[3], f"step {i}: policy log-probs")
    for t, (a, b) in enumerate(zip(s_params, l_params)):
        for x, y in zip(a, b):
            _same(x, y, f"parameters after step {t}")


def test_lookahead_refuses_leaving_an_epoch_early(tiny_path):
    """A callback that ends an epoch early: the stock loop starts the next epoch afresh, while the lookahead already
    drew the rest of the epoch for its window: refused, not trained on the wrong data."""
    class StopEpoch(TrainerCallback):
        def on_step_end(self, args, state, control, **k):
            if state.global_step == 1:
                control.should_epoch_stop = True
    kw = dict(COMMON, output_dir=tiny_path + "/stop", per_device_train_batch_size=4, max_steps=4, fused="off")
    tr = HumanlineDPOTrainer(tiny_path, args=HumanlineDPOConfig(**kw, sync_every=2, humanline_reference="lookahead"),
                             train_dataset=pref_data(), processing_class=tiny.tiny_tokenizer(),
                             callbacks=[StopEpoch()])
    with pytest.raises(RuntimeError, match="leaving an epoch early"):
        tr.train()
    assert tr.state.global_step == 1


def test_lookahead_refuses_data_without_a_length(tiny_path):
    """An IterableDataset: transformers restarts it whenever it runs out (with partial steps that get no optimizer
    step); the lookahead plans the coming steps from the data's length, so it refuses one without."""
    kw = dict(COMMON, output_dir=tiny_path + "/iter", per_device_train_batch_size=4, max_steps=5, fused="off")
    with pytest.raises(ValueError, match="needs a training dataset with a length"):
        HumanlineDPOTrainer(tiny_path, args=HumanlineDPOConfig(**kw, humanline_reference="lookahead"),
                            train_dataset=pref_data().to_iterable_dataset(), processing_class=tiny.tiny_tokenizer())


def test_lookahead_peft_policy_needs_no_reference_adapter(monkeypatch, tiny_path):
    """A PEFT policy: "sync" keeps a synced "ref" adapter, "lookahead" none, and they train alike."""
    from test_integrations_trl import _peft_config
    run = dict(every=3, accum=2, batch=4, steps=5, fused="off")
    sync, s_seen, s_params = _train(monkeypatch, tiny_path, "dpo", "sync", **run, peft_config=_peft_config())
    look, l_seen, l_params = _train(monkeypatch, tiny_path, "dpo", "lookahead", **run, peft_config=_peft_config())
    assert "ref" in sync.model.peft_config and list(look.model.peft_config) == ["default"]
    assert len(s_seen) == len(l_seen) and len(s_params) == len(l_params) == 5
    for i, (a, b) in enumerate(zip(s_seen, l_seen)):
        _same(a[0], b[0], f"micro-batch {i}: reference log-probs")
        _same(a[2], b[2], f"micro-batch {i}: loss")
    for t, (a, b) in enumerate(zip(s_params, l_params)):
        for x, y in zip(a, b):
            _same(x, y, f"parameters after step {t}")
    assert any(not torch.allclose(r, lp) for r, _, _, lp in s_seen[2:])


def _step_sizes(trainer, steps):
    """Micro-batches per optimizer step, as transformers' _run_epoch draws them (an epoch's last step may be
    short), for the steps trained."""
    per_epoch = len(trainer.get_train_dataloader())
    accum = trainer.args.gradient_accumulation_steps
    sizes = []
    while len(sizes) < steps:
        sizes += [[0] * min(accum, per_epoch - i) for i in range(0, per_epoch, accum)]
    return sizes[:steps]


def _param_bytes():
    gc.collect()
    seen, total = set(), 0
    for o in gc.get_objects():
        # issubclass: Parameter's isinstance hook trips over some objects gc holds (torch.distributed's)
        if issubclass(type(o), torch.nn.Parameter) and o.untyped_storage().data_ptr() not in seen:
            seen.add(o.untyped_storage().data_ptr())
            total += o.untyped_storage().nbytes()
    return total


def test_lookahead_holds_no_second_copy_of_the_parameters(tiny_path):
    """Bytes of parameters alive while training (issue 13, item 4: the measured saving on the test model)."""
    kw = dict(COMMON, per_device_train_batch_size=2, max_steps=1, learning_rate=5e-2, fused="off")
    policy_bytes = sum(p.numel() * p.element_size() for p in tiny.tiny_model().parameters())
    alive = {}
    for reference in ("sync", "lookahead"):
        gc.collect()
        base = _param_bytes()
        during = []

        class Count(TrainerCallback):
            def on_step_end(self, *a, **k):  # after the step's reference log-probs and update
                during.append(_param_bytes() - base)
        tr = HumanlineDPOTrainer(tiny_path, args=HumanlineDPOConfig(**kw, output_dir=tiny_path + "/mem",
                                                                    humanline_reference=reference),
                                 train_dataset=pref_data(), processing_class=tiny.tiny_tokenizer())
        tr.add_callback(Count())
        tr.train()
        alive[reference] = max(during)
        del tr
    print(f"\nparameter bytes alive while training: sync {alive['sync']}, lookahead {alive['lookahead']} "
          f"(policy {policy_bytes}; saved {alive['sync'] - alive['lookahead']})")
    assert alive["lookahead"] == policy_bytes
    assert alive["sync"] == 2 * policy_bytes


def test_grpo_refuses_lookahead_with_a_generation_per_step(tiny_path):
    # (with a generation every N >= 2 steps it is accepted: tests/integrations/trl/test_trl_grpo_offpolicy.py)
    with pytest.raises(ValueError, match="next step's completions do not exist yet"):
        HumanlineGRPOConfig(**COMMON, output_dir=tiny_path + "/g", humanline_reference="lookahead")
    args = GRPOConfig(**COMMON, output_dir=tiny_path + "/g", per_device_train_batch_size=4, num_generations=2)
    args.humanline_reference = "lookahead"  # a plain TRL config with the field set by hand
    with pytest.raises(ValueError, match="next step's completions do not exist yet"):
        HumanlineGRPOTrainer(tiny_path, reward_funcs=lambda completions, **k: [0.0] * len(completions), args=args,
                             train_dataset=pref_data(), processing_class=tiny.tiny_tokenizer())


@pytest.mark.parametrize("algo", ["dpo", "kto"])
def test_bad_lookahead_settings_are_refused(tiny_path, algo):
    trainer_cls, config_cls, data = TRAINERS[algo]
    kw = dict(COMMON, output_dir=tiny_path + "/bad", per_device_train_batch_size=4, max_steps=1)
    with pytest.raises(ValueError, match="humanline_reference must be one of"):
        config_cls(**kw, humanline_reference="lagged")
    with pytest.raises(ValueError, match="needs humanline=True"):
        config_cls(**kw, humanline=False, humanline_reference="lookahead")
    args = config_cls(**kw, humanline_reference="lookahead")
    with pytest.raises(ValueError, match="uses no reference model"):
        trainer_cls(tiny_path, ref_model=tiny.tiny_model(), args=args, train_dataset=data(),
                    processing_class=tiny.tiny_tokenizer())
    with pytest.raises(ValueError, match="evaluation needs reference log-probs"):
        trainer_cls(tiny_path, args=config_cls(**kw, humanline_reference="lookahead", eval_strategy="steps",
                                               eval_steps=1), train_dataset=data(), eval_dataset=data(),
                    processing_class=tiny.tiny_tokenizer())
    with pytest.MonkeyPatch.context() as mp:  # context parallelism (a ParallelismConfig with cp_size > 1)
        mp.setattr(trainer_cls, "get_cp_size", lambda self: 2)
        with pytest.raises(ValueError, match="context or sequence parallelism"):
            trainer_cls(tiny_path, args=args, train_dataset=data(), processing_class=tiny.tiny_tokenizer())


def _ddp_worker(rank, world, port, path, out_dir):
    import os
    os.environ.update(CUDA_VISIBLE_DEVICES="",  # CPU ranks on gloo, also on a GPU machine
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), ACCELERATE_USE_CPU="1")
    COMMON["ddp_backend"] = "gloo"
    res = {}
    for reference in ("sync", "lookahead"):
        tr, seen, params = _train(pytest.MonkeyPatch(), path, "dpo", reference, every=3, accum=2, batch=2, steps=4,
                                  fused="off")
        res[reference] = {"seen": seen, "params": params, "wrapped": type(tr.model_wrapped).__name__,
                          "world": tr.accelerator.num_processes, "epoch": tr.state.epoch}
    torch.save(res, os.path.join(out_dir, f"lookahead{rank}.pt"))


def test_lookahead_trainer_ddp_gloo_world2(tiny_path, tmp_path):
    """DDP, 2 ranks: each rank's lookahead draws its own shard of the data (the distributed sampler), step for step
    as its "sync" run does (12 pairs / (2 ranks x batch 2) = 3 micro-batches a rank-epoch: steps of 2 then 1; a
    window of 3 steps from step 0 reaches into the second epoch)."""
    import torch.multiprocessing as mp
    from test_integrations_ddp import _free_port
    mp.spawn(_ddp_worker, args=(2, _free_port(), tiny_path, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"lookahead{r}.pt") for r in range(2)]
    for r in ranks:
        sync, look = r["sync"], r["lookahead"]
        assert look["wrapped"] == "DistributedDataParallel" and look["world"] == 2 and look["epoch"] > 1
        assert len(sync["seen"]) == len(look["seen"]) == 6
        for i, (a, b) in enumerate(zip(sync["seen"], look["seen"])):
            _same(a[0], b[0], f"micro-batch {i}: reference log-probs")
            _same(a[2], b[2], f"micro-batch {i}: loss")
        for t, (a, b) in enumerate(zip(sync["params"], look["params"])):
            for x, y in zip(a, b):
                _same(x, y, f"parameters after step {t}")
    # the ranks trained on different shards (their reference log-probs differ) and kept the same parameters
    assert any(a[0].shape != b[0].shape or not torch.equal(a[0], b[0])
               for a, b in zip(ranks[0]["lookahead"]["seen"], ranks[1]["lookahead"]["seen"]))
    for x, y in zip(ranks[0]["lookahead"]["params"][-1], ranks[1]["lookahead"]["params"][-1]):
        assert torch.equal(x, y)
