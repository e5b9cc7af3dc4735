"""The humanline state of a checkpoint: what a stopped run needs to resume exactly as if it had never stopped.

A humanline run carries state that the policy, the optimizer and the data position do not hold:

* the reference as of the last sync, θ_s (``ReferenceSyncer``): the policy has moved on since, so it cannot be
  rebuilt from the policy's checkpoint, nor from the initial model once a sync has happened;
* the lookahead's pending reference log-probs (``LookaheadReference``, GRPO's buffer lookahead): computed by a
  policy that no longer exists;
* the schedule (the syncer's step, ``every``) and whatever counters the caller logs (``extra``).

``save_humanline_state(directory, syncer=..., lookahead=...)`` writes them beside a checkpoint and
``load_humanline_state`` restores them, validated before anything is changed. Files (all under ``directory``):

* ``humanline_state.json``: the schedule, what was saved and how (written last, by rank 0: a checkpoint without
  it has no humanline state; one with it has every file it names);
* ``humanline_reference.safetensors``: the reference's rank-local storage as the syncer copies it (parameters or
  the reference adapter's, and buffers) when every rank holds the same (plain, DDP, ZeRO-1/2), written by rank 0;
  ``humanline_reference-rank00001-of-00002.safetensors`` per rank when they are shards (FSDP1, FSDP2, ZeRO-3
  partitions): no rank gathers the model, and a resume needs the same world size and wrapping (as the syncer
  itself needs both models wrapped alike);
* ``humanline_lookahead-rank…-of-….safetensors``: the lookahead's state per rank (each rank has its own data).

Every file is written under a temporary name and renamed (``os.replace``), so a process killed while writing
leaves no file that looks complete; a checkpoint folder whose ``humanline_state.json`` is missing or names a file
that is missing, truncated, corrupted or of another shape or dtype is refused with a ``ValueError`` naming the
file, before the reference is touched. Each file also records a fingerprint of the policy it was saved with
(float64 sums of a strided sample of each rank-local tensor), checked against the resumed policy: humanline state
from another checkpoint is refused too.
"""
from __future__ import annotations

import json
import os
import warnings

import torch

__all__ = ["save_humanline_state", "load_humanline_state", "read_humanline_state", "MissingHumanlineState",
           "STATE_FILE", "has_humanline_state"]

STATE_FILE = "humanline_state.json"
FORMAT = "humanline-kernels/1"
_REF_STEM, _LA_STEM = "humanline_reference", "humanline_lookahead"


class MissingHumanlineState(ValueError):
    """The folder has no ``humanline_state.json``: a stock checkpoint, one from an older version of this package,
    or one written with humanline off."""


def has_humanline_state(directory) -> bool:
    return os.path.isfile(os.path.join(directory, STATE_FILE))


