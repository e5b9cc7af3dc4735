"""Humanline syncing between PEFT adapters (``hk.ReferenceSyncer.for_adapters`` + ``hk.reference_adapter``): step
by step the same reference log-probs, losses and gradients as a full reference model synced by
``hk.ReferenceSyncer``, for LoRA, DoRA and IA3; no second base model in memory; clear errors otherwise."""
import copy
import gc
import importlib.util
import os

import pytest
import torch
from torch import nn

import humanline_kernels as hk

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")
_spec = importlib.util.spec_from_file_location(
    "hk_tiny_adapters", os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tiny.py"))
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)

CONFIGS = {
    "lora": lambda: peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    "dora": lambda: peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                    use_dora=True),
    "ia3": lambda: peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
}


def _model(kind):
    model = peft.get_peft_model(tiny.tiny_model(seed=0), CONFIGS[kind]())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a non-trivial starting adapter (LoRA's B starts at 0)
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _batches(steps, seed=2):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(3, 64, (4, 9), generator=g)
        labels = ids[:, 1:].clone()
        labels[:, :3] = -100
        out.append((ids, labels))
    return out


def _logps(model, ids, labels):
    logits = model(input_ids=ids).logits[:, :-1]
    return hk.reference.token_logprobs(logits.float(), labels)


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def _run(model, ref_logps_fn, syncer, data):
    opt = torch.optim.AdamW(_trainable(model), lr=5e-2)
    out = []
    for ids, labels in data:
        ref = ref_logps_fn(ids, labels)
        syncer.start()
        model.train()
        loss, _ = hk.losses.dpo(_logps(model, ids, labels), ref, labels != -100, beta=0.5)
        loss.backward()
        grads = [p.grad.clone() for p in _trainable(model)]
        syncer.wait()
        opt.step()
        opt.zero_grad()
        out.append((ref, loss.detach(), grads))
    return out


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("every", [1, 2])
def test_adapter_reference_equals_a_synced_full_reference_model(kind, every):
    data = _batches(5)
    base = _model(kind)
    full_pol = copy.deepcopy(base)
    full_ref = copy.deepcopy(base).eval().requires_grad_(False)

    def full_ref_fn(ids, labels):
        with torch.no_grad():
            return _logps(full_ref, ids, labels)
    full = _run(full_pol, full_ref_fn, hk.ReferenceSyncer(full_pol, full_ref, every=every, overlap=False), data)

    pol = copy.deepcopy(base)
    syncer = hk.ReferenceSyncer.for_adapters(pol, every=every, overlap=False)
    assert sorted(pol.peft_config) == ["default", "reference"] and pol.active_adapter == "default"

    def adapter_ref_fn(ids, labels):
        with torch.no_grad(), hk.reference_adapter(pol):
            return _logps(pol, ids, labels)
    ours = _run(pol, adapter_ref_fn, syncer, data)
    assert len(ours) == len(full)
    for t, ((ra, la, ga), (rb, lb, gb)) in enumerate(zip(ours, full)):
        torch.testing.assert_close(ra, rb, rtol=1e-5, atol=1e-6, msg=f"step {t}: reference log-probs")
        torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-6, msg=f"step {t}: loss")
        assert len(ga) == len(gb)
        for x, y in zip(ga, gb):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6, msg=f"step {t}: gradient")
    # the reference moved with the syncs (it is not the adapter-disabled base, nor the initial adapter)
    assert not torch.allclose(ours[0][0], ours[-1][0])


def _param_bytes():
    gc.collect()
    return sum(o.numel() * o.element_size() for o in gc.get_objects() if isinstance(o, nn.Parameter))


def test_no_second_base_model_in_memory():
    model = _model("lora")
    adapter = sum(p.numel() * p.element_size() for p in _trainable(model))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    before = _param_bytes()
    hk.ReferenceSyncer.for_adapters(model)
    added = _param_bytes() - before
    assert added == adapter and added < 0.2 * total
    print(f"reference adapter: +{added} parameter bytes (a full reference model: +{total})")
    frozen = [p for n, p in model.named_parameters() if ".reference." in n]
    assert frozen and not any(p.requires_grad for p in frozen)


