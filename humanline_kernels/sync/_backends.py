"""Backends: find the rank-local (reference, policy) tensor pairs for each way a model can be wrapped.

* plain module, DDP, DeepSpeed ZeRO-0/1/2: every rank holds full module parameters -> parameter to parameter.
* FSDP2 (``fully_shard``): each parameter's ``DTensor`` local shard. Sharding is per parameter (dim 0, by the
  mesh size), so it does not depend on how modules were grouped. Every FSDP module of the reference is
  resharded first: groups not resharded after a no-grad forward (the root by default,
  ``reshard_after_forward=False``) would otherwise reuse their stale all-gathered copy.
* FSDP1: each unit's ``flat_param._local_shard``; both models must use the same auto-wrap policy,
  ``use_orig_params`` and strategy. Unsharded params that FSDP1 retains after a no-grad forward (root unit,
  SHARD_GRAD_OP) are freed first, or the next reference forward would reuse them.
* ZeRO-3: each parameter's local partition ``ds_tensor``, plus the full data of gathered params (persistent
  small params) when the policy holds it too; otherwise the reference's gathered copy is released.
Buffers are copied in full in every backend. Pairs are early (local shards/partitions: copied from ``start()``,
possibly on a side stream) or late (buffers, ZeRO-3 gathered data: copied in ``wait()`` on the current stream,
because the policy forward between the two may update or free/reuse that memory). Pairs are checked once (names,
shapes, placements, dtypes) and re-resolved at every sync, so a replaced ``_local_tensor``/``.data`` (``.to()``,
``load_state_dict``) is seen.
"""
from __future__ import annotations

import torch
from torch import nn


class Pairs:
    """Named (reference, policy) tensor getters, early or late, plus hooks run before each resolve.

    Early pairs (parameter shards/partitions, long-lived storage) are copied from ``start()``, possibly on a side
    stream; late pairs (buffers, ZeRO-3 gathered data) in ``wait()`` on the current stream, after the policy
    forward that may change them or free and reuse their memory. ``prepare`` runs before the early resolve,
    ``prepare_late`` before the late one.
    """

    def __init__(self, backend: str, prepare=None, prepare_late=None):
        self.backend = backend
        self.names: list[str] = []
        self.getters: list = []  # (get_dst, get_src, late)
        self.transient: set[str] = set()  # pairs that are a view of other saved storage (ZeRO-3 gathered data)
        self.sharded = backend in ("fsdp1", "fsdp2", "zero3")  # rank-local tensors differ between ranks
        self.prepare = prepare
        self.prepare_late = prepare_late
        # drops every gathered / unsharded copy of the reference, so that its next forward reads the stored
        # shards (run after they are written other than by a sync: a resume); FSDP1/2 set it to their prepare
        self.release = None

    def add(self, name, get_dst, get_src, buffer=False, late=False, transient=False):
        self.names.append(name)
        self.getters.append((get_dst, get_src, bool(buffer or late)))
        if transient:
            self.transient.add(name)

    def persistent(self):
        """``[(name, reference tensor, policy tensor)]``: the rank-local storage that holds the reference (shards,
        partitions, buffers), what a checkpoint of the humanline state saves; transient copies are left out."""
        out = []
        for name, (gd, gs, _) in zip(self.names, self.getters):
            if name not in self.transient:
                out.append((name, gd(), gs()))
        return out

    def late_names(self) -> list[str]:
        return [n for n, (_, _, late) in zip(self.names, self.getters) if late]

    def resolve(self, late: bool):
        """Current (dsts, srcs) of the early (or late) pairs; ``None`` if the structure changed."""
        hook = self.prepare_late if late else self.prepare
        if hook is not None:
            hook()
        dsts, srcs = [], []
        for gd, gs, b in self.getters:
            if b != late:
                continue
            d, s = gd(), gs()
            if d is None or s is None or d.shape != s.shape:
                return None
            dsts.append(d)
            srcs.append(s)
        return dsts, srcs


def _unwrap(m: nn.Module) -> nn.Module:
    """Strip DDP / DeepSpeedEngine / torch.compile wrappers (not FSDP: its layout is what we copy)."""
    while True:
        if isinstance(m, nn.parallel.DistributedDataParallel) or type(m).__name__ in ("DeepSpeedEngine",
                                                                                       "PipelineEngine"):
            m = m.module
        elif hasattr(m, "_orig_mod") and isinstance(m._orig_mod, nn.Module):
            m = m._orig_mod
        else:
            return m


