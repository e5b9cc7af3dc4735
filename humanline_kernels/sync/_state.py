"""The humanline state of a checkpoint: what a stopped run needs to resume exactly as if it had never stopped.

A humanline run carries state that the policy, the optimizer and the data position do not hold:

* the reference as of the last sync, θ_s (``ReferenceSyncer``): the policy has moved on since, so it cannot be
  rebuilt from the policy's checkpoint, nor from the initial model once a sync has happened;
* the lookahead's pending reference log-probs (``LookaheadReference``, GRPO's buffer lookahead): computed by a
  policy that no longer exists;
* the schedule (the syncer's step, ``every``) and whatever counters the caller logs (``extra``).

``save_humanline_state(directory, syncer=..., lookahead=...)`` writes them beside a checkpoint and
``load_humanline_state`` restores them, validated before anything is changed. Files (all under ``directory``):

* ``humanline_state.json``: the schedule, what was saved and how, and the save's id (written last, by rank 0: a
  checkpoint without it has no humanline state; one with it has every file it names);
* ``humanline_reference.safetensors``: the reference's rank-local storage as the syncer copies it (parameters or
  the reference adapter's, and buffers) when every rank holds the same (plain, DDP, ZeRO-1/2), written by rank 0;
  ``humanline_reference-rank00001-of-00002.safetensors`` per rank when they are shards (FSDP1, FSDP2, ZeRO-3
  partitions): no rank gathers the model, and a resume needs the same world size and wrapping (as the syncer
  itself needs both models wrapped alike);
* ``humanline_lookahead-rank…-of-….safetensors``: the lookahead's state per rank (each rank has its own data).

Integrity. safetensors has no checksum of its own, so every tensor file records, in its metadata, a CRC-32 of each
tensor's bytes and the id of the save it belongs to (the state file holds the same id); a load checks both before
it restores anything. Everything a save needs is checked and copied to the host before the first byte is written;
then every file is written under a temporary name, the files are renamed once all are written, and the state file
comes last. A failed save leaves the folder's previous state as it was; a process killed between the renames leaves
a file of the new save beside the old state file, which the save ids tell apart. Each file also records a
fingerprint of the policy it was saved with (float64 sums of a strided sample of each rank-local tensor), checked
against the resumed policy: humanline state from another checkpoint is refused too. Every refusal is a
``ValueError`` naming the file (and the tensor, for a checksum).
"""
from __future__ import annotations

import json
import os
import warnings
import zlib

import torch

__all__ = ["save_humanline_state", "load_humanline_state", "read_humanline_state", "MissingHumanlineState",
           "DamagedHumanlineState", "STATE_FILE", "has_humanline_state"]

STATE_FILE = "humanline_state.json"
FORMAT = "humanline-kernels/2"
# before checksums and save ids: still read (with a warning), so that a run resumes across the upgrade
_FORMAT_1 = "humanline-kernels/1"
_REF_STEM, _LA_STEM = "humanline_reference", "humanline_lookahead"


class MissingHumanlineState(ValueError):
    """The folder has no ``humanline_state.json``: a stock checkpoint, one from an older version of this package,
    or one written with humanline off."""


class DamagedHumanlineState(ValueError):
    """The folder's humanline state is there but not whole: a file it names is missing, unreadable, altered since
    it was written (a checksum differs) or from another save, or a file's contents are malformed."""


def has_humanline_state(directory) -> bool:
    return os.path.isfile(os.path.join(directory, STATE_FILE))