def test_reference_adapter_restores_state_on_exceptions():
    model = _model("lora")
    hk.ReferenceSyncer.for_adapters(model)
    model.train()
    flags = [p.requires_grad for p in model.parameters()]
    with pytest.raises(RuntimeError, match="boom"):
        with hk.reference_adapter(model):
            assert model.active_adapter == "reference" and not model.training
            raise RuntimeError("boom")
    assert model.active_adapter == "default" and model.training
    assert [p.requires_grad for p in model.parameters()] == flags


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="needs a PEFT model"):
        hk.ReferenceSyncer.for_adapters(tiny.tiny_model())
    pt = peft.get_peft_model(tiny.tiny_model(), peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    with pytest.raises(ValueError, match="PROMPT_TUNING"):
        hk.ReferenceSyncer.for_adapters(pt)
    model = _model("lora")
    with pytest.raises(ValueError, match="adapter 'nope' not found"):
        hk.ReferenceSyncer.for_adapters(model, train="nope")
    with pytest.raises(ValueError, match="must be different"):
        hk.ReferenceSyncer.for_adapters(model, reference="default")
    with pytest.raises(ValueError, match="adapter 'reference' not found"):
        with hk.reference_adapter(model):
            pass


@pytest.mark.parametrize("kw, match", [
    (dict(every=0), "every must be a positive int"), (dict(overlap="no"), "overlap must be a bool"),
    (dict(use_kernel=1), "use_kernel must be None, True or False"),
    (dict(train=["default"]), "the train adapter's name must be a non-empty str"),
    (dict(reference=""), "the reference adapter's name must be a non-empty str")])
def test_bad_options_are_refused_before_the_reference_adapter_is_added(kw, match):
    """for_adapters checked every / overlap / use_kernel only after adding the reference adapter to the model; a
    list as an adapter name was a TypeError (unhashable) that named nothing."""
    model = _model("lora")
    with pytest.raises(ValueError, match=match):
        hk.ReferenceSyncer.for_adapters(model, **kw)
    assert sorted(model.peft_config) == ["default"]
    assert not any(".reference." in n for n, _ in model.named_parameters())


def test_reference_adapter_refuses_a_non_bool_eval_mode():
    """eval_mode="no" was true through bool(): the forward ran in eval mode."""
    model = _model("lora")
    hk.ReferenceSyncer.for_adapters(model)
    with pytest.raises(ValueError, match="eval_mode must be a bool, got 'no'"):
        with hk.reference_adapter(model, eval_mode="no"):
            pass
    assert model.active_adapter == "default"


# ---- distributed (gloo, world size 2): the adapters are replicated (DDP) or sharded like their layer (FSDP2) ---
def _grads_full(model):
    return [(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone() for p in _trainable(model)]


def _dist_adapter_case(wrap, wrap_ref, every):
    import torch.distributed as dist
    data = _batches(4, seed=10 + dist.get_rank())  # each rank its own shard of the data
    base = _model("lora")  # seeded: the same on every rank

    def run(model, ref_fn, syncer):
        opt = torch.optim.AdamW(_trainable(model), lr=5e-2)
        out = []
        for ids, labels in data:
            ref = ref_fn(ids, labels)
            syncer.start()
            loss, _ = hk.losses.dpo(_logps(model, ids, labels), ref, labels != -100, beta=0.5)
            loss.backward()
            grads = _grads_full(model)
            syncer.wait()
            opt.step()
            opt.zero_grad()
            out.append((ref, loss.detach(), grads))
        return out

    full_pol, full_ref = wrap(copy.deepcopy(base)), wrap_ref(copy.deepcopy(base).eval().requires_grad_(False))

    def full_fn(ids, labels):
        with torch.no_grad():
            return _logps(full_ref, ids, labels)
    full = run(full_pol, full_fn, hk.ReferenceSyncer(full_pol, full_ref, every=every, overlap=False))
    pol = copy.deepcopy(base)
    hk.ReferenceSyncer.for_adapters(pol)  # add the reference adapter before wrapping, so it is wrapped alike
    pol = wrap(pol)
    syncer = hk.ReferenceSyncer.for_adapters(pol, every=every, overlap=False)

    def adapter_fn(ids, labels):
        with torch.no_grad(), hk.reference_adapter(pol):
            return _logps(pol, ids, labels)
    ours = run(pol, adapter_fn, syncer)
    for t, ((ra, la, ga), (rb, lb, gb)) in enumerate(zip(ours, full)):
        torch.testing.assert_close(ra, rb, rtol=1e-5, atol=1e-6, msg=f"step {t}: reference log-probs")
        torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-6, msg=f"step {t}: loss")
        for x, y in zip(ga, gb):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6, msg=f"step {t}: gradient")


def _ddp_worker(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP
    _dist_adapter_case(DDP, lambda m: m, every=1)
    _dist_adapter_case(DDP, lambda m: m, every=2)


@pytest.mark.slow
def test_ddp():
    from tools.distributed import run
    run(_ddp_worker)


def _fsdp2(model):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _fsdp2_worker(rank, world):
    _dist_adapter_case(_fsdp2, _fsdp2, every=1)
    _dist_adapter_case(_fsdp2, _fsdp2, every=2)


@pytest.mark.slow
def test_fsdp2():
    from tools.distributed import run
    run(_fsdp2_worker)


def test_name_clash_with_another_configuration_is_refused():
    model = _model("lora")
    model.add_adapter("reference", peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ValueError, match="exists with another configuration"):
        hk.ReferenceSyncer.for_adapters(model)
    ia3 = _model("ia3")
    ia3.add_adapter("reference", CONFIGS["ia3"]())
    hk.ReferenceSyncer.for_adapters(ia3)  # same type and configuration: adopted (and frozen)
    assert not any(p.requires_grad for n, p in ia3.named_parameters() if ".reference." in n)


def test_resume_keeps_the_sync_phase():
    syncer = hk.ReferenceSyncer.for_adapters(_model("lora"), every=3, overlap=False)
    syncer.load_state_dict(syncer.state_dict() | {"step": 4})
    assert [syncer.sync() for _ in range(5)] == [False, False, True, False, False]  # steps 4..8: 6 syncs
