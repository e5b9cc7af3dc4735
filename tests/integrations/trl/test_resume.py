"""Resume (docs/integrations.md, "Resume"): a humanline run stopped after the checkpoint of step s and resumed from it
ends with the weights, the reference and the logged metrics of the run that never stopped, in every TRL trainer
(DPO, KTO, GRPO on-policy and with a generation every N steps), fused off / logits / linear, gradient accumulation,
a LoRA reference adapter, the lookahead, and the transformers callback on a plain Trainer; humanline=False (stock
TRL) is the control. The stopped run is stopped as a crash would stop it: the same max_steps and schedule, a
callback that ends training after the checkpoint of step s. s is not a multiple of sync_every, so the reference at
the checkpoint is a sync the resumed run cannot rebuild from the policy or the initial model."""
import copy
import importlib.util
import os

import pytest
import torch

pytest.importorskip("trl")
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from humanline_kernels.integrations.transformers import HumanlineSyncCallback  # noqa: E402
from humanline_kernels.integrations.trl import (  # noqa: E402
    HumanlineDPOConfig,
    HumanlineDPOTrainer,
    HumanlineGRPOConfig,
    HumanlineGRPOTrainer,
    HumanlineKTOConfig,
    HumanlineKTOTrainer,
)

pytestmark = pytest.mark.slow  # trainer runs stopped and resumed

_spec = importlib.util.spec_from_file_location(
    "hk_trl_tests", os.path.join(os.path.dirname(__file__), "test_integrations_trl.py"))
T = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(T)
tiny = T.tiny

# logged per train() call or timed, or counters that stock TRL does not checkpoint either (its _total_train_tokens): the
# control test checks that these are all that stock TRL's own resume changes
PER_CALL = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss", "total_flos",
            "step_time", "num_tokens"}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    tiny.tiny_model().save_pretrained(path)
    tiny.tiny_tokenizer().save_pretrained(path)
    return path


class StopAt(TrainerCallback):
    """Ends training after step ``s`` (and its checkpoint): the run's schedule is unchanged, as in a crash."""

    def __init__(self, s):
        self.s = s

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.s:
            control.should_training_stop = True


TRAINERS = {
    "dpo": (HumanlineDPOTrainer, HumanlineDPOConfig, T.pref_data, {}),
    "kto": (HumanlineKTOTrainer, HumanlineKTOConfig, T.kto_data, {}),
    "grpo": (HumanlineGRPOTrainer, HumanlineGRPOConfig, T.grpo_data,
             dict(num_generations=2, max_completion_length=4, temperature=1.0)),
}


def _trainer(path, algo, out, n, s, callbacks=(), peft_config=None, **hk):
    cls, cfg, data, extra = TRAINERS[algo]
    kw = dict(T.COMMON, output_dir=out, per_device_train_batch_size=4 if algo == "grpo" else 2, max_steps=n,
              learning_rate=5e-2, save_strategy="steps", save_steps=s, **extra)
    kw.update(hk)
    args = cfg(**kw)
    more = {"reward_funcs": T.digit_reward} if algo == "grpo" else {}
    model = path
    if peft_config is not None:
        import peft
        model = peft.get_peft_model(tiny.tiny_model(), peft_config)
    return cls(model, args=args, train_dataset=data(), processing_class=tiny.tiny_tokenizer(),
               callbacks=list(callbacks), **more)


def _run_three(make, tmp_path, s):
    """(uninterrupted, resumed) trainers: one run to the end, one stopped after the checkpoint of step s, and a
    fresh trainer resumed from that checkpoint."""
    full = make(str(tmp_path / "full"), ())
    full.train()
    make(str(tmp_path / "stopped"), (StopAt(s),)).train()
    ckpt = tmp_path / "stopped" / f"checkpoint-{s}"
    assert ckpt.is_dir()
    resumed = make(str(tmp_path / "stopped"), ())
    resumed.train(resume_from_checkpoint=str(ckpt))
    return full, resumed


def _logs_after(trainer, s):
    return [h for h in trainer.state.log_history if h.get("step", 0) > s]


def _differing_logs(a, b, s):
    la, lb = _logs_after(a, s), _logs_after(b, s)
    assert len(la) == len(lb) and la
    keys = set()
    for x, y in zip(la, lb):
        assert x.keys() == y.keys()
        keys |= {k for k in x if x[k] != pytest.approx(y[k], rel=1e-6, abs=1e-7)}
    return keys


