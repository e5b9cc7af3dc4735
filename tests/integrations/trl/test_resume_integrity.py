"""A damaged or incomplete humanline checkpoint is refused by every trainer's resume (docs/integrations.md,
"Resume"): the TRL trainers (DPO, KTO, GRPO; a synced reference model, the lookahead, a LoRA reference adapter) and
``HumanlineSyncCallback`` on a plain ``Trainer``. Each run is stopped after a checkpoint written before its first
log line (save_steps < logging_steps), so its log history holds no humanline metric; then the checkpoint's
reference, adapter or lookahead file gets 64 bytes flipped mid-file, its low mantissa bytes flipped, or is truncated,
or every humanline file is deleted. Each resume is refused with a ValueError naming the file (and the tensor, for a
checksum), with no optimizer step and nothing of the humanline state restored. The same faults through
``hk.load_humanline_state``: tests/sync/test_checkpoint_integrity.py."""
import copy
import importlib.util
import json
import os
import shutil
import struct

import pytest
import torch

pytest.importorskip("trl")
from transformers import TrainerCallback, TrainingArguments  # noqa: E402

from humanline_kernels.integrations.transformers import RUN_MARKER, HumanlineSyncCallback  # noqa: E402

pytestmark = pytest.mark.slow  # trainer runs stopped and resumed

_spec = importlib.util.spec_from_file_location(
    "hk_resume_tests_integrity", os.path.join(os.path.dirname(__file__), "test_resume.py"))
R = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(R)

REF, LA = "humanline_reference.safetensors", "humanline_lookahead-rank00000-of-00001.safetensors"
NO_LOG = {"logging_steps": 50}  # no log line before the checkpoint: only the marker says it is a humanline run's

# name -> (algo, max_steps, checkpoint step s, the file a fault damages, settings); k = 1 for a synced reference,
# so the reference at checkpoint-2 is θ_1, not the initial model a fresh trainer starts from
SETUPS = {
    "dpo-sync": ("dpo", 3, 2, REF, dict(sync_every=1)),
    "dpo-lookahead": ("dpo", 3, 2, LA, dict(sync_every=2, humanline_reference="lookahead")),
    "dpo-lora": ("dpo", 3, 2, REF, dict(sync_every=1, peft=True)),
    "kto-sync": ("kto", 3, 2, REF, dict(sync_every=1)),
    "kto-lookahead": ("kto", 3, 2, LA, dict(sync_every=2, humanline_reference="lookahead")),
    "grpo-sync": ("grpo", 3, 2, REF, dict(sync_every=1)),
    "grpo-lookahead": ("grpo", 4, 2, LA, dict(sync_every=2, steps_per_generation=2, humanline_reference="lookahead")),
    "callback": (None, 3, 2, REF, {}),
}


def _lora():
    import peft
    return peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def _make(tiny_path, name, out, callbacks=()):
    algo, n, s, _, hk = SETUPS[name]
    if algo is None:
        return _callback_trainer(out, n, s, callbacks)
    hk = dict(hk)
    peft_config = _lora() if hk.pop("peft", False) else None
    return R._trainer(tiny_path, algo, out, n, s, callbacks, peft_config=peft_config, **NO_LOG, **hk)


def _callback_trainer(out, n, s, callbacks):
    policy = R.tiny.tiny_model()
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=n, learning_rate=5e-2,
                             report_to=[], save_strategy="steps", save_steps=s, use_cpu=True, disable_tqdm=True,
                             seed=0, **NO_LOG)
    cb = HumanlineSyncCallback(every=1, ref_model=ref)
    tr = R._RefTrainer(model=policy, args=args, train_dataset=R._lm_data(), callbacks=[*callbacks, cb])
    tr.ref_model, tr.cb = ref, cb
    return tr


_STOPPED = {}  # setup -> a stopped run's output folder, made once per module


@pytest.fixture
def stopped(request, tiny_path, tmp_path):
    """A fresh copy (tests damage it) of the setup's run stopped after the checkpoint of step s."""
    name = request.param
    _, _, s, _, _ = SETUPS[name]
    if name not in _STOPPED:
        src = os.path.join(os.path.dirname(tiny_path), f"stopped-{name}")
        _make(tiny_path, name, src, (R.StopAt(s),)).train()
        _STOPPED[name] = src
    out = str(tmp_path / "run")
    shutil.copytree(_STOPPED[name], out)
    return name, out, os.path.join(out, f"checkpoint-{s}")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    R.tiny.tiny_model().save_pretrained(path)
    R.tiny.tiny_tokenizer().save_pretrained(path)
    return path


