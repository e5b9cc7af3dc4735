"""hk.fused_linear called inside a model's forward under FSDP2, FSDP1 and DeepSpeed ZeRO-3 (gloo, world size 2).

This is the calling pattern the trainer integrations rely on: FSDP all-gathers the lm_head weight for the forward,
our autograd function returns dW for the unsharded weight, and FSDP reduce-scatters it. Both ranks see the same
batch, so the averaged gradients must equal a single-process eager computation through ``hk.reference``.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import humanline_kernels as hk
from tools.distributed import run

pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available"),
              pytest.mark.slow]  # slow: FSDP and ZeRO-3 on two spawned ranks
V, D, B, T = 37, 16, 4, 5


class TinyLM(nn.Module):
    def __init__(self, loss):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, D)
        self.trunk = nn.Sequential(nn.Linear(D, D), nn.Tanh())
        self.lm_head = nn.Linear(D, V, bias=False)
        self.loss = loss

    def hidden(self, ids):
        return self.trunk(self.embed(ids))

    def forward(self, ids, labels, ref_logps, adv):
        h = self.hidden(ids)
        # inside forward: under FSDP the weight is the gathered, unsharded parameter here
        if self.loss == "dpo":
            return hk.fused_linear.dpo(h, self.lm_head.weight, labels, ref_logps, beta=0.5, chunk_bytes=3 * V * 4)[0]
        return hk.fused_linear.grpo(h, self.lm_head.weight, labels, ref_logps, adv, beta=0.1, chunk_bytes=3 * V * 4)[0]


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, T), generator=g)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[1, :2] = -100
    ref = -torch.rand(B, T, generator=g) * 4 - 2
    adv = torch.randn(B, generator=g)
    return ids, labels, ref, adv


def _eager_truth(model, ids, labels, ref, adv):
    logits = model.lm_head(model.hidden(ids))
    logps = hk.reference.token_logprobs(logits, labels)
    mask = labels != -100
    if model.loss == "dpo":
        loss = hk.reference.dpo(logps, ref, mask, beta=0.5)[0]
    else:
        loss = hk.reference.grpo(logps, ref, adv, mask, beta=0.1)[0]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _check(name, loss, grads, truth_loss, truth_grads):
    torch.testing.assert_close(loss, truth_loss, rtol=1e-5, atol=1e-6, msg=name)
    assert grads.keys() == truth_grads.keys()
    for k in grads:
        torch.testing.assert_close(grads[k], truth_grads[k], rtol=1e-4, atol=1e-6, msg=f"{name}: {k}")
    assert any(grads[k].abs().sum() > 0 for k in grads if "lm_head" in k)


def _worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    batch = _batch()
    for loss_name in ("dpo", "grpo"):
        truth_loss, truth_grads = _eager_truth(TinyLM(loss_name), *batch)

        m2 = TinyLM(loss_name)
        mesh = init_device_mesh("cpu", (world,))
        fully_shard(m2.trunk, mesh=mesh)
        fully_shard(m2, mesh=mesh)
        loss = m2(*batch)
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in m2.named_parameters()}
        _check(f"fsdp2 {loss_name}", loss.detach(), grads, truth_loss, truth_grads)

        # summon_full_params(with_grads=True) needs use_orig_params=True (accelerate's default)
        m1 = FSDP(TinyLM(loss_name), use_orig_params=True, auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}),
                  device_id=torch.device("cpu"))
        loss = m1(*batch)
        loss.backward()
        with FSDP.summon_full_params(m1, with_grads=True):
            grads = {n.replace("_fsdp_wrapped_module.", ""): p.grad.clone() for n, p in m1.named_parameters()}
        _check(f"fsdp1 {loss_name}", loss.detach(), grads, truth_loss, truth_grads)


def test_fused_linear_inside_fsdp_forward():
    run(_worker)


# ---- DeepSpeed ZeRO-3: the weight is gathered explicitly, as in the TRL integration's head ----------------------


class TinyLMZero3(TinyLM):
    def forward(self, ids, labels, ref_logps, adv):
        import deepspeed

        h = self.hidden(ids)
        # lm_head's forward is never called, so its gather hook never fires: gather it for the direct access
        with deepspeed.zero.GatheredParameters([self.lm_head.weight]):
            return hk.fused_linear.grpo(h, self.lm_head.weight, labels, ref_logps, adv, beta=0.1,
                                        chunk_bytes=3 * V * 4)[0]


def _zero3_worker(rank, world):
    import sys

    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # a C++ JIT build gloo does not need
    deepspeed.init_distributed(dist_backend="gloo")
    batch = _batch()
    truth_loss, truth_grads = _eager_truth(TinyLM("grpo"), *batch)
    model = TinyLMZero3("grpo")
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                  config={**cfg, "zero_allow_untested_optimizer": True})[0]
    assert engine.module.lm_head.weight.numel() == 0  # partitioned: a direct read without the gather sees nothing
    loss = engine(*batch)
    engine.backward(loss)
    grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
    _check("zero3 grpo", loss.detach(), grads, truth_loss, truth_grads)


def test_fused_linear_inside_zero3_forward():
    pytest.importorskip("deepspeed")
    run(_zero3_worker)