# ---------------------------------------------------------------------------------------------------- save
def save_humanline_state(directory, *, syncer=None, lookahead=None, save_reference: bool = True,
                         extra: dict | None = None) -> None:
    """Write the humanline state of ``syncer`` and/or ``lookahead`` into ``directory`` (created if missing).

    Call it on every rank (under ``torch.distributed``: it synchronises the ranks), between steps (after
    ``wait()``/``optimizer.step()``), at the same point where the policy, optimizer and data position are saved.
    ``save_reference=False`` saves the schedule only: a resume then starts the reference from the resumed policy,
    with a warning (smaller checkpoints, inexact resume). ``extra``: JSON-serialisable counters of the caller (a
    dict with str keys, lists, str, int, float, bool, None), returned by :func:`load_humanline_state`.

    Everything is checked first (bad arguments are ``ValueError``/``TypeError`` naming them, raised before anything
    is written); a save that fails leaves the folder's previous humanline state whole.
    """
    rank, world = _dist()
    directory, meta, files = _on_every_rank(
        lambda: _plan_save(directory, syncer, lookahead, save_reference, extra, rank, world), world, RuntimeError,
        "the humanline state could not be saved on another rank (see its error)")
    meta["save_id"] = _new_save_id(world)
    written = []  # (temporary, final) paths of this rank's files

    def write():
        os.makedirs(directory, exist_ok=True)
        for path, tensors, file_meta in files:
            written.append((_tmp_name(path), path))
            _write_tensors(written[-1][0], tensors, dict(file_meta, save_id=meta["save_id"]))

    def rename():
        for n, (tmp, path) in enumerate(written):
            os.replace(tmp, path)
            written[n] = (path, path)
        _fsync_dir(directory)

    def state_file():
        if rank == 0:
            _atomic(os.path.join(directory, STATE_FILE), lambda tmp: _dump_json(tmp, meta))
            _fsync_dir(directory)

    failed = "the humanline state could not be written on another rank (see its error)"
    try:
        _on_every_rank(write, world, RuntimeError, failed)  # every rank's files are written ...
        _on_every_rank(rename, world, RuntimeError, failed)  # ... before any is renamed: one save's files
        _on_every_rank(state_file, world, RuntimeError, failed)  # then the state file that names them
    finally:
        _remove([tmp for tmp, path in written if tmp != path])


def _plan_save(directory, syncer, lookahead, save_reference, extra, rank, world):
    """Everything a save writes (the state file's contents, this rank's tensors on the host with their metadata),
    every argument checked: nothing is written yet."""
    _check_objects(syncer, lookahead)
    directory = _check_directory(directory)
    if not isinstance(save_reference, bool):
        raise ValueError(f"save_reference must be a bool, got {save_reference!r}")
    meta = {"format": FORMAT, "world_size": world, "extra": _checked_extra(extra)}
    files = []
    if syncer is not None:
        schedule = syncer.state_dict()  # (refuses between start() and wait(): a half-synced step is not a state)
        pairs = syncer._persistent_pairs()
        ref = {"kind": "adapter" if _is_adapter_syncer(syncer) else "model", "backend": pairs.backend,
               "sharded": pairs.sharded, "saved": save_reference, "tensors": len(pairs.entries)}
        if save_reference:
            if pairs.sharded or rank == 0:
                tensors = {n: _host(d) for n, d, _ in pairs.entries}
                files.append((os.path.join(directory, _ref_file(pairs.sharded, rank, world)), tensors,
                              {"fingerprint": json.dumps(_fingerprint([s for _, _, s in pairs.entries]))}))
            ref["files"] = [_ref_file(pairs.sharded, r, world) for r in range(world if pairs.sharded else 1)]
        meta["syncer"] = dict(schedule, reference=ref)
    if lookahead is not None:
        tensors = {}
        skeleton = _flatten(lookahead.state_dict(), tensors)
        files.append((os.path.join(directory, _la_file(rank, world)), tensors,
                      {"fingerprint": json.dumps(_fingerprint(_policy_tensors(lookahead))),
                       "skeleton": json.dumps(skeleton)}))
        meta["lookahead"] = {"kind": type(lookahead).__name__, "every": lookahead.every,
                             "files": [_la_file(r, world) for r in range(world)]}
    return directory, meta, files


def _check_directory(directory):
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a path (str or os.PathLike), got {type(directory).__name__}")
    return os.fspath(directory)