def _local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _getter(store, name):
    return lambda: (lambda t: None if t is None else _local(t))(store.get(name))


def _fsdp1_cls():
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        return FullyShardedDataParallel
    except ImportError:
        return None


def _fsdp2_cls():
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
        return FSDPModule
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule
            return FSDPModule
        except ImportError:
            return None


def reshard_fsdp2(model: nn.Module) -> None:
    """Reshard every FSDP2 module of ``model`` (``FSDPModule.reshard`` is not recursive). FSDP2 keeps groups
    unsharded after a forward that no backward follows (the root by default); a later forward would reuse that
    all-gathered copy, stale once a sync or an optimizer step has written the shards."""
    cls = _fsdp2_cls()
    if cls is None:
        return
    for m in model.modules():
        if isinstance(m, cls):
            m.reshard()


def detect(model: nn.Module) -> str:
    outer = model
    model = _unwrap(model)
    f1, f2 = _fsdp1_cls(), _fsdp2_cls()
    if f1 is not None and any(isinstance(m, f1) for m in model.modules()):
        return "fsdp1"
    if f2 is not None and any(isinstance(m, f2) for m in model.modules()):
        return "fsdp2"
    if any(hasattr(p, "ds_tensor") for p in model.parameters()):
        return "zero3"
    if isinstance(outer, nn.parallel.DistributedDataParallel):
        return "ddp"
    if type(outer).__name__ == "DeepSpeedEngine":
        return "zero"
    return "plain"


def _mismatch(what: str) -> ValueError:
    return ValueError(f"ReferenceSyncer: policy and reference are not wrapped identically: {what}. Wrap both "
                      "models the same way (same architecture, sharding/auto-wrap policy, mesh).")


def _check_pair(name, d, s):
    if d.shape != s.shape:
        raise _mismatch(f"{name!r} has local shape {tuple(d.shape)} in the reference and {tuple(s.shape)} in "
                        "the policy")
    if d.dtype != s.dtype and not (d.dtype.is_floating_point and s.dtype.is_floating_point):
        raise _mismatch(f"{name!r} has dtype {d.dtype} in the reference and {s.dtype} in the policy")
    dp, sp = getattr(d, "placements", None), getattr(s, "placements", None)
    if dp != sp:
        raise _mismatch(f"{name!r} has placements {dp} in the reference and {sp} in the policy")
    dm, sm = getattr(d, "device_mesh", None), getattr(s, "device_mesh", None)
    if (dm is None) != (sm is None) or (dm is not None and tuple(dm.shape) != tuple(sm.shape)):
        raise _mismatch(f"{name!r} lives on different device meshes")


def _add_named(pairs: Pairs, rmod: nn.Module, pmod: nn.Module, kind: str, skip=lambda name, t: False):
    """Parameters (kind 'p') or buffers ('b') matched by qualified name, resolved through the owning module."""
    def entries(m):
        out = []
        for mname, sub in m.named_modules(remove_duplicate=False):
            store = sub._parameters if kind == "p" else sub._buffers
            for a, t in store.items():
                if t is not None:
                    out.append((f"{mname}.{a}" if mname else a, store, a, t))
        seen, uniq = set(), []
        for e in out:  # tied tensors appear once, under their first name
            if id(e[3]) not in seen:
                seen.add(id(e[3]))
                uniq.append(e)
        return [e for e in uniq if not skip(e[0], e[3])]

    re_, pe = entries(rmod), entries(pmod)
    rn, pn = [e[0] for e in re_], [e[0] for e in pe]
    if rn != pn:
        missing = sorted(set(pn) - set(rn))[:3]
        extra = sorted(set(rn) - set(pn))[:3]
        what = "parameters" if kind == "p" else "buffers"
        raise _mismatch(f"{what} differ (in policy only: {missing}, in reference only: {extra}, "
                        f"counts {len(pn)} vs {len(rn)})")
    for (name, rs, ra, rt), (_, ps, pa, pt) in zip(re_, pe):
        _check_pair(name, rt, pt)
        pairs.add(name, _getter(rs, ra), _getter(ps, pa), buffer=kind == "b")


def _collect_plain(pairs, ref, pol):
    _add_named(pairs, ref, pol, "p")
    _add_named(pairs, ref, pol, "b")