def _tensors(path):
    """name -> (dtype, first byte, end) of each tensor in a safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return {k: (v["dtype"], 8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}


def _flip(path, positions, mask):
    data = bytearray(open(path, "rb").read())
    for i in positions:
        data[i] ^= mask
    open(path, "wb").write(bytes(data))


def flip_64_bytes(path):
    """64 bytes flipped mid-file (inside the tensors' bytes); returns the tensors hit."""
    layout = _tensors(path)
    lo, hi = min(a for _, a, _ in layout.values()), max(b for _, _, b in layout.values())
    mid = (lo + hi) // 2 - 32
    _flip(path, range(mid, mid + 64), 0xFF)
    return {k for k, (_, a, b) in layout.items() if a < mid + 64 and b > mid}


def flip_low_mantissa(path):
    """The lowest mantissa bit of three elements in the middle of the largest tensor; returns it."""
    name, (dtype, a, b) = max(_tensors(path).items(), key=lambda kv: kv[1][2] - kv[1][1])
    size = {"F32": 4, "BF16": 2, "F16": 2}[dtype]
    first = a + ((b - a) // size // 2) * size
    _flip(path, [first, first + size, first + 2 * size], 0x01)
    return {name}


def truncate(path):
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-7])


def delete_humanline_files(path):
    folder = os.path.dirname(path)
    for f in os.listdir(folder):
        if f.startswith("humanline"):
            os.remove(os.path.join(folder, f))


def undamaged(path):
    """The control: the resume goes on, and what the faults must leave alone changes."""
    return set()


FAULTS = [undamaged, flip_64_bytes, flip_low_mantissa, truncate, delete_humanline_files]


class _Watch(TrainerCallback):
    """Counts optimizer steps, and takes the humanline state at on_train_begin: after transformers restored its own
    files (a PEFT checkpoint holds the "ref" adapter too), before the humanline callback restores ours (it comes
    after this one)."""

    def __init__(self):
        self.updates, self.trainer, self.before = 0, None, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.before = _humanline_state(self.trainer)

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.updates += 1


def _humanline_state(tr):
    """What a resume restores: the reference model's or adapter's weights, or the lookahead's position."""
    if getattr(tr, "hk_lookahead", False):
        la = tr.hk_la  # (built before its restore in DPO / KTO; GRPO's is kept only once restored)
        if la is None:
            return [torch.tensor(True)]
        if hasattr(la, "windows"):  # GRPO's BufferLookahead: the windows computed so far
            return [torch.tensor(la.windows == 0)]
        return [torch.tensor(la.step == 0 and la._loaded_refs is None)]
    ref = getattr(tr, "ref_model", None)
    if ref is not None:
        return [p.detach().clone() for p in ref.parameters()]
    return [p.detach().clone() for n, p in tr.model.named_parameters() if ".ref." in n]


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("stopped", list(SETUPS), indirect=True)
def test_damaged_checkpoint_is_refused_by_the_resume(tiny_path, stopped, fault):
    name, out, ckpt = stopped
    file = SETUPS[name][3]
    assert not any("humanline/num_syncs" in h for h in json.load(open(os.path.join(ckpt, "trainer_state.json")))[
        "log_history"])  # the case the marker is for
    hit = fault(os.path.join(ckpt, file))
    watch = _Watch()
    tr = watch.trainer = _make(tiny_path, name, out, (watch,))
    if fault is undamaged:
        tr.train(resume_from_checkpoint=ckpt)
        assert watch.updates == SETUPS[name][1] - SETUPS[name][2]
        assert any(not torch.equal(a, b) for a, b in zip(watch.before, _humanline_state(tr)))
        return
    if fault is delete_humanline_files:
        match = "humanline_state.json is missing.*(marks a humanline run|resumes only from its own checkpoints)"
    elif fault is truncate:
        match = f"{file}: unreadable"
    else:
        match = f"{file}: tensor .* does not match its checksum"
    with pytest.raises(ValueError, match=match) as info:
        tr.train(resume_from_checkpoint=ckpt)
    assert "start over deliberately" in str(info.value)
    if hit:
        assert any(f"tensor {k!r}" in str(info.value) for k in hit), str(info.value)
    assert watch.updates == 0
    after = _humanline_state(tr)
    assert len(watch.before) == len(after) > 0
    for a, b in zip(watch.before, after):
        assert torch.equal(a, b)  # nothing restored


@pytest.mark.parametrize("stopped", ["dpo-sync"], indirect=True)
def test_every_checkpoint_is_marked_and_an_unmarked_one_resumes_as_stock(tiny_path, stopped):
    """The marker is in every checkpoint's trainer_state.json (here the first, before any log line). Without it
    and without the humanline files (a stock run's checkpoint) the resume warns and goes on, as before."""
    name, out, ckpt = stopped
    state = json.load(open(os.path.join(ckpt, "trainer_state.json")))
    assert state["stateful_callbacks"][RUN_MARKER] == {"reference": "sync"}
    delete_humanline_files(os.path.join(ckpt, REF))
    del state["stateful_callbacks"][RUN_MARKER]
    json.dump(state, open(os.path.join(ckpt, "trainer_state.json"), "w"))
    tr = _make(tiny_path, name, out)
    with pytest.warns(UserWarning, match="Resuming a stock run with humanline"):
        tr.train(resume_from_checkpoint=ckpt)
    assert tr.state.global_step == SETUPS[name][1]
    saved = json.load(open(os.path.join(out, f"checkpoint-{SETUPS[name][1]}", "trainer_state.json")))
    assert saved["stateful_callbacks"][RUN_MARKER] == {"reference": "sync"}  # a humanline run from here on
