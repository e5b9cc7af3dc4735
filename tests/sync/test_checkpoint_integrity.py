"""Integrity of a humanline checkpoint through ``hk.load_humanline_state`` (docs/sync.md, "Integrity"): damaged
bytes (64 bytes flipped mid-file, the low mantissa byte of a few elements), truncation, a missing file or state
file, files from two saves and malformed metadata are refused with a ``ValueError`` naming the file (and the tensor,
for a checksum) before anything is restored, for the reference model's file, a reference adapter's and the
lookahead's. A save checks its arguments before it writes, and a failed save leaves the previous state whole.
The trainers' resume of the same faults: tests/integrations/trl/test_resume_integrity.py."""
import json
import os
import struct

import pytest
import torch
from test_resume_loop import Net, Run, data

import humanline_kernels as hk
from humanline_kernels.sync import _state
from humanline_kernels.sync._state import DamagedHumanlineState, MissingHumanlineState, read_humanline_state

STATE = "humanline_state.json"


# ------------------------------------------------------------------------------------------- the saved cases
class Reference:
    """A plain loop's reference model after 3 steps (its last sync at step 2): a fresh run's reference is the
    initial model, so a restore shows."""
    file = "humanline_reference.safetensors"

    def __init__(self, folder):
        run = Run(2)
        for x in data(3):
            run.step(x)
        self.policy = {k: v.clone() for k, v in run.pol.state_dict().items()}
        hk.save_humanline_state(folder, syncer=run.syncer, extra={"step": 3})

    def target(self):
        run = Run(2)
        run.pol.load_state_dict(self.policy)
        self.run = run
        return {"syncer": run.syncer}

    def snapshot(self):
        return [t.clone() for t in self.run.ref.state_dict().values()] + [torch.tensor(self.run.syncer.step)]


class Adapter(Reference):
    """A LoRA policy's frozen reference adapter (``ReferenceSyncer.for_adapters``): the file holds it alone."""

    def __init__(self, folder):
        pol = self._policy()
        syncer = hk.ReferenceSyncer.for_adapters(pol, train="default", reference="ref", every=2, overlap=False)
        self._train(pol)
        hk.save_humanline_state(folder, syncer=syncer, extra={"step": 3})

    @staticmethod
    def _policy():
        peft = pytest.importorskip("peft")
        cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["l1", "l2"], lora_dropout=0.0)
        return peft.get_peft_model(Net(), cfg)

    @staticmethod
    def _train(pol):  # the trained adapter moves on from its reference copy
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for n, p in pol.named_parameters():
                if ".default." in n:
                    p.add_(torch.randn(p.shape, generator=g))

    def target(self):
        pol = self._policy()
        self.syncer = hk.ReferenceSyncer.for_adapters(pol, train="default", reference="ref", every=2, overlap=False)
        self._train(pol)
        self.ref = [p for n, p in pol.named_parameters() if ".ref." in n]
        with torch.no_grad():
            for p in self.ref:
                p.zero_()  # not what was saved
        return {"syncer": self.syncer}

    def snapshot(self):
        return [p.detach().clone() for p in self.ref] + [torch.tensor(self.syncer.step)]


class Lookahead(Reference):
    """A ``LookaheadReference`` after 4 steps at every=3: its window holds the reference log-probs of step 4, 5."""
    file = "humanline_lookahead-rank00000-of-00001.safetensors"

    def __init__(self, folder):
        pol = Net()
        opt = torch.optim.AdamW(pol.parameters(), lr=0.05)
        la = hk.LookaheadReference(pol, data(8), _logps, every=3)
        for _ in range(4):
            x, ref = next(la)
            ((pol(x) - ref).square().mean() + pol(x).mean()).backward()
            la.wait()
            opt.step()
            opt.zero_grad()
        self.policy = {k: v.clone() for k, v in pol.state_dict().items()}
        hk.save_humanline_state(folder, lookahead=la, extra={"step": 4})

    def target(self):
        pol = Net()
        pol.load_state_dict(self.policy)
        self.la = hk.LookaheadReference(pol, data(8)[4:], _logps, every=3)
        return {"lookahead": self.la}

    def snapshot(self):
        return [torch.tensor([self.la.step, self.la._loaded_refs is None])]