def _fsdp2_params(model, mods) -> dict:
    """Qualified name -> FSDPParam over all FSDP2 groups of ``model`` (grouping does not change the shards)."""
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    out = {}
    for m in mods:
        st = m._get_fsdp_state()
        groups = getattr(st, "_fsdp_param_groups", None)  # torch >= 2.10; a single group before
        if groups is None:
            g = st._fsdp_param_group
            groups = [g] if g is not None else []
        for g in groups:
            for fp in g.fsdp_params:
                mn = names.get(id(fp._module_info.module), "?")
                out[f"{mn}.{fp._module_info.param_name}" if mn else fp._module_info.param_name] = fp
    return out


def _collect_fsdp2(pairs, ref, pol):
    cls = _fsdp2_cls()
    rmods = [m for m in ref.modules() if isinstance(m, cls)]
    rfps = _fsdp2_params(ref, rmods)
    pfps = _fsdp2_params(pol, [m for m in pol.modules() if isinstance(m, cls)])
    if rfps.keys() != pfps.keys():
        raise _mismatch(f"FSDP2 shards different parameters (in policy only: {sorted(pfps.keys() - rfps.keys())[:3]},"
                        f" in reference only: {sorted(rfps.keys() - pfps.keys())[:3]})")
    managed = set()
    for name, rfp in rfps.items():
        pfp = pfps[name]
        if tuple(rfp._orig_size) != tuple(pfp._orig_size):
            raise _mismatch(f"{name!r} has shape {tuple(rfp._orig_size)} in the reference and "
                            f"{tuple(pfp._orig_size)} in the policy")
        _check_pair(name, rfp.sharded_param, pfp.sharded_param)
        _check_pair(name, rfp.sharded_param._local_tensor, pfp.sharded_param._local_tensor)
        managed.add(name)
        for fp in (rfp, pfp):
            managed.add(id(fp.sharded_param))
            up = getattr(fp, "_unsharded_param", None)
            if up is not None:
                managed.add(id(up))
        # the policy may be unsharded (e.g. after a no-grad generation forward): its sharded_param is still
        # the authoritative shard, so read that rather than whatever is registered on the module
        pairs.add(name, lambda fp=rfp: fp.sharded_param._local_tensor, lambda fp=pfp: fp.sharded_param._local_tensor)
    _add_named(pairs, ref, pol, "p", skip=lambda n, t: n in managed or id(t) in managed)  # ignored params
    _add_named(pairs, ref, pol, "b")

    def prepare():
        for m in rmods:  # FSDPModule.reshard is not recursive: drop every stale unsharded copy
            m.reshard()
    pairs.prepare = pairs.release = prepare


def _collect_fsdp1(pairs, ref, pol):
    from torch.distributed.fsdp._flat_param import FlatParameter
    cls = _fsdp1_cls()
    rmods, pmods = cls.fsdp_modules(ref), cls.fsdp_modules(pol)
    if len(rmods) != len(pmods):
        raise _mismatch(f"{len(pmods)} FSDP1 units in the policy, {len(rmods)} in the reference")
    managed, handles = set(), []

    def shard(fp):
        # _local_shard appears at lazy init (first forward) and aliases .data while sharded; before that the
        # sharded flat param's .data is the local shard
        return getattr(fp, "_local_shard", None) if hasattr(fp, "_local_shard") else fp.data

    for i, (rm, pm) in enumerate(zip(rmods, pmods)):
        rh, ph = rm._handle, pm._handle
        if (rh is None) != (ph is None):
            raise _mismatch(f"FSDP1 unit {i} has parameters in only one model")
        if rh is None:
            continue
        rf, pf = rh.flat_param, ph.flat_param
        name = f"flat_param[{i}]({', '.join(rf._fqns[:2])}{', ...' if len(rf._fqns) > 2 else ''})"
        if tuple(rf._fqns) != tuple(pf._fqns) or [tuple(s) for s in rf._shapes] != [tuple(s) for s in pf._shapes]:
            raise _mismatch(f"FSDP1 unit {i} flattens different parameters ({pf._fqns} vs {rf._fqns})")
        if rh.uses_sharded_strategy != ph.uses_sharded_strategy or rf.numel() != pf.numel():
            raise _mismatch(f"FSDP1 unit {i} is sharded differently")
        _check_pair(name, shard(rf), shard(pf))
        if rh.uses_sharded_strategy:
            handles.append(rh)
        for fp in (rf, pf):
            managed.add(id(fp))
            for p in list(getattr(fp, "_params", None) or []) + list(getattr(fp, "_shared_params", None) or []):
                managed.add(id(p))
        pairs.add(name, lambda fp=rf: shard(fp), lambda fp=pf: shard(fp))
    _add_named(pairs, ref, pol, "p", skip=lambda n, t: isinstance(t, FlatParameter) or id(t) in managed)
    _add_named(pairs, ref, pol, "b")

    def prepare():
        for h in handles:  # free unsharded params retained after the reference's no-grad forward
            fpp = getattr(h.flat_param, "_full_param_padded", None)
            if fpp is not None and fpp.untyped_storage().size() > 0:
                h.reshard(True)
                h.post_reshard()
    pairs.prepare = pairs.release = prepare


