"""The humanline reference inside verl's actor update, on verl's own FSDP2 engines (CPU, gloo, world size 2).

The actor is verl's ``TrainingWorker`` (our ``HumanlineTrainingWorker``), the reference verl's forward-only,
CPU-offloaded one; batches go through verl's ``train_mini_batch`` (mini-batches x ``ppo_epochs`` optimizer steps)
with ``humanline_ppo_loss`` as the loss. Each verl step here is one mini-batch run for 3 epochs, so the same
tokens are trained at optimizer steps t, t+1, t+2 and what the reference must give at step t+1 is known exactly:
the actor's own log-probs at the step of the last sync. Checked for k = 1 and k = 2 (syncs at steps 0, 2, 4, ...):

* the ``ref_log_prob`` the loss sees at each step equals the actor's log-probs at the last sync step (verl's
  ``old_log_probs`` when that sync was the verl step's first optimizer step, a recomputed reference forward when it
  came later in the same verl step; verl's own ``ref_log_prob`` when it came before the verl step);
* after each update the reference's shards equal the actor's shards before the last sync step's update, so the
  reference lags the actor by exactly one sync.
"""
import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue", reason="verl's engine workers import the v1 trainer's TransferQueue")

import torch  # noqa: E402

from tools.distributed import run  # noqa: E402

EPOCHS, LOCAL_BATCH = 3, 2


def shards(module):
    """The rank-local shards (FSDP2 DTensors' local tensors, FSDP1 flat parameters), copied to the CPU."""
    if hasattr(module, "_all_handles"):  # FSDP1
        return [h.flat_param._local_shard.detach().cpu().clone() for h in module._all_handles]
    return [p._local_tensor.detach().cpu().clone() for p in module.parameters()]


def scenario(actor, ref, every, steps, layout):
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig
    from verl.workers.utils.padding import no_padding_2_padding

    from humanline_kernels.integrations.verl import HumanlinePolicyLossConfig, HumanlineReference, humanline_ppo_loss
    from tools.verl_cpu import RESPONSE, like, log_probs, rollout_batch

    cfg = ActorConfig(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=LOCAL_BATCH, use_kl_loss=True,
                      kl_loss_coef=0.0, policy_loss=HumanlinePolicyLossConfig(sync_every=every))
    seen = []  # per optimizer step: (the actor's log-probs, the reference log-probs the loss got)

    def loss_fn(model_output, data, dp_group=None):
        padded = data.select("ref_log_prob", "response_mask").to_padded_tensor()
        lp = no_padding_2_padding(model_output["log_probs"], data).detach().float()
        seen.append((lp * padded["response_mask"], padded["ref_log_prob"].clone()))
        return humanline_ppo_loss(cfg, model_output, data, dp_group)

    actor.set_loss_fn(loss_fn)
    actor.humanline = hl = HumanlineReference(actor, ref, every=every)
    before_update = []
    update = actor.engine.optimizer_step

    def record_then_update():
        before_update.append(shards(actor.engine.module))
        return update()
    actor.engine.optimizer_step = record_then_update

    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    for s in range(steps):
        td = rollout_batch(seed=100 * s + rank, batch_size=LOCAL_BATCH, layout=layout)
        td["old_log_probs"] = log_probs(actor, td)
        td["ref_log_prob"] = log_probs(ref, td)  # verl's reference forward, once per verl step
        td["advantages"] = like(td, torch.randn(LOCAL_BATCH, RESPONSE, generator=torch.Generator().manual_seed(s)))
        tu.assign_non_tensor(td, calculate_entropy=False, global_batch_size=world * LOCAL_BATCH,
                             mini_batch_size=world * LOCAL_BATCH, epochs=EPOCHS, seed=0,
                             dataloader_kwargs={"shuffle": False}, compute_loss=True, temperature=1.0)
        actor.train_mini_batch(td)
        for j in range(EPOCHS):
            t = s * EPOCHS + j
            last_sync = t - 1 - (t - 1) % every  # the reference at step t holds theta at this step
            lp, ref_lp = seen[t]
            if last_sync >= s * EPOCHS:  # synced inside this verl step: replaced
                torch.testing.assert_close(ref_lp, seen[last_sync][0], rtol=0, atol=1e-6)
            if j > 0 and last_sync != t - 1:
                assert not torch.allclose(ref_lp, seen[t - 1][0], atol=1e-4), f"k={every} step {t}: not lagging"
        t_end = (s + 1) * EPOCHS - 1
        last = t_end - t_end % every
        for r, a in zip(shards(ref.engine.module), before_update[last]):
            assert torch.equal(r, a.to(r.dtype)), f"k={every} after verl step {s}: reference != theta_{last}"
        assert not all(torch.equal(r, a) for r, a in zip(shards(ref.engine.module), shards(actor.engine.module)))
    assert hl.step == steps * EPOCHS
    assert hl.syncs == len(range(0, steps * EPOCHS, every))
    hl.sync_now()  # what the worker does after load_checkpoint: the reference restarts from the actor
    assert all(torch.equal(r, a) for r, a in zip(shards(ref.engine.module), shards(actor.engine.module)))
    assert hl.step == steps * EPOCHS
    return hl.recomputed, hl.from_old


def all_periods(path, strategy="fsdp2", layout="v1"):
    from humanline_kernels.integrations.verl import HumanlineTrainingWorker
    from tools.verl_cpu import training_worker

    # (reference forwards recomputed, mini-batches that took old_log_probs) over 2 verl steps of 3 optimizer steps;
    # k = 3, a multiple of the steps per verl step, never runs an extra reference forward
    for every, want in [(1, (2, 2)), (2, (1, 2)), (3, (0, 4))]:
        actor = training_worker(path, forward_only=False, cls=HumanlineTrainingWorker, strategy=strategy)
        ref = training_worker(path, forward_only=True, strategy=strategy)
        got = scenario(actor, ref, every=every, steps=2, layout=layout)
        assert got == want, (every, got)


def worker(rank, world, path, layout):
    from tools.verl_cpu import install_cpu_platform
    install_cpu_platform()
    all_periods(path, layout=layout)


@pytest.mark.parametrize("layout", ["v1", "legacy"])
def test_reference_lags_by_one_sync_inside_verls_actor_update(tmp_path, layout):
    """``v1``: the batch layout of verl's v1 trainer (jagged responses); ``legacy``: ``trainer.use_v1=False``'s."""
    from tools.verl_cpu import save_tiny_llama
    save_tiny_llama(str(tmp_path))
    run(worker, str(tmp_path), layout)


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_on_cuda_into_the_pinned_offloaded_reference(tmp_path, monkeypatch, strategy):
    """verl's CUDA engines as they run: the actor on the GPU, the reference in pinned host memory (FSDP1
    ``CPUOffload``, FSDP2 ``CPUOffloadPolicy``), the copy on the side stream; world size 1 on NCCL."""
    from tools.distributed import free_port
    from tools.verl_cpu import save_tiny_llama

    port = free_port()
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(k, v)
    save_tiny_llama(str(tmp_path))
    torch.distributed.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                         world_size=1)
    try:
        all_periods(str(tmp_path), strategy)
    finally:
        torch.distributed.destroy_process_group()
