"""Humanline syncing for PEFT adapters: the reference is a second, frozen adapter on the same base model.

After the first step the humanline reference must be the policy before the update: base *plus* adapter. PEFT's
usual LoRA reference (the base model with adapters disabled) is therefore wrong for humanline. The cheap exact
way: a frozen ``reference`` adapter beside the trained one; reference forwards run with it active
(:func:`reference_adapter`), and a sync copies the trained adapter's weights into it (megabytes, not a model)
with the same copy path as :class:`~humanline_kernels.ReferenceSyncer` (side stream on CUDA, csrc kernel): its
adapter form, ``AdapterSyncer`` (``sync/_syncer.py``), takes its pairs from here.

Supported adapter types: LoRA (DoRA included: its magnitude vectors are plain parameters too) and IA3, whose
weights are plain tensors named ``...<adapter>...``; others raise a ``ValueError`` naming the type.
"""
from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from ._backends import _local, _unwrap, reshard_fsdp2

SUPPORTED = ("LORA", "IA3")


def _peft_type(cfg) -> str:
    t = getattr(cfg, "peft_type", None)
    return str(getattr(t, "value", t))


def _renamed(name: str, src: str, dst: str):
    """``name`` with its dotted component ``src`` replaced by ``dst``, or None when it has no such component."""
    parts = name.split(".")
    if src not in parts:
        return None
    return ".".join(dst if p == src else p for p in parts)


def adapter_pairs(model: nn.Module, train: str, reference: str):
    """``[(reference param name, train param name)]`` for every parameter of the trained adapter."""
    params = dict(model.named_parameters())
    out = []
    for name in params:
        ref = _renamed(name, train, reference)
        if ref is None:
            continue
        if ref not in params:
            raise ValueError(f"the reference adapter {reference!r} has no parameter {ref!r} for {name!r}: the two "
                             "adapters must have the same configuration")
        out.append((ref, name))
    if not out:
        raise ValueError(f"adapter {train!r} has no parameters")
    return out


def check_adapter_names(train, reference, what="train and reference"):
    """Two adapter names: non-empty strings, different (``what``: how the caller calls the pair, for the message)."""
    for name, v in (("train", train), ("reference", reference)):
        if not isinstance(v, str) or not v:
            raise ValueError(f"{what}: the {name} adapter's name must be a non-empty str, got {v!r}")
    if train == reference:
        raise ValueError(f"{what}: train and reference must be different adapters, got {train!r} twice")


def ensure_reference_adapter(peft_model: nn.Module, train: str = "default", reference: str = "reference"):
    """Create adapter ``reference`` of ``peft_model`` as a copy of ``train`` when it is missing (adopt it when it
    exists with the same configuration), and freeze it. Returns the unwrapped PEFT model. Call it before wrapping
    the model with DDP / FSDP, so that the reference adapter is wrapped like the trained one."""
    check_adapter_names(train, reference)
    peft_model = _unwrap(peft_model)  # DDP / torch.compile wrappers; FSDP2 shards in place (DTensors)
    configs = getattr(peft_model, "peft_config", None)
    if not isinstance(configs, dict) or not hasattr(peft_model, "add_adapter"):
        raise ValueError(f"for_adapters needs a PEFT model (peft.PeftModel), got {type(peft_model).__name__}")
    if train not in configs:
        raise ValueError(f"adapter {train!r} not found; the model has {sorted(configs)}")
    kind = _peft_type(configs[train])
    if kind not in SUPPORTED:
        raise ValueError(f"adapter {train!r} is of type {kind}; humanline adapter syncing supports "
                         f"{', '.join(SUPPORTED)} (LoRA includes DoRA)")
    created = reference not in configs
    if created:
        active = peft_model.active_adapter
        peft_model.add_adapter(reference, copy.deepcopy(configs[train]))
        if peft_model.active_adapter != active:  # PEFT does not activate it; keep it that way regardless
            peft_model.set_adapter(active)
    params = dict(peft_model.named_parameters())
    for ref, src in adapter_pairs(peft_model, train, reference):
        if params[ref].shape != params[src].shape:
            raise ValueError(f"adapter {reference!r} exists with another configuration than {train!r} ({ref} "
                             f"has shape {tuple(params[ref].shape)}, {src} {tuple(params[src].shape)}); "
                             "choose another reference name or remove it")
        params[ref].requires_grad_(False)  # frozen: never in an optimizer built from trainable parameters
        if created:  # the reference starts as the trained adapter (the initial policy)
            with torch.no_grad():
                local_data(params[ref]).copy_(local_data(params[src]))
    return peft_model


def local_data(p):
    """The rank-local data of a parameter: a replica (plain, DDP) or the local shard of an FSDP2 DTensor (both
    adapters live in the same modules, so they are sharded alike)."""
    return _local(p.data)


@contextlib.contextmanager
def reference_adapter(peft_model: nn.Module, name: str = "reference", eval_mode: bool = True):
    """Run the enclosed forward with adapter ``name`` active (and, with ``eval_mode``, the model in eval mode, as a
    reference model is kept: no dropout). The previously active adapter, every submodule's train/eval mode and
    every parameter's ``requires_grad`` are restored afterwards, also when the forward raises (PEFT's
    ``set_adapter`` changes which adapter is trainable)."""
    if not isinstance(eval_mode, bool):
        raise ValueError(f"eval_mode must be a bool, got {eval_mode!r}")
    peft_model = _unwrap(peft_model)
    if name not in getattr(peft_model, "peft_config", {}):
        raise ValueError(f"adapter {name!r} not found; create it with hk.ReferenceSyncer.for_adapters(...)")
    previous = peft_model.active_adapter
    flags = [(p, p.requires_grad) for p in peft_model.parameters()]
    modes = [(m, m.training) for m in peft_model.modules()]
    peft_model.set_adapter(name)
    if eval_mode:
        peft_model.eval()
    try:
        yield peft_model
    finally:
        peft_model.set_adapter(previous)
        for p, flag in flags:
            p.requires_grad_(flag)
        for m, training in modes:
            m.training = training
        reshard_fsdp2(peft_model)  # the reference forward had no backward: see reshard_fsdp2
