"""HumanlineSyncCallback under accelerate + DDP (gloo, world size 2, CPU, spawned processes)."""
import importlib.util
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.slow  # trainers on two spawned ranks
TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "examples", "tiny.py")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, out_dir):
    os.environ.update(CUDA_VISIBLE_DEVICES="",  # CPU ranks on gloo, also on a GPU machine
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), ACCELERATE_USE_CPU="1")
    import copy

    from datasets import Dataset
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from humanline_kernels.integrations.transformers import HumanlineSyncCallback

    spec = importlib.util.spec_from_file_location("hk_tiny", TINY)
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    policy = tiny.tiny_model()
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    torch.manual_seed(rank)  # different data per rank: DDP must all-reduce the gradients
    ds = Dataset.from_list([{"input_ids": torch.randint(2, 40, (8,)).tolist()} for _ in range(16)])

    class RefTrainer(Trainer):  # a loss that uses the reference, like DPO/KTO/GRPO trainers do
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            ids = inputs["input_ids"]
            with torch.no_grad():
                ref_logits = ref(input_ids=ids).logits
            logits = model(input_ids=ids).logits
            return torch.nn.functional.kl_div(logits.log_softmax(-1), ref_logits.log_softmax(-1), log_target=True,
                                              reduction="batchmean") + model(input_ids=ids, labels=ids).loss

    class Snap(TrainerCallback):
        def __init__(self):
            self.policy, self.ref, self.wrapped = [], [], None

        def on_step_begin(self, args, state, control, model=None, **kw):
            self.policy.append([p.detach().clone() for p in model.parameters()])
            self.ref.append([p.detach().clone() for p in ref.parameters()])

    snap = Snap()
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=4, learning_rate=5e-2, report_to=[], save_strategy="no", use_cpu=True,
                             logging_steps=1, disable_tqdm=True, ddp_backend="gloo")
    cb = HumanlineSyncCallback(every=2, ref_model=ref)
    trainer = RefTrainer(model=policy, args=args, train_dataset=ds, callbacks=[cb, snap])
    trainer.train()
    torch.save({"policy": snap.policy, "ref": snap.ref, "num_syncs": cb.num_syncs,
                "wrapped": type(trainer.model_wrapped).__name__, "world": trainer.accelerator.num_processes},
               os.path.join(out_dir, f"rank{rank}.pt"))


def test_callback_ddp_gloo_world2(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    for r in (r0, r1):
        assert r["wrapped"] == "DistributedDataParallel" and r["world"] == 2
        assert r["num_syncs"] == 2  # steps 0 and 2 of 4 (every=2), once per step despite accumulation
        pol, ref = r["policy"], r["ref"]
        for t in range(1, 4):
            assert any(not torch.equal(a, b) for a, b in zip(pol[t], pol[t - 1]))
            s = ((t - 1) // 2) * 2  # the last sync step before t
            for a, b in zip(ref[t], pol[s]):
                assert torch.equal(a, b)
    for a, b in zip(r0["ref"][-1], r1["ref"][-1]):  # ranks stay identical
        assert torch.equal(a, b)


def _trainer_worker(rank, world, port, out_dir):
    """HumanlineKTOTrainer (KL baseline all-reduced inside the loss) and HumanlineDPOTrainer under DDP."""
    os.environ.update(CUDA_VISIBLE_DEVICES="",  # CPU ranks on gloo, also on a GPU machine
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), ACCELERATE_USE_CPU="1")
    spec = importlib.util.spec_from_file_location(
        "hk_trl_tests", os.path.join(os.path.dirname(os.path.abspath(__file__)), "test_integrations_trl.py"))
    T = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(T)
    from humanline_kernels.integrations.trl import (
        HumanlineDPOConfig,
        HumanlineDPOTrainer,
        HumanlineKTOConfig,
        HumanlineKTOTrainer,
    )
    path = os.path.join(out_dir, "tiny")
    kw = dict(T.COMMON, output_dir=out_dir, max_steps=2, learning_rate=5e-2, ddp_backend="gloo")
    res = {}
    tok = T.tiny.tiny_tokenizer()
    kto_args = HumanlineKTOConfig(**kw, per_device_train_batch_size=2, fused="logits")
    dpo_args = HumanlineDPOConfig(**kw, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    for name, trainer in (
            ("kto", lambda: HumanlineKTOTrainer(path, args=kto_args, train_dataset=T.kto_data(), processing_class=tok)),
            ("dpo", lambda: HumanlineDPOTrainer(path, args=dpo_args, train_dataset=T.pref_data(),
                                                processing_class=tok))):
        tr = trainer()
        before = [p.detach().clone() for p in tr.model.parameters()]
        tr.train()
        res[name] = {"ref": [p.detach().clone() for p in tr.ref_model.parameters()], "syncs": tr.hk_sync.num_syncs,
                     "before": before, "policy": [p.detach().clone() for p in tr.model.parameters()],
                     "wrapped": type(tr.model_wrapped).__name__,
                     "kl": [h["kl"] for h in tr.state.log_history if "kl" in h]}
    # PEFT: no reference model; the frozen "ref" adapter is replicated like the trained one and synced on each rank
    import peft
    tr = HumanlineDPOTrainer(path, args=dpo_args, train_dataset=T.pref_data(), processing_class=tok,
                             peft_config=peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))

    def adapter(name):
        return [p.detach().clone() for n, p in tr.model.named_parameters() if f".{name}." in n]
    before = adapter("ref")
    tr.train()
    res["dpo_peft"] = {"ref": adapter("ref"), "syncs": tr.hk_sync.num_syncs, "before": before,
                       "policy": adapter("default"), "wrapped": type(tr.model_wrapped).__name__,
                       "ref_model": tr.ref_model is None}
    torch.save(res, os.path.join(out_dir, f"trainers{rank}.pt"))


def test_trainers_ddp_gloo_world2(tmp_path):
    spec = importlib.util.spec_from_file_location("hk_tiny", TINY)
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    tiny.tiny_model().save_pretrained(str(tmp_path / "tiny"))
    tiny.tiny_tokenizer().save_pretrained(str(tmp_path / "tiny"))
    mp.spawn(_trainer_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"trainers{r}.pt") for r in range(2))
    assert r0["dpo_peft"]["ref_model"] and r0["dpo_peft"]["ref"]
    for name in ("kto", "dpo", "dpo_peft"):
        a, b = r0[name], r1[name]
        assert a["wrapped"] == "DistributedDataParallel" and a["syncs"] == b["syncs"] == 2
        for x, y, z in zip(a["ref"], b["ref"], a["policy"]):
            assert torch.equal(x, y)  # the reference stays identical across ranks
            assert not torch.equal(x, z)  # it lags the policy by one update
        assert any(not torch.equal(x, y) for x, y in zip(a["ref"], a["before"]))  # it was synced (step 1)
    assert r0["kto"]["kl"] == r1["kto"]["kl"] and len(r0["kto"]["kl"]) == 2  # z0 is all-reduced