# ---------------------------------------------------------------------------------------------------- save
def save_humanline_state(directory, *, syncer=None, lookahead=None, save_reference: bool = True,
                         extra: dict | None = None) -> None:
    """Write the humanline state of ``syncer`` and/or ``lookahead`` into ``directory`` (created if missing).

    Call it on every rank (under ``torch.distributed``: it synchronises the ranks), between steps (after
    ``wait()``/``optimizer.step()``), at the same point where the policy, optimizer and data position are saved.
    ``save_reference=False`` saves the schedule only: a resume then starts the reference from the resumed policy,
    with a warning (smaller checkpoints, inexact resume). ``extra``: JSON-serialisable counters of the caller,
    returned by :func:`load_humanline_state`.
    """
    _check_objects(syncer, lookahead)
    if not isinstance(save_reference, bool):
        raise ValueError(f"save_reference must be a bool, got {save_reference!r}")
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"extra must be a dict or None, got {type(extra).__name__}")
    rank, world = _dist()
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    meta = {"format": FORMAT, "world_size": world, "extra": extra or {}}
    if syncer is not None:
        schedule = syncer.state_dict()  # (refuses between start() and wait(): a half-synced step is not a state)
        pairs = syncer._persistent_pairs()
        ref = {"kind": "adapter" if _is_adapter_syncer(syncer) else "model", "backend": pairs.backend,
               "sharded": pairs.sharded, "saved": save_reference, "tensors": len(pairs.entries)}
        if save_reference:
            name = _ref_file(pairs.sharded, rank, world)
            if pairs.sharded or rank == 0:
                tensors = {n: _host(d) for n, d, _ in pairs.entries}
                _write_tensors(os.path.join(directory, name), tensors, _fingerprint([s for _, _, s in pairs.entries]))
            ref["files"] = [_ref_file(pairs.sharded, r, world) for r in range(world if pairs.sharded else 1)]
        meta["syncer"] = dict(schedule, reference=ref)
    if lookahead is not None:
        tensors = {}
        skeleton = _flatten(lookahead.state_dict(), tensors)
        _write_tensors(os.path.join(directory, _la_file(rank, world)), tensors,
                       _fingerprint(_policy_tensors(lookahead)), skeleton=skeleton)
        meta["lookahead"] = {"kind": type(lookahead).__name__, "every": lookahead.every,
                             "files": [_la_file(r, world) for r in range(world)]}
    _barrier(world)  # every rank's files are in place before the state file says they are
    if rank == 0:
        _atomic(os.path.join(directory, STATE_FILE), lambda tmp: _dump_json(tmp, meta))
    _barrier(world)


# ---------------------------------------------------------------------------------------------------- load
def load_humanline_state(directory, *, syncer=None, lookahead=None, check_policy: bool = True) -> dict:
    """Restore what :func:`save_humanline_state` wrote into ``syncer`` (the reference's weights, then the
    schedule) and/or ``lookahead`` (before its first batch is taken); returns the saved ``extra``.

    Call it on every rank, after the policy itself has been restored and both models wrapped as when saving.
    Everything is read and checked first (on every rank; a failure on one rank fails all of them); only then is
    the reference written. Errors are ``ValueError`` naming the file (:class:`MissingHumanlineState` when the
    folder has no humanline state at all). ``check_policy=False`` skips the fingerprint check (a policy resumed
    in another dtype, for example)."""
    return read_humanline_state(directory, syncer=syncer, lookahead=lookahead, check_policy=check_policy).apply()


def read_humanline_state(directory, *, syncer=None, lookahead=None, check_policy: bool = True):
    """The validated state of ``directory`` for these objects, not applied yet (``.apply()`` restores it and
    returns ``extra``; ``.meta`` is the parsed ``humanline_state.json``)."""
    _check_objects(syncer, lookahead)
    directory = os.fspath(directory)
    rank, world = _dist()
    error, loaded = None, None
    try:
        loaded = _read(directory, syncer, lookahead, check_policy, rank, world)
    except ValueError as e:
        error = e
    failed = _any_rank(error is not None, world)
    if error is not None:
        raise error
    if failed:
        raise ValueError(f"{directory}: the humanline state could not be loaded on another rank (see its error)")
    return loaded


class _Loaded:
    def __init__(self, meta, syncer, lookahead, ref_tensors, la_state):
        self.meta, self.syncer, self.lookahead = meta, syncer, lookahead
        self._ref, self._la = ref_tensors, la_state

    @property
    def extra(self) -> dict:
        return dict(self.meta.get("extra") or {})

    def apply(self) -> dict:
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
        if self.lookahead is not None:
            self.lookahead.load_state_dict(self._la)
        return self.extra