def _params(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _assert_same_run(full, resumed, s):
    a, b = _params(full.model), _params(resumed.model)
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(b[n], a[n], rtol=1e-6, atol=1e-6, msg=n)
    if getattr(full, "ref_model", None) is not None:
        for (n, p), q in zip(full.ref_model.named_parameters(), resumed.ref_model.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6, msg=f"reference {n}")
    assert _differing_logs(full, resumed, s) <= PER_CALL


# (algo, sync_every, fused, accumulation, checkpoint step s, max_steps n, more settings)
CASES = [
    ("dpo", 1, "linear", 1, 3, 6, {}),
    ("dpo", 2, "logits", 2, 3, 6, {}),
    ("dpo", 4, "off", 1, 5, 8, {}),  # crosses an epoch (6 steps each) after the checkpoint
    ("kto", 2, "linear", 1, 3, 6, {}),
    ("kto", 3, "logits", 2, 4, 6, {}),
    ("grpo", 2, "linear", 1, 3, 5, {}),  # a generation every step
    ("grpo", 3, "logits", 1, 4, 6, {"steps_per_generation": 2}),  # every 2 steps; s at a generation boundary
    ("grpo", 2, "linear", 2, 3, 4, {}),  # (4 steps an epoch: TRL's GRPO sampler restarts its order on resume)
    ("dpo", 2, "linear", 1, 3, 8, {"humanline_reference": "lookahead"}),
    ("kto", 3, "linear", 2, 4, 6, {"humanline_reference": "lookahead"}),
    ("grpo", 3, "linear", 1, 4, 8, {"steps_per_generation": 2, "humanline_reference": "lookahead"}),
]


def _case_id(c):
    algo, every, fused, accum, s, _, more = c
    return "-".join([algo, f"k{every}", fused, f"acc{accum}", f"s{s}", *map(str, more.values())])


@pytest.mark.parametrize("algo,every,fused,accum,s,n,more", CASES, ids=[_case_id(c) for c in CASES])
def test_resumed_run_is_the_uninterrupted_one(tiny_path, tmp_path, algo, every, fused, accum, s, n, more):
    full, resumed = _run_three(
        lambda out, cbs: _trainer(tiny_path, algo, out, n, s, cbs, sync_every=every, fused=fused,
                                  gradient_accumulation_steps=accum, **more), tmp_path, s)
    _assert_same_run(full, resumed, s)
    logged = [h["humanline/num_syncs"] for h in resumed.state.log_history if "humanline/num_syncs" in h]
    assert logged[-1] == -(-n // every)  # syncs at steps 0, k, 2k, ... < n, counted across the resume


@pytest.mark.parametrize("algo", ["dpo", "kto", "grpo"])
def test_stock_resume_is_exact_too(tiny_path, tmp_path, algo):
    """The control: humanline=False (stock TRL) resumes exactly, logs apart from the per-call keys."""
    more = {"steps_per_generation": 2} if algo == "grpo" else {}
    full, resumed = _run_three(
        lambda out, cbs: _trainer(tiny_path, algo, out, 6, 4, cbs, humanline=False, **more), tmp_path, 4)
    _assert_same_run(full, resumed, 4)


def test_grpo_inside_a_generation_batch(tiny_path, tmp_path):
    """TRL does not checkpoint its generation buffer: resuming inside a generation batch samples a new one (stock
    too). Humanline warns; the lookahead, whose saved log-probs belong to the lost completions, refuses."""
    for mode, expect in (("sync", pytest.warns(UserWarning, match="inside a generation batch")),
                         ("lookahead", pytest.raises(ValueError, match="inside a generation batch"))):
        out = str(tmp_path / mode)
        _trainer(tiny_path, "grpo", out, 6, 3, (StopAt(3),), sync_every=2, steps_per_generation=2,
                 humanline_reference=mode).train()
        tr = _trainer(tiny_path, "grpo", out, 6, 3, (), sync_every=2, steps_per_generation=2, humanline_reference=mode)
        with expect:
            tr.train(resume_from_checkpoint=os.path.join(out, "checkpoint-3"))


def _load_subfolder_adapters_only(self, resume_from_checkpoint, model=None):
    """What transformers 5.17-5.22's ``Trainer._load_from_checkpoint`` does for a PEFT model whose checkpoint has
    adapters in subfolders (humanline's "ref"): it loads those and leaves the trained adapter at the root unread."""
    model = self.model if model is None else model
    active = model.active_adapters[0]
    for sub in sorted(os.listdir(resume_from_checkpoint)):
        if os.path.isfile(os.path.join(resume_from_checkpoint, sub, "adapter_model.safetensors")):
            model.load_adapter(os.path.join(resume_from_checkpoint, sub), sub, is_trainable=sub == active)
    model.set_adapter(active)


@pytest.mark.parametrize("transformers_load", ["installed", "5.17-5.22"])
def test_lora_reference_adapter_resumes(tiny_path, tmp_path, monkeypatch, transformers_load):
    """A LoRA policy with its synced "ref" adapter resumes exactly; also where transformers itself does not restore
    the policy's adapter (5.17-5.22, the GPU image's 5.17 in run 6): the trainer loads it."""
    peft = pytest.importorskip("peft")
    if transformers_load != "installed":
        from humanline_kernels.integrations.trl import _common
        monkeypatch.setattr(Trainer, "_load_from_checkpoint", _load_subfolder_adapters_only)
        monkeypatch.setattr(_common, "_ROOT_ADAPTER_LOADED", False)
    cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    full, resumed = _run_three(
        lambda out, cbs: _trainer(tiny_path, "dpo", out, 6, 3, cbs, peft_config=copy.deepcopy(cfg), sync_every=2),
        tmp_path, 3)
    _assert_same_run(full, resumed, 3)
    ref = [n for n, _ in full.model.named_parameters() if ".ref." in n]
    assert ref  # the reference adapter was compared with the rest (and only it is saved)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "stopped" / "checkpoint-3" / "humanline_reference.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all(".ref." in k for k in keys)


def test_callback_on_a_plain_trainer_resumes(tmp_path):
    """HumanlineSyncCallback with a transformers Trainer whose loss uses a reference model (resume_from_checkpoint
    =True: the newest checkpoint in output_dir)."""
    ds = _lm_data()

    def make(out, cbs):
        policy = tiny.tiny_model()
        ref = copy.deepcopy(policy).eval().requires_grad_(False)
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                 max_steps=6, learning_rate=5e-2, report_to=[], save_strategy="steps", save_steps=3,
                                 use_cpu=True, logging_steps=1, disable_tqdm=True, seed=0)
        cb = HumanlineSyncCallback(every=2, ref_model=ref)
        tr = _RefTrainer(model=policy, args=args, train_dataset=ds, callbacks=[cb, *cbs])
        tr.ref_model, tr.cb = ref, cb
        return tr

    full = make(str(tmp_path / "full"), ())
    full.train()
    make(str(tmp_path / "stopped"), (StopAt(3),)).train()
    resumed = make(str(tmp_path / "stopped"), ())
    resumed.train(resume_from_checkpoint=True)
    _assert_same_run(full, resumed, 3)
    assert resumed.cb.num_syncs == full.cb.num_syncs == 3


def _lm_data():
    from datasets import Dataset
    g = torch.Generator().manual_seed(0)
    return Dataset.from_list([{"input_ids": torch.randint(2, 40, (8,), generator=g).tolist()} for _ in range(24)])


class _RefTrainer(Trainer):
    """A loss against a reference model, as the DPO/KTO/GRPO trainers have."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids = inputs["input_ids"]
        with torch.no_grad():
            ref_logits = self.ref_model(input_ids=ids).logits
        logits = model(input_ids=ids).logits
        kl = torch.nn.functional.kl_div(logits.log_softmax(-1), ref_logits.log_softmax(-1), log_target=True,
                                        reduction="batchmean")
        return kl + model(input_ids=ids, labels=ids).loss


# ------------------------------------------------------------------------------------- what a checkpoint holds
def test_checkpoint_files_and_save_reference_off(tiny_path, tmp_path):
    """sync: humanline_state.json + the reference's weights; save_reference=False: the schedule only, and a resume
    warns and starts the reference from the resumed policy."""
    _trainer(tiny_path, "dpo", str(tmp_path / "on"), 6, 3, (StopAt(3),), sync_every=2).train()
    on = sorted(p.name for p in (tmp_path / "on" / "checkpoint-3").iterdir() if p.name.startswith("humanline"))
    assert on == ["humanline_reference.safetensors", "humanline_state.json"]
    _trainer(tiny_path, "dpo", str(tmp_path / "off"), 6, 3, (StopAt(3),), sync_every=2, save_reference=False).train()
    off = sorted(p.name for p in (tmp_path / "off" / "checkpoint-3").iterdir() if p.name.startswith("humanline"))
    assert off == ["humanline_state.json"]
    tr = _trainer(tiny_path, "dpo", str(tmp_path / "off"), 6, 3, (), sync_every=2, save_reference=False)
    seen = {}

    class Peek(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kw):
            if state.global_step == 3:
                seen["policy"], seen["ref"] = _params(model), _params(tr.ref_model)
    tr.add_callback(Peek())
    with pytest.warns(UserWarning, match="no reference weights"):
        tr.train(resume_from_checkpoint=str(tmp_path / "off" / "checkpoint-3"))
    for n, p in seen["policy"].items():
        assert torch.equal(seen["ref"][n], p), n  # the reference restarted from the resumed policy


def test_lookahead_checkpoint_holds_the_window(tiny_path, tmp_path):
    _trainer(tiny_path, "dpo", str(tmp_path / "la"), 8, 3, (StopAt(3),), sync_every=2,
             humanline_reference="lookahead").train()
    names = sorted(p.name for p in (tmp_path / "la" / "checkpoint-3").iterdir() if p.name.startswith("humanline"))
    assert names == ["humanline_lookahead-rank00000-of-00001.safetensors", "humanline_state.json"]


# ------------------------------------------------------------------------------- checkpoints that do not match
_STOPPED = {}  # settings -> a stopped run's output folder, made once per module and copied per test


def _stopped(tiny_path, tmp_path, **hk):
    """A DPO run stopped after the checkpoint of step 3, as a fresh copy in ``tmp_path`` (tests damage it)."""
    import shutil
    key = tuple(sorted(hk.items()))
    if key not in _STOPPED:
        src = os.path.join(os.path.dirname(tiny_path), f"stopped-{len(_STOPPED)}")
        _trainer(tiny_path, "dpo", src, 6, 3, (StopAt(3),), **hk).train()
        _STOPPED[key] = src
    out = str(tmp_path / "run")
    shutil.copytree(_STOPPED[key], out)
    return out, os.path.join(out, "checkpoint-3")


def test_stock_checkpoint_starts_humanline_with_a_warning(tiny_path, tmp_path):
    out, ckpt = _stopped(tiny_path, tmp_path, humanline=False)
    assert not os.path.exists(os.path.join(ckpt, "humanline_state.json"))
    tr = _trainer(tiny_path, "dpo", out, 6, 3, (), sync_every=2)
    with pytest.warns(UserWarning, match="Resuming a stock run with humanline"):
        tr.train(resume_from_checkpoint=ckpt)
    assert tr.hk_sync.num_syncs == 1  # step 4 only: the counter starts at the resumed step


def test_humanline_checkpoint_without_its_state_is_refused(tiny_path, tmp_path):
    """A checkpoint of a humanline run that has no humanline state (an older version of this package, or the file
    lost) is refused: its reference cannot be rebuilt. Here one written before the run marker existed (none in its
    trainer_state.json): its log history tells (tests/integrations/trl/test_resume_integrity.py: the marker, with no
    log line)."""
    import json

    from humanline_kernels.integrations.transformers import RUN_MARKER
    out, ckpt = _stopped(tiny_path, tmp_path, sync_every=2)
    os.remove(os.path.join(ckpt, "humanline_state.json"))
    state = json.load(open(os.path.join(ckpt, "trainer_state.json")))
    del state["stateful_callbacks"][RUN_MARKER]
    json.dump(state, open(os.path.join(ckpt, "trainer_state.json"), "w"))
    tr = _trainer(tiny_path, "dpo", out, 6, 3, (), sync_every=2)
    with pytest.raises(ValueError, match="humanline_state.json is missing.*log history shows a humanline run"):
        tr.train(resume_from_checkpoint=ckpt)


def test_changed_sync_every_warns(tiny_path, tmp_path):
    out, ckpt = _stopped(tiny_path, tmp_path, sync_every=2)
    tr = _trainer(tiny_path, "dpo", out, 6, 3, (), sync_every=3)
    with pytest.warns(UserWarning, match="saved with every=2.*keeping every=3"):
        tr.train(resume_from_checkpoint=ckpt)


@pytest.mark.parametrize("saved,resumed", [("sync", "lookahead"), ("lookahead", "sync")])
def test_other_reference_mode_is_refused(tiny_path, tmp_path, saved, resumed):
    out, ckpt = _stopped(tiny_path, tmp_path, sync_every=2, humanline_reference=saved)
    tr = _trainer(tiny_path, "dpo", out, 6, 3, (), sync_every=2, humanline_reference=resumed)
    with pytest.raises(ValueError, match=f"holds no .*humanline_reference='{saved}'"):
        tr.train(resume_from_checkpoint=ckpt)


def _corrupt_missing(path):
    os.remove(path)


def _corrupt_truncate(path):
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-7])


def _corrupt_header(path):
    data = bytearray(open(path, "rb").read())
    data[8:16] = b"\xff" * 8  # inside the JSON header
    open(path, "wb").write(bytes(data))


def _corrupt_shape(path):
    from safetensors.torch import load_file, save_file
    t = load_file(path)
    k = sorted(t)[0]
    t[k] = torch.cat([t[k].flatten(), t[k].flatten()[:1]])
    save_file(t, path, metadata={"format": "humanline-kernels/1", "fingerprint": "[]"})


def _corrupt_dtype(path):
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(path, "pt") as f:
        meta = f.metadata()
        t = {k: f.get_tensor(k) for k in f.keys()}
    k = sorted(t)[0]
    t[k] = t[k].to(torch.bfloat16)
    save_file(t, path, metadata=meta)


@pytest.mark.parametrize("corrupt", [_corrupt_missing, _corrupt_truncate, _corrupt_header, _corrupt_shape,
                                     _corrupt_dtype], ids=lambda f: f.__name__[9:])
def test_damaged_reference_file_is_refused_before_any_step(tiny_path, tmp_path, corrupt):
    out, ckpt = _stopped(tiny_path, tmp_path, sync_every=2)
    file = os.path.join(ckpt, "humanline_reference.safetensors")
    corrupt(file)
    tr = _trainer(tiny_path, "dpo", out, 6, 3, (), sync_every=2)
    before = _params(tr.ref_model)
    steps = []

    class Count(TrainerCallback):
        def on_step_begin(self, *a, **k):
            steps.append(1)
    tr.add_callback(Count())
    with pytest.raises(ValueError, match="humanline_reference.safetensors"):
        tr.train(resume_from_checkpoint=ckpt)
    assert not steps  # refused before any training step
    for n, p in _params(tr.ref_model).items():
        assert torch.equal(p, before[n]), n  # and the reference untouched


def test_state_of_another_checkpoint_is_refused(tiny_path, tmp_path):
    """The humanline files of checkpoint-3 copied into checkpoint-6: the policy they were saved with is not the
    resumed one."""
    out = str(tmp_path / "run")
    _trainer(tiny_path, "dpo", out, 6, 3, (), sync_every=2).train()
    for name in ("humanline_reference.safetensors", "humanline_state.json"):
        src, dst = os.path.join(out, "checkpoint-3", name), os.path.join(out, "checkpoint-6", name)
        open(dst, "wb").write(open(src, "rb").read())
    import json
    meta = json.load(open(os.path.join(out, "checkpoint-6", "humanline_state.json")))
    meta["extra"]["global_step"] = 6
    json.dump(meta, open(os.path.join(out, "checkpoint-6", "humanline_state.json"), "w"))
    tr = _trainer(tiny_path, "dpo", out, 8, 3, (), sync_every=2)
    with pytest.raises(ValueError, match="saved with another policy"):
        tr.train(resume_from_checkpoint=os.path.join(out, "checkpoint-6"))


def test_killed_while_saving_leaves_the_previous_checkpoint(tiny_path, tmp_path, monkeypatch):
    """A failure while the humanline state of checkpoint-6 is written (here: after the reference's file, before
    humanline_state.json): nothing of checkpoint-6 looks complete (no trainer_state.json either: the humanline
    state is written first), and checkpoint-3 resumes exactly."""
    from humanline_kernels.sync import _state
    out = str(tmp_path / "run")
    real = _state._dump_json

    def dies(path, obj):
        if "checkpoint-6" in path:
            raise KeyboardInterrupt("killed")
        return real(path, obj)
    monkeypatch.setattr(_state, "_dump_json", dies)
    with pytest.raises(KeyboardInterrupt):
        _trainer(tiny_path, "dpo", out, 8, 3, (), sync_every=2).train()
    names = os.listdir(os.path.join(out, "checkpoint-6"))
    assert "humanline_state.json" not in names and "trainer_state.json" not in names
    assert not [n for n in names if ".tmp-" in n]  # the temporary file was removed
    monkeypatch.setattr(_state, "_dump_json", real)
    full = _trainer(tiny_path, "dpo", str(tmp_path / "full"), 8, 3, (), sync_every=2)
    full.train()
    resumed = _trainer(tiny_path, "dpo", out, 8, 3, (), sync_every=2)
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-3"))
    _assert_same_run(full, resumed, 3)