def _logps(model, x):
    return model(x)


CASES = {"reference": Reference, "adapter": Adapter, "lookahead": Lookahead}
_SAVED = {}  # case name -> (case, folder), saved once per module


def _copy(name, tmp_path_factory, tmp_path):
    """A fresh copy of the case's saved folder (tests damage it)."""
    import shutil
    if name not in _SAVED:
        folder = tmp_path_factory.mktemp(name)
        _SAVED[name] = CASES[name](folder), folder
    c, src = _SAVED[name]
    shutil.copytree(src, tmp_path / "ckpt")
    return c, tmp_path / "ckpt"


@pytest.fixture(params=list(CASES))
def case(request, tmp_path_factory, tmp_path):
    """The case, its folder, and its tensors as the file's header has them (name -> dtype, byte range)."""
    c, folder = _copy(request.param, tmp_path_factory, tmp_path)
    return c, folder, _layout(folder / c.file)


def _layout(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    start = 8 + n
    return {k: (v["dtype"], start + v["data_offsets"][0], start + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}


def _flip(path, positions, mask):
    data = bytearray(path.read_bytes())
    for i in positions:
        data[i] ^= mask
    path.write_bytes(bytes(data))


def _refused(c, folder, match, error=ValueError):
    kwargs = c.target()
    before = c.snapshot()
    with pytest.raises(error, match=match) as info:
        hk.load_humanline_state(folder, **kwargs)
    for a, b in zip(before, c.snapshot()):
        assert torch.equal(a, b)  # nothing restored
    return str(info.value)


# ------------------------------------------------------------------------------------------- faults
def test_the_undamaged_folder_loads_and_restores(case):
    """The control: the same folder, undamaged, loads and changes what the faults below must leave alone."""
    c, folder, _ = case
    kwargs = c.target()
    before = c.snapshot()
    assert hk.load_humanline_state(folder, **kwargs)["step"] in (3, 4)
    assert any(not torch.equal(a, b) for a, b in zip(before, c.snapshot()))


def test_64_bytes_flipped_mid_file(case):
    c, folder, layout = case
    lo, hi = min(r[1] for r in layout.values()), max(r[2] for r in layout.values())
    mid = (lo + hi) // 2 - 32
    _flip(folder / c.file, range(mid, mid + 64), 0xFF)
    hit = {k for k, (_, a, b) in layout.items() if a < mid + 64 and b > mid}
    msg = _refused(c, folder, f"{c.file}: tensor .* does not match its checksum", DamagedHumanlineState)
    assert any(f"tensor {k!r}" in msg for k in hit), msg


def test_low_mantissa_bytes_flipped(case):
    """The last bit of three elements' mantissas: the values move by one ulp, every shape and dtype stays."""
    c, folder, layout = case
    name, (dtype, a, b) = max(layout.items(), key=lambda kv: kv[1][2] - kv[1][1])
    size = {"F32": 4, "BF16": 2, "F16": 2}[dtype]
    first = a + ((b - a) // size // 2) * size  # an element mid-tensor; byte 0 is the mantissa's lowest (LE)
    _flip(folder / c.file, [first, first + size, first + 2 * size], 0x01)
    _refused(c, folder, f"{c.file}: tensor {name!r}.* does not match its checksum", DamagedHumanlineState)


def test_truncated(case):
    c, folder, _ = case
    path = folder / c.file
    path.write_bytes(path.read_bytes()[:-7])
    _refused(c, folder, f"{c.file}: unreadable", DamagedHumanlineState)


def test_missing_file(case):
    c, folder, _ = case
    os.remove(folder / c.file)
    _refused(c, folder, f"{c.file} is missing", DamagedHumanlineState)


def test_missing_state_file(case):
    c, folder, _ = case
    os.remove(folder / STATE)
    _refused(c, folder, f"{STATE} is missing", MissingHumanlineState)


def test_file_of_another_save(case, tmp_path):
    """A tensor file beside the state file of another save (what a process killed between the renames leaves):
    every byte of each is intact, the save ids differ."""
    c, folder, _ = case
    other = tmp_path / "other"
    type(c)(other)  # the same run saved again: the same bytes, another save id
    os.replace(other / c.file, folder / c.file)
    _refused(c, folder, f"{c.file} belongs to another save than {STATE}", DamagedHumanlineState)


# ------------------------------------------------------------------------------------------- malformed state files
def _edit_state(folder, edit):
    meta = json.loads((folder / STATE).read_text())
    edit(meta)
    (folder / STATE).write_text(json.dumps(meta))


def _drop(*keys):
    def edit(meta):
        for k in keys[:-1]:
            meta = meta[k]
        del meta[keys[-1]]
    return edit


def _set(value, *keys):
    def edit(meta):
        for k in keys[:-1]:
            meta = meta[k]
        meta[keys[-1]] = value
    return edit


# (case, edit, key named in the error)
MALFORMED = [
    ("reference", _drop("syncer", "reference"), "syncer.reference"),
    ("reference", _drop("syncer", "step"), "syncer.step"),
    ("reference", _set("3", "syncer", "step"), "syncer.step"),
    ("reference", _set(0, "syncer", "every"), "syncer.every"),
    ("reference", _set("yes", "syncer", "reference", "saved"), "syncer.reference.saved"),
    ("reference", _drop("syncer", "reference", "kind"), "syncer.reference.kind"),
    ("reference", _drop("syncer", "reference", "sharded"), "syncer.reference.sharded"),
    ("reference", _set(["../humanline_reference.safetensors"], "syncer", "reference", "files"),
     "syncer.reference.files"),
    ("reference", _set(["humanline_reference-rank00001-of-00002.safetensors"], "syncer", "reference", "files"),
     "syncer.reference.files"),
    ("reference", _set([], "syncer"), "syncer"),
    ("reference", _drop("world_size"), "world_size"),
    ("reference", _set(None, "extra"), "extra"),
    ("reference", _drop("save_id"), "save_id"),
    ("lookahead", _drop("lookahead", "files"), "lookahead.files"),
    ("lookahead", _set(1, "lookahead", "kind"), "lookahead.kind"),
]


@pytest.mark.parametrize("which,edit,key", MALFORMED, ids=[f"{m[0]}-{m[2]}-{i}" for i, m in enumerate(MALFORMED)])
def test_malformed_state_file_names_the_key(tmp_path_factory, tmp_path, which, edit, key):
    c, folder = _copy(which, tmp_path_factory, tmp_path)
    _edit_state(folder, edit)
    _refused(c, folder, f"{STATE}: malformed humanline state: '{key}'", DamagedHumanlineState)


@pytest.mark.parametrize("text", [b"{", b"[1, 2]", b'{"format": "humanline-kernels/3"}', b"\xff\xfe{"],
                         ids=["not-json", "a-list", "a-newer-format", "not-utf8"])
def test_not_a_state_file(case, text):
    c, folder, _ = case
    (folder / STATE).write_bytes(text)
    _refused(c, folder, f"{STATE}: not a humanline state file", DamagedHumanlineState)


def _edit_file_meta(path, edit):
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(str(path), "pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(meta)
    save_file(tensors, str(path), metadata=meta)


@pytest.mark.parametrize("key,value", [("fingerprint", "[[1.0]]"), ("fingerprint", None), ("checksums", "{}"),
                                       ("checksums", "not json"), ("skeleton", '{"__dict__": [[["a"], 1]]}'),
                                       ("skeleton", '{"__what__": 1}'), ("skeleton", '{"__tensor__": "t99"}')])
def test_malformed_file_metadata(case, key, value):
    c, folder, _ = case
    if key == "skeleton" and not isinstance(c, Lookahead):
        pytest.skip("a lookahead file's key")

    def edit(meta):
        if value is None:
            del meta[key]
        else:
            meta[key] = value
    _edit_file_meta(folder / c.file, edit)
    _refused(c, folder, f"{c.file}: .*(malformed humanline state|tensor 't99' of the lookahead state is missing)",
             DamagedHumanlineState)


# ------------------------------------------------------------------------------------------- older checkpoints
def test_a_checkpoint_before_checksums_loads_with_a_warning(case):
    """humanline-kernels/1 (no checksums, no save id): restored as before, with a warning that its bytes are not
    verified (docs/sync.md says why it is not refused)."""
    c, folder, _ = case

    def v1(meta):
        meta["format"] = "humanline-kernels/1"
        meta.pop("save_id")
        meta.pop("checksums", None)
    _edit_state(folder, v1)
    _edit_file_meta(folder / c.file, v1)
    kwargs = c.target()
    before = c.snapshot()
    with pytest.warns(UserWarning, match="before its files had checksums"):
        hk.load_humanline_state(folder, **kwargs)
    assert any(not torch.equal(a, b) for a, b in zip(before, c.snapshot()))


# ------------------------------------------------------------------------------------------- saving
@pytest.mark.parametrize("extra,match", [
    ({"step": torch.tensor(3)}, r"extra\['step'\] is a Tensor \(pass .item\(\)"),
    ({"steps": (1, 2)}, r"extra\['steps'\] is a tuple"),
    ({1: 2}, "extra has the key 1"),
    ({"a": [object()]}, r"extra\['a'\]\[0\] is a object"),
], ids=["tensor", "tuple", "int-key", "object"])
def test_extra_that_json_would_not_return_is_refused_before_writing(tmp_path, extra, match):
    """A fresh folder gets nothing; a reused one keeps its previous state whole (the reference it holds is still
    the one a load restores)."""
    run = Run(2)
    for x in data(3):
        run.step(x)
    with pytest.raises(TypeError, match=match):
        hk.save_humanline_state(tmp_path / "fresh", syncer=run.syncer, extra=extra)
    assert not (tmp_path / "fresh").exists()
    run.save(tmp_path / "reused")
    saved_ref = [t.clone() for t in run.ref.state_dict().values()]
    run.step(data(4)[3])  # step 3 changes the policy, step 4 would sync
    run.step(data(5)[4])
    with pytest.raises(TypeError, match=match):
        hk.save_humanline_state(tmp_path / "reused", syncer=run.syncer, extra=extra)
    resumed = Run(2)
    resumed.load(tmp_path / "reused")  # (the policy of step 3 from ckpt.pt: the fingerprint matches)
    for a, b in zip(saved_ref, resumed.ref.state_dict().values()):
        assert torch.equal(a, b)


def test_extra_holding_itself_is_refused(tmp_path):
    run = Run(1)
    loop = {}
    loop["me"] = loop
    with pytest.raises(ValueError, match=r"extra\['me'\] contains itself"):
        hk.save_humanline_state(tmp_path, syncer=run.syncer, extra=loop)


def test_bad_arguments_name_themselves(tmp_path):
    run = Run(1)
    with pytest.raises(TypeError, match="directory must be a path"):
        hk.save_humanline_state(3, syncer=run.syncer)
    with pytest.raises(TypeError, match="directory must be a path"):
        hk.load_humanline_state(None, syncer=run.syncer)
    with pytest.raises(ValueError, match="check_policy must be a bool"):
        hk.load_humanline_state(tmp_path, syncer=run.syncer, check_policy="no")


@pytest.mark.parametrize("where", ["writing", "renaming"])
def test_a_failed_save_leaves_the_previous_state(tmp_path, monkeypatch, where):
    """An error while the second save writes its tensor file (a full disk): its temporary file is removed and the
    folder loads the first save's state. A process killed after its tensor file was renamed, before the state file
    (simulated by an interrupt there): the newer tensor file beside the older state file is refused by the save
    ids, never paired."""
    run = Run(2)
    for x in data(3):
        run.step(x)
    run.save(tmp_path)
    saved_ref = [t.clone() for t in run.ref.state_dict().values()]
    run.step(data(4)[3])
    run.step(data(5)[4])  # step 4 synced: the reference moved on
    if where == "writing":
        def full(path, tensors, file_meta):
            open(path, "wb").write(b"part")
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(_state, "_write_tensors", full)
        with pytest.raises(OSError, match="No space"):
            hk.save_humanline_state(tmp_path, syncer=run.syncer)
    else:
        def killed(path, obj):
            raise KeyboardInterrupt("killed")
        monkeypatch.setattr(_state, "_dump_json", killed)
        with pytest.raises(KeyboardInterrupt):
            hk.save_humanline_state(tmp_path, syncer=run.syncer)
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    resumed = Run(2)
    if where == "writing":
        resumed.load(tmp_path)
        for a, b in zip(saved_ref, resumed.ref.state_dict().values()):
            assert torch.equal(a, b)
    else:
        with pytest.raises(DamagedHumanlineState, match="humanline_reference.safetensors belongs to another save"):
            resumed.load(tmp_path)


def test_a_refused_lookahead_state_leaves_the_reference_untouched(tmp_path):
    """A folder with both a synced reference and a lookahead: the lookahead's state is applied first and refused
    (saved with another every), so the reference is not restored either."""
    run = Run(2)
    for x in data(3):
        run.step(x)
    la = hk.LookaheadReference(run.pol, data(2), _logps, every=2)
    hk.save_humanline_state(tmp_path, syncer=run.syncer, lookahead=la)
    fresh = Run(2)
    fresh.pol.load_state_dict(run.pol.state_dict())
    before = [t.clone() for t in fresh.ref.state_dict().values()]
    with pytest.raises(ValueError, match="humanline_lookahead-rank00000-of-00001.safetensors: .*every=2 was saved"):
        hk.load_humanline_state(tmp_path, syncer=fresh.syncer,
                                lookahead=hk.LookaheadReference(fresh.pol, data(2), _logps, every=3))
    for a, b in zip(before, fresh.ref.state_dict().values()):
        assert torch.equal(a, b)
    assert fresh.syncer.step == 0


def test_counters_are_checked_before_apply(tmp_path):
    """What the trainers read from ``extra`` (their step, their sync count) is checked by name before they
    restore anything."""
    run = Run(1)
    hk.save_humanline_state(tmp_path, syncer=run.syncer, extra={"global_step": 3, "num_syncs": "2", "last": -1})
    loaded = read_humanline_state(tmp_path, syncer=Run(1).syncer)
    assert loaded.counter("global_step") == 3
    assert loaded.counter("last", minimum=-1) == -1
    with pytest.raises(DamagedHumanlineState, match=f"{STATE}: malformed humanline state: 'extra.num_syncs' is '2'"):
        loaded.counter("num_syncs")
    with pytest.raises(DamagedHumanlineState, match="'extra.missing' is None"):
        loaded.counter("missing")


def test_grpo_buffer_lookahead_checks_its_state_before_setting_it():
    pytest.importorskip("trl")
    from humanline_kernels.integrations.trl._grpo_lookahead import BufferLookahead
    params = [torch.zeros(2, 3)]

    def fresh():
        return BufferLookahead(None, params, every=2, accum=1, steps_per_generation=2, num_iterations=1, max_steps=4)
    good = {"every": 2, "refs": {3: torch.ones(2)}, "snapshot": [2, [torch.ones(2, 3)]], "windows": 1}
    la = fresh()
    la.load_state_dict(good)
    assert la.windows == 1 and la.snapshot[0] == 2 and list(la.refs) == [3]
    for key, value, match in (("refs", {"3": torch.ones(2)}, "refs must map micro-step indices"),
                              ("refs", {3: [1.0]}, "refs must map"),
                              ("snapshot", [2, [torch.ones(3, 2)]], "do not match this policy"),
                              ("snapshot", [2], "snapshot must be None or"),
                              ("windows", -1, "windows must be an int"),
                              ("every", 3, "saved with sync_every=3")):
        la = fresh()
        with pytest.raises(ValueError, match=match):
            la.load_state_dict(dict(good, **{key: value}))
        assert la.refs == {} and la.snapshot is None and la.windows == 0
    with pytest.raises(ValueError, match="must be a dict with every, refs"):
        fresh().load_state_dict({"every": 2})