def _checked_extra(extra):
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise ValueError(f"extra must be a dict or None, got {type(extra).__name__}")
    _check_json(extra, "extra", set())
    return extra


def _check_json(value, where, open_containers):
    """``value`` comes back from JSON as it is: otherwise a TypeError naming where in ``extra`` it is not."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, (dict, list)):
        if id(value) in open_containers:
            raise ValueError(f"{where} contains itself: extra must be JSON-serialisable")
        open_containers.add(id(value))
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            if isinstance(value, dict) and not isinstance(k, str):
                raise TypeError(f"{where} has the key {k!r} ({type(k).__name__}): extra must be JSON-serialisable "
                                "with str keys (JSON would give it back as a str)")
            _check_json(v, f"{where}[{k!r}]", open_containers)
        open_containers.discard(id(value))
        return
    hint = {torch.Tensor: " (pass .item() or .tolist())", tuple: " (JSON would give it back as a list: pass a list)"}
    raise TypeError(f"{where} is a {type(value).__name__}"
                    f"{next((h for t, h in hint.items() if isinstance(value, t)), '')}: extra must be "
                    "JSON-serialisable (dicts with str keys, lists, str, int, float, bool, None)")


# ---------------------------------------------------------------------------------------------------- load
def load_humanline_state(directory, *, syncer=None, lookahead=None, check_policy: bool = True) -> dict:
    """Restore what :func:`save_humanline_state` wrote into ``syncer`` (the reference's weights, then the
    schedule) and/or ``lookahead`` (before its first batch is taken); returns the saved ``extra``.

    Call it on every rank, after the policy itself has been restored and both models wrapped as when saving.
    Everything is read and checked first (on every rank; a failure on one rank fails all of them): the state file's
    fields, every tensor's checksum, that the files belong to one save, the tensors' names, shapes and dtypes, the
    policy's fingerprint; only then is anything restored. Errors are ``ValueError`` naming the file
    (:class:`MissingHumanlineState` when the folder has no humanline state at all, :class:`DamagedHumanlineState`
    when it is not whole). ``check_policy=False`` skips the fingerprint check (a policy resumed in another dtype,
    for example)."""
    return read_humanline_state(directory, syncer=syncer, lookahead=lookahead, check_policy=check_policy).apply()


def read_humanline_state(directory, *, syncer=None, lookahead=None, check_policy: bool = True):
    """The validated state of ``directory`` for these objects, not applied yet (``.apply()`` restores it and
    returns ``extra``; ``.meta`` is the parsed ``humanline_state.json``)."""
    rank, world = _dist()

    def read():
        _check_objects(syncer, lookahead)
        if not isinstance(check_policy, bool):
            raise ValueError(f"check_policy must be a bool, got {check_policy!r}")
        return _read(_check_directory(directory), syncer, lookahead, check_policy, rank, world)
    return _on_every_rank(read, world, ValueError,
                          f"{directory}: the humanline state could not be loaded on another rank (see its error)")


class _Loaded:
    def __init__(self, path, meta, syncer, lookahead, ref_tensors, la_state, la_file):
        self.path, self.meta, self.syncer, self.lookahead = path, meta, syncer, lookahead
        self._ref, self._la, self._la_file = ref_tensors, la_state, la_file

    @property
    def extra(self) -> dict:
        return dict(self.meta["extra"])

    def counter(self, key, minimum=0) -> int:
        """``extra[key]``, an int >= ``minimum`` as the trainers save their counters; else a ``ValueError`` naming
        the file and the key (call it before :meth:`apply`, so that a refusal restores nothing)."""
        value = self.meta["extra"].get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise DamagedHumanlineState(f"{self.path}: malformed humanline state: 'extra.{key}' is {value!r}, "
                                        f"expected an int >= {minimum}")
        return value

    def apply(self) -> dict:
        if self.lookahead is not None:
            # first: load_state_dict checks the state before it changes anything, so a refusal here leaves the
            # reference untouched too
            try:
                self.lookahead.load_state_dict(self._la)
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f"{self._la_file}: {e}") from None
        if self.syncer is not None:
            s = self.meta["syncer"]
            if self._ref is None:
                warnings.warn(
                    f"humanline resume: the checkpoint holds no reference weights (saved with save_reference=False); "
                    f"the reference restarts from the resumed policy, not θ of the last sync before step "
                    f"{s['step']}: the run is not exactly the uninterrupted one", UserWarning, stacklevel=3)
                self.syncer.copy_now()
            else:
                _restore_reference(self.syncer, self._ref)
            self.syncer.load_state_dict({"step": s["step"], "every": s["every"]})
        return self.extra


def _read(directory, syncer, lookahead, check_policy, rank, world):
    path = os.path.join(directory, STATE_FILE)
    if not os.path.isfile(path):
        raise MissingHumanlineState(f"{path} is missing: the checkpoint holds no humanline state (written by a stock "
                                    "run, with humanline off, by humanline-kernels before 0.2, or torn while saving)")
    meta = _read_meta(path)
    if meta["format"] == _FORMAT_1:
        warnings.warn(f"{path}: written by humanline-kernels before its files had checksums ({_FORMAT_1}); their "
                      "bytes are read unverified. The checkpoints this run writes from now on have them",
                      UserWarning, stacklevel=2)
    ref_tensors = la_state = la_file = None
    if syncer is not None:
        s = meta.get("syncer")
        if s is None:
            raise ValueError(f"{path}: the checkpoint holds no synced reference (it was written by a run with "
                             f"{_what(meta)}); resume it with the same humanline_reference")
        ref = s["reference"]
        kind = "adapter" if _is_adapter_syncer(syncer) else "model"
        if ref["kind"] != kind:
            raise ValueError(f"{path}: the checkpoint holds a reference {ref['kind']}, this run syncs a reference "
                             f"{kind}")
        if ref["saved"]:
            pairs = syncer._persistent_pairs()
            if ref["sharded"] != pairs.sharded or (pairs.sharded and meta["world_size"] != world):
                raise ValueError(f"{path}: the reference was saved {_layout(ref['sharded'], meta['world_size'])}; this "
                                 f"run has it {_layout(pairs.sharded, world)} (resume with the same world size and "
                                 "wrapping)")
            file = _named_file(path, meta, "syncer.reference.files", _ref_file(pairs.sharded, rank, world))
            tensors, file_meta = _read_tensors(file, meta)
            expected = {n: d for n, d, _ in pairs.entries}
            _check_tensors(file, tensors, expected)
            _check_checksums(file, tensors, file_meta)
            if check_policy:
                _check_fingerprint(file, file_meta["fingerprint"], [src for _, _, src in pairs.entries])
            ref_tensors = (pairs.pairs, [(expected[n], tensors[n]) for n in expected])
    elif meta.get("syncer") is not None and lookahead is None:
        raise ValueError(f"{path}: nothing to restore it into (pass syncer= and/or lookahead=)")
    if lookahead is not None:
        la = meta.get("lookahead")
        if la is None:
            raise ValueError(f"{path}: the checkpoint holds no lookahead state (it was written by a run with "
                             f"{_what(meta)}); resume it with the same humanline_reference")
        if la["kind"] != type(lookahead).__name__ or meta["world_size"] != world:
            raise ValueError(f"{path}: the lookahead state was saved by {la['kind']} on {meta['world_size']} ranks; "
                             f"this run has {type(lookahead).__name__} on {world}")
        la_file = _named_file(path, meta, "lookahead.files", _la_file(rank, world))
        tensors, file_meta = _read_tensors(la_file, meta, skeleton=True)
        la_state = _unflatten(file_meta["skeleton"], tensors, la_file)
        _check_checksums(la_file, tensors, file_meta)
        if check_policy:
            _check_fingerprint(la_file, file_meta["fingerprint"], _policy_tensors(lookahead))
    return _Loaded(path, meta, syncer, lookahead, ref_tensors, la_state, la_file)


def _restore_reference(syncer, loaded):
    pairs, values = loaded
    with torch.no_grad():
        # drop the reference's gathered / unsharded copies (FSDP before, ZeRO-3 after the write): its next forward
        # must gather the restored shards
        if pairs.release is not None:
            pairs.release()
        for dst, value in values:
            dst.copy_(value)
        if pairs.release is not None:
            pairs.release()


# ---------------------------------------------------------------------------------------------------- the state file
def _read_meta(path):
    """``humanline_state.json``, every field a load reads checked: a ``DamagedHumanlineState`` naming the key."""
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:  # (a UnicodeDecodeError is a ValueError)
        raise DamagedHumanlineState(f"{path}: not a humanline state file ({e})") from None
    if not isinstance(meta, dict):
        raise DamagedHumanlineState(f"{path}: not a humanline state file (a JSON {type(meta).__name__}, not an "
                                    "object)")
    if meta.get("format") not in (FORMAT, _FORMAT_1):
        raise DamagedHumanlineState(f"{path}: not a humanline state file of this version: format "
                                    f"{meta.get('format')!r}, expected {FORMAT!r} (or the older {_FORMAT_1!r})")

    def field(parent, key, ok, expected, optional=False):
        name = key.rsplit(".", 1)[-1]
        if name not in parent:
            if optional:
                return None
            raise DamagedHumanlineState(f"{path}: malformed humanline state: {key!r} is missing")
        value = parent[name]
        if not ok(value):
            raise DamagedHumanlineState(f"{path}: malformed humanline state: {key!r} is {value!r}, expected "
                                        f"{expected}")
        return value

    field(meta, "world_size", _int_at_least(1), "an int >= 1")
    field(meta, "extra", lambda v: isinstance(v, dict), "an object")
    if meta["format"] == FORMAT:
        field(meta, "save_id", lambda v: isinstance(v, str) and v != "", "a string")
    s = field(meta, "syncer", lambda v: v is None or isinstance(v, dict), "an object", optional=True)
    if s is not None:
        field(s, "syncer.step", _int_at_least(0), "an int >= 0")
        field(s, "syncer.every", _int_at_least(1), "an int >= 1")
        ref = field(s, "syncer.reference", lambda v: isinstance(v, dict), "an object")
        field(ref, "syncer.reference.kind", lambda v: v in ("model", "adapter"), "'model' or 'adapter'")
        field(ref, "syncer.reference.sharded", lambda v: isinstance(v, bool), "true or false")
        if field(ref, "syncer.reference.saved", lambda v: isinstance(v, bool), "true or false"):
            field(ref, "syncer.reference.files", _file_names, "a list of file names")
    la = field(meta, "lookahead", lambda v: v is None or isinstance(v, dict), "an object", optional=True)
    if la is not None:
        field(la, "lookahead.kind", lambda v: isinstance(v, str), "a string")
        field(la, "lookahead.files", _file_names, "a list of file names")
    return meta


def _int_at_least(minimum):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def _file_names(v):
    return isinstance(v, list) and all(isinstance(n, str) and n == os.path.basename(n) for n in v)


def _named_file(path, meta, key, name):
    """``name`` in the folder, which the state file must list under ``key``."""
    listed = meta["syncer"]["reference"]["files"] if key.startswith("syncer") else meta["lookahead"]["files"]
    if name not in listed:
        raise DamagedHumanlineState(f"{path}: malformed humanline state: {key!r} does not name {name}, the file of "
                                    f"this rank (it names {listed[:3]})")
    return os.path.join(os.path.dirname(path), name)


# ---------------------------------------------------------------------------------------------------- files
def _ref_file(sharded, rank, world):
    return f"{_REF_STEM}-rank{rank:05d}-of-{world:05d}.safetensors" if sharded else f"{_REF_STEM}.safetensors"


def _la_file(rank, world):
    return f"{_LA_STEM}-rank{rank:05d}-of-{world:05d}.safetensors"


def _layout(sharded, world):
    return f"sharded over {world} ranks" if sharded else "replicated (one copy)"


def _what(meta):
    if meta.get("lookahead") is not None:
        return "humanline_reference='lookahead'"
    return "humanline_reference='sync'" if meta.get("syncer") is not None else "no humanline reference"


def _tmp_name(path):
    return f"{path}.tmp-{os.getpid()}"


def _atomic(path, write):
    """``write(tmp)`` then rename onto ``path``: a reader sees the old file or the whole new one, never a part."""
    tmp = _tmp_name(path)
    try:
        write(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        _remove([tmp])
        raise


def _fsync(path):
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(directory):
    # the renames reach the disk in order (not possible everywhere: Windows opens no folder)
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove(paths):
    for p in paths:
        try:
            os.remove(p)
        except FileNotFoundError:
            pass


def _dump_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def _write_tensors(path, tensors, file_meta):
    """One safetensors file at ``path`` (a temporary name), with each tensor's checksum and the save's id in its
    metadata, flushed to the disk."""
    from safetensors.torch import save_file
    meta = dict(file_meta, format=FORMAT, checksums=json.dumps({n: _checksum(t) for n, t in tensors.items()}))
    save_file(tensors, path, metadata=meta)
    _fsync(path)


def _read_tensors(path, meta, skeleton=False):
    """The tensors of ``path`` and its checked metadata (the fingerprint, the checksums, the skeleton), refused
    unless it belongs to the save ``meta`` (the state file) describes."""
    from safetensors import safe_open
    if not os.path.isfile(path):
        raise DamagedHumanlineState(f"{path} is missing: the checkpoint's humanline state is incomplete (its "
                                    f"{STATE_FILE} names it)")
    try:
        with safe_open(path, framework="pt") as f:
            file_meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors' own errors (a bad header, a truncated file) are not ValueErrors
        raise DamagedHumanlineState(f"{path}: unreadable humanline state ({type(e).__name__}: {e})") from None
    if file_meta.get("format") != meta["format"] or file_meta.get("save_id") != meta.get("save_id"):
        raise DamagedHumanlineState(
            f"{path} belongs to another save than {STATE_FILE} beside it (format {file_meta.get('format')!r}, save id "
            f"{file_meta.get('save_id')!r}; the state file's: {meta['format']!r}, {meta.get('save_id')!r}): a save "
            "interrupted between renaming its files, or files mixed from two checkpoints")
    out = {}
    keys = ["fingerprint"] + (["checksums"] if meta["format"] == FORMAT else []) + (["skeleton"] if skeleton else [])
    for key in keys:
        try:
            out[key] = json.loads(file_meta[key])
        except (KeyError, ValueError):
            raise DamagedHumanlineState(f"{path}: malformed humanline state: its metadata's {key!r} is "
                                        f"{file_meta.get(key)!r:.80}") from None
    fp = out["fingerprint"]
    if not (isinstance(fp, list) and all(isinstance(x, list) and len(x) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in x) for x in fp)):
        raise DamagedHumanlineState(f"{path}: malformed humanline state: its metadata's 'fingerprint' is not a list "
                                    "of [sum, L1] pairs")
    sums = out.get("checksums")
    if sums is not None and (not isinstance(sums, dict) or sums.keys() != tensors.keys()
                             or not all(isinstance(v, str) for v in sums.values())):
        raise DamagedHumanlineState(f"{path}: malformed humanline state: its metadata's 'checksums' do not list one "
                                    "checksum per tensor of the file")
    return tensors, out


def _checksum(t):
    """CRC-32 of the tensor's bytes as the file holds them: it catches any damage of up to 32 bits in a row and any
    other with probability 1 - 2^-32, at about the speed of a memory copy (docs/sync.md, "Integrity")."""
    return f"{zlib.crc32(t.reshape(-1).view(torch.uint8).numpy()):08x}"


def _check_checksums(path, tensors, file_meta):
    sums = file_meta.get("checksums")
    if sums is None:  # the older format, warned about once per load
        return
    for name, t in tensors.items():
        got = _checksum(t)
        if got != sums[name]:
            where = _tensor_place(file_meta.get("skeleton"), name)
            raise DamagedHumanlineState(
                f"{path}: tensor {name!r}{f' ({where})' if where else ''} does not match its checksum (CRC-32 "
                f"{got}, saved {sums[name]}): the file was altered after it was written (a disk, copy or transfer "
                "error); nothing was restored")


def _check_tensors(path, tensors, expected):
    if tensors.keys() != expected.keys():
        missing = sorted(expected.keys() - tensors.keys())[:3]
        extra = sorted(tensors.keys() - expected.keys())[:3]
        raise ValueError(f"{path}: holds other tensors than this run's reference (missing {missing}, unexpected "
                         f"{extra}): another model or wrapping")
    for name, dst in expected.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(dst.shape) or t.dtype != dst.dtype:
            raise ValueError(f"{path}: {name!r} is {t.dtype} {tuple(t.shape)}, this run's reference has "
                             f"{dst.dtype} {tuple(dst.shape)}")


def _host(t):
    return t.detach().to("cpu", copy=True).contiguous()


# ---------------------------------------------------------------------------------------------------- checks
def _fingerprint(tensors, samples=4096):
    """Per rank-local policy tensor, the float64 sum and L1 norm of an evenly strided sample of at most ``samples``
    elements: which policy a state was saved with, at a cost independent of the model's size (a full float64 pass
    took 2 s for 150 M parameters on 2 CPU cores). Any optimizer step moves nearly every element, so the sample
    tells two checkpoints of a run apart; the same bits give the same numbers."""
    parts = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        flat = flat[::max(1, flat.numel() // samples)].to(torch.float64)
        parts.append(torch.stack([flat.sum(), flat.abs().sum()]))
    return torch.stack(parts).cpu().tolist() if parts else []


def _check_fingerprint(path, saved, tensors):
    # per tensor, to 1e-9 of its L1 norm: one optimizer step moves a tensor's sums by far more, while the same
    # bits summed again (another thread count) differ by far less
    now = _fingerprint(tensors)

    def same(a, b, l1):
        return abs(a - b) <= 1e-9 * max(l1, 1e-30)
    if len(saved) != len(now) or not all(same(s0, n0, s1) and same(s1, n1, s1)
                                         for (s0, s1), (n0, n1) in zip(saved, now)):
        raise ValueError(f"{path}: saved with another policy than the one resumed (the policy's tensor sums differ): "
                         "humanline state from another checkpoint, or the policy was not restored first")


def _policy_tensors(lookahead):
    params = getattr(lookahead, "params", None)  # GRPO's buffer lookahead: the trainable parameters
    if params is None:
        params = list(lookahead.policy.parameters())
    return [p._local_tensor if hasattr(p, "_local_tensor") else p for p in (q.data for q in params)]


def _is_adapter_syncer(syncer):
    from ._syncer import AdapterSyncer
    return isinstance(syncer, AdapterSyncer)


def _check_objects(syncer, lookahead):
    from ._syncer import ReferenceSyncer
    if syncer is None and lookahead is None:
        raise ValueError("pass syncer= (a ReferenceSyncer) and/or lookahead= (a LookaheadReference)")
    if syncer is not None and not isinstance(syncer, ReferenceSyncer):
        raise ValueError(f"syncer must be a hk.ReferenceSyncer, got {type(syncer).__name__}")
    if lookahead is not None and not (hasattr(lookahead, "state_dict") and hasattr(lookahead, "load_state_dict")
                                      and hasattr(lookahead, "every")):
        raise ValueError(f"lookahead must be a hk.LookaheadReference, got {type(lookahead).__name__}")


# ---------------------------------------------------------------------------------------------------- nested
_SCALARS = (bool, int, float, str)


def _flatten(obj, tensors):
    """A JSON skeleton of a nested state (dicts, lists, tuples, scalars), its tensors moved into ``tensors``."""
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = _host(obj)
        return {"__tensor__": key}
    if isinstance(obj, dict):  # keys kept with their type (int micro-step indices)
        for k in obj:
            if not (k is None or isinstance(k, _SCALARS)):
                raise TypeError(f"cannot save a dict key of type {type(k).__name__} in the humanline state")
        return {"__dict__": [[k, _flatten(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"__list__" if isinstance(obj, list) else "__tuple__": [_flatten(v, tensors) for v in obj]}
    if obj is None or isinstance(obj, _SCALARS):
        return obj
    raise TypeError(f"cannot save a {type(obj).__name__} in the humanline state")


def _unflatten(sk, tensors, path):
    if sk is None or isinstance(sk, _SCALARS):
        return sk
    (kind, value), = sk.items() if isinstance(sk, dict) and len(sk) == 1 else [(None, None)]
    if kind == "__tensor__" and isinstance(value, str):
        if value not in tensors:
            raise DamagedHumanlineState(f"{path}: tensor {value!r} of the lookahead state is missing")
        return tensors[value]
    if kind == "__dict__" and isinstance(value, list) and all(
            isinstance(kv, list) and len(kv) == 2 and (kv[0] is None or isinstance(kv[0], _SCALARS)) for kv in value):
        return {k: _unflatten(v, tensors, path) for k, v in value}
    if kind in ("__list__", "__tuple__") and isinstance(value, list):
        items = [_unflatten(v, tensors, path) for v in value]
        return items if kind == "__list__" else tuple(items)
    raise DamagedHumanlineState(f"{path}: malformed humanline state: its metadata's 'skeleton' holds {sk!r:.80}")


def _tensor_place(sk, key, at="state"):
    """Where tensor ``key`` sits in a lookahead's state (``state['window_refs'][1]``), or None."""
    if not isinstance(sk, dict) or len(sk) != 1:
        return None
    (kind, value), = sk.items()
    if kind == "__tensor__":
        return at if value == key else None
    if kind == "__dict__":
        children = [(f"{at}[{kv[0]!r}]", kv[1]) for kv in value]
    else:
        children = [(f"{at}[{i}]", v) for i, v in enumerate(value)]
    for where, child in children:
        found = _tensor_place(child, key, where)
        if found is not None:
            return found
    return None