def _zero3_full(p) -> bool:
    """A ZeRO-3 param currently holds its gathered full data (persistent, or not yet released)."""
    return p.data.numel() == p.ds_numel and p.ds_numel > 0


def _zero3_held(p) -> bool:
    """Gathered and available (not an all-gather still in flight)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    return _zero3_full(p) and p.ds_status == ZeroParamStatus.AVAILABLE


def _collect_zero3(pairs, ref, pol):
    rp = list(ref.named_parameters())
    pp = list(pol.named_parameters())
    if [n for n, _ in rp] != [n for n, _ in pp]:
        raise _mismatch("parameter names differ")
    gathered = []
    for (name, r), (_, p) in zip(rp, pp):
        if not (hasattr(r, "ds_tensor") and hasattr(p, "ds_tensor")):
            raise _mismatch(f"{name!r} is ZeRO-3 partitioned in only one model")
        if tuple(r.ds_shape) != tuple(p.ds_shape):
            raise _mismatch(f"{name!r} has shape {tuple(r.ds_shape)} in the reference and {tuple(p.ds_shape)} "
                            "in the policy")
        _check_pair(name, r.ds_tensor, p.ds_tensor)
        pairs.add(name, lambda r=r: r.ds_tensor, lambda p=p: p.ds_tensor)
        # A gathered reference param (persistent small params after the first traced forward) is never
        # re-gathered from ds_tensor, so its full data must be copied too. Copied only while both models hold
        # it; otherwise prepare_late() releases the reference's copy and the next forward gathers the synced
        # partitions. So differing stage3_param_persistence_threshold or a not-yet-gathered policy still work.
        # Late (in wait(), current stream): the policy's gathered data of a non-persistent param held at start()
        # may be freed and its memory reused by the policy forward, so it must not be read on a side stream
        # concurrently with that forward.
        empty = r.ds_tensor.new_empty(0)
        both = lambda r=r, p=p: _zero3_full(r) and _zero3_held(p)  # noqa: E731
        pairs.add(name + "(gathered)", lambda r=r, b=both, e=empty: r.data if b() else e,
                  lambda p=p, b=both, e=empty: p.data if b() else e, late=True, transient=True)
        gathered.append((r, p))
    _add_named(pairs, ref, pol, "b")

    def prepare():
        if any(getattr(r, "ds_secondary_tensor", None) is not None for r, _ in gathered):
            # ZeRO++ hpZ gathers from the secondary partition once it exists, which this copy does not update
            raise ValueError("ReferenceSyncer: ZeRO++ hpZ (zero_hpz_partition_size > 1) is not supported "
                             "for the reference: its forward gathers a secondary partition this copy does not update")

    def prepare_late():  # in wait(): what the policy holds now decides which gathered copies are copied
        stale = [r for r, p in gathered if _zero3_held(r) and not _zero3_held(p)]
        if stale:
            stale[0].partition(param_list=stale, has_been_updated=False)  # frees .data, keeps ds_tensor
    def release():
        held = [r for r, _ in gathered if _zero3_full(r)]
        if held:
            held[0].partition(param_list=held, has_been_updated=False)
    pairs.prepare, pairs.prepare_late, pairs.release = prepare, prepare_late, release


_COLLECT = {"plain": _collect_plain, "ddp": _collect_plain, "zero": _collect_plain, "fsdp2": _collect_fsdp2,
            "fsdp1": _collect_fsdp1, "zero3": _collect_zero3}


def collect_pairs(policy: nn.Module, reference: nn.Module) -> Pairs:
    """Detect the backend (both models must agree), collect and check the pairs."""
    kp, kr = detect(policy), detect(reference)
    if kp != kr and {kp, kr} - {"plain", "ddp", "zero"}:
        raise _mismatch(f"the policy is wrapped as {kp} and the reference as {kr}")
    kind = kp if kp == kr else "plain"  # DDP / ZeRO-1/2 / plain all hold full replicas: parameter to parameter
    pairs = Pairs(kind)
    _COLLECT[kind](pairs, _unwrap(reference), _unwrap(policy))
    return pairs