def _read(directory, syncer, lookahead, check_policy, rank, world):
    path = os.path.join(directory, STATE_FILE)
    if not os.path.isfile(path):
        raise MissingHumanlineState(f"{path} is missing: the checkpoint holds no humanline state (written by a stock "
                                    "run, with humanline off, by humanline-kernels before 0.2, or torn while saving)")
    try:
        with open(path) as f:
            meta = json.load(f)
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format') if isinstance(meta, dict) else None!r}, expected {FORMAT!r}")
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a humanline state file ({e})") from None
    ref_tensors = la_state = None
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
            file = os.path.join(directory, _ref_file(pairs.sharded, rank, world))
            tensors, fp = _read_tensors(file)
            expected = {n: d for n, d, _ in pairs.entries}
            _check_tensors(file, tensors, expected)
            if check_policy:
                _check_fingerprint(file, fp, [src for _, _, src in pairs.entries])
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
        file = os.path.join(directory, _la_file(rank, world))
        tensors, fp, skeleton = _read_tensors(file, skeleton=True)
        if check_policy:
            _check_fingerprint(file, fp, _policy_tensors(lookahead))
        la_state = _unflatten(skeleton, tensors, file)
    return _Loaded(meta, syncer, lookahead, ref_tensors, la_state)


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


def _atomic(path, write):
    """``write(tmp)`` then rename onto ``path``: a reader sees the old file or the whole new one, never a part."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _dump_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def _write_tensors(path, tensors, fingerprint, skeleton=None):
    from safetensors.torch import save_file
    meta = {"format": FORMAT, "fingerprint": json.dumps(fingerprint)}
    if skeleton is not None:
        meta["skeleton"] = json.dumps(skeleton)
    _atomic(path, lambda tmp: save_file(tensors, tmp, metadata=meta))


def _read_tensors(path, skeleton=False):
    from safetensors import safe_open
    if not os.path.isfile(path):
        raise ValueError(f"{path} is missing: the checkpoint's humanline state is incomplete")
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        fp = json.loads(meta["fingerprint"])
        sk = json.loads(meta["skeleton"]) if skeleton else None
    except Exception as e:  # safetensors' own errors (a bad header, a truncated file) are not ValueErrors
        raise ValueError(f"{path}: unreadable humanline state ({type(e).__name__}: {e})") from None
    return (tensors, fp, sk) if skeleton else (tensors, fp)


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
    from ._adapters import AdapterSyncer
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
def _flatten(obj, tensors):
    """A JSON skeleton of a nested state (dicts, lists, tuples, scalars), its tensors moved into ``tensors``."""
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = _host(obj)
        return {"__tensor__": key}
    if isinstance(obj, dict):  # keys kept with their type (int micro-step indices)
        return {"__dict__": [[k, _flatten(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"__list__" if isinstance(obj, list) else "__tuple__": [_flatten(v, tensors) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot save a {type(obj).__name__} in the humanline state")


def _unflatten(sk, tensors, path):
    if isinstance(sk, dict):
        if "__tensor__" in sk:
            if sk["__tensor__"] not in tensors:
                raise ValueError(f"{path}: tensor {sk['__tensor__']!r} is missing")
            return tensors[sk["__tensor__"]]
        if "__dict__" in sk:
            return {k: _unflatten(v, tensors, path) for k, v in sk["__dict__"]}
        if "__list__" in sk:
            return [_unflatten(v, tensors, path) for v in sk["__list__"]]
        if "__tuple__" in sk:
            return tuple(_unflatten(v, tensors, path) for v in sk["__tuple__"])
        raise ValueError(f"{path}: malformed state skeleton")
    return sk


# ---------------------------------------------------------------------------------------------------- ranks
def _dist():
    d = torch.distributed
    if d.is_available() and d.is_initialized():
        return d.get_rank(), d.get_world_size()
    return 0, 1


def _barrier(world):
    if world > 1:
        torch.distributed.barrier()


def _any_rank(flag: bool, world: int) -> bool:
    if world == 1:
        return flag
    d = torch.distributed
    dev = torch.device("cuda", torch.cuda.current_device()) if d.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([int(flag)], device=dev)
    d.all_reduce(t, op=d.ReduceOp.MAX)
    return bool(t.item())