# ---------------------------------------------------------------------------------------------------- ranks
def _dist():
    d = torch.distributed
    if d.is_available() and d.is_initialized():
        return d.get_rank(), d.get_world_size()
    return 0, 1


def _collective_device():
    d = torch.distributed
    return torch.device("cuda", torch.cuda.current_device()) if d.get_backend() == "nccl" else torch.device("cpu")


def _any_rank(flag: bool, world: int) -> bool:
    if world == 1:
        return flag
    d = torch.distributed
    t = torch.tensor([int(flag)], device=_collective_device())
    d.all_reduce(t, op=d.ReduceOp.MAX)
    return bool(t.item())


def _on_every_rank(fn, world, error_type, message):
    """``fn()`` on every rank; an exception on any rank fails every rank (none is left waiting in a collective for
    a rank that failed): the failing rank raises its own, the others ``error_type(message)``."""
    error, out = None, None
    try:
        out = fn()
    except Exception as e:
        error = e
    failed = _any_rank(error is not None, world)
    if error is not None:
        raise error
    if failed:
        raise error_type(message)
    return out


def _new_save_id(world):
    """A random id shared by the state file and every tensor file of one save (rank 0's, broadcast)."""
    value = torch.tensor([int.from_bytes(os.urandom(7), "little")], dtype=torch.int64)
    if world > 1:
        value = value.to(_collective_device())
        torch.distributed.broadcast(value, src=0)
    return f"{int(value.item()):014x}"
