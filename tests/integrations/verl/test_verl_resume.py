"""verl resume (docs/verl.md, "Resume"): the humanline worker writes the reference's shards and its counter beside
verl's own actor checkpoint (``<local_path>/humanline``) and restores them after verl's ``load_checkpoint``, so a
run stopped after a checkpoint and resumed ends as the one that never stopped: the actor's and the reference's
shards, on verl's FSDP2 engines (CPU, gloo, world size 2), k = 2 over verl steps of 3 optimizer steps (so the
checkpoint falls between syncs and inside a sync period)."""
import os

import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue", reason="verl's engine workers import the v1 trainer's TransferQueue")

import torch  # noqa: E402

from tools.distributed import run  # noqa: E402

EPOCHS, LOCAL_BATCH, EVERY = 3, 2, 2


def shards(module):
    return [p._local_tensor.detach().cpu().clone() for p in module.parameters()]


def _worker_object(actor, ref):
    """The humanline ``ActorRolloutRefWorker`` around two engines (its checkpoint methods read only these)."""
    from humanline_kernels.integrations.verl import HumanlineActorRolloutRefWorker
    w = object.__new__(HumanlineActorRolloutRefWorker)
    w.role, w.actor, w.ref = "actor_rollout_ref", actor, ref
    return w


def _engines(path, cfg):
    from humanline_kernels.integrations.verl import HumanlineReference, HumanlineTrainingWorker, humanline_ppo_loss
    from tools.verl_cpu import training_worker
    actor = training_worker(path, forward_only=False, cls=HumanlineTrainingWorker)
    ref = training_worker(path, forward_only=True)
    actor.set_loss_fn(lambda model_output, data, dp_group=None: humanline_ppo_loss(cfg, model_output, data, dp_group))
    actor.humanline = HumanlineReference(actor, ref, every=EVERY)
    return actor, ref


def _verl_step(actor, ref, s):
    from verl.utils import tensordict_utils as tu

    from tools.verl_cpu import RESPONSE, like, log_probs, rollout_batch
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    td = rollout_batch(seed=100 * s + rank, batch_size=LOCAL_BATCH, layout="v1")
    td["old_log_probs"] = log_probs(actor, td)
    td["ref_log_prob"] = log_probs(ref, td)
    td["advantages"] = like(td, torch.randn(LOCAL_BATCH, RESPONSE, generator=torch.Generator().manual_seed(s)))
    tu.assign_non_tensor(td, calculate_entropy=False, global_batch_size=world * LOCAL_BATCH,
                         mini_batch_size=world * LOCAL_BATCH, epochs=EPOCHS, seed=0,
                         dataloader_kwargs={"shuffle": False}, compute_loss=True, temperature=1.0)
    actor.train_mini_batch(td)


def worker(rank, world, path, out):
    from verl.workers.config import ActorConfig

    from humanline_kernels.integrations.verl import HumanlinePolicyLossConfig
    from tools.verl_cpu import install_cpu_platform
    install_cpu_platform()
    cfg = ActorConfig(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=LOCAL_BATCH, use_kl_loss=True,
                      kl_loss_coef=0.0, policy_loss=HumanlinePolicyLossConfig(sync_every=EVERY))
    steps, stop = 3, 2
    actor, ref = _engines(path, cfg)
    for s in range(steps):
        _verl_step(actor, ref, s)
    full = shards(actor.engine.module), shards(ref.engine.module), actor.humanline.syncs

    actor, ref = _engines(path, cfg)
    for s in range(stop):
        _verl_step(actor, ref, s)
    ckpt = os.path.join(out, f"global_step_{stop}", "actor")
    _worker_object(actor, ref).save_checkpoint(ckpt, global_step=stop)
    assert sorted(os.listdir(os.path.join(ckpt, "humanline"))) == [
        "humanline_reference-rank00000-of-00002.safetensors", "humanline_reference-rank00001-of-00002.safetensors",
        "humanline_state.json"]

    actor, ref = _engines(path, cfg)
    _worker_object(actor, ref).load_checkpoint(ckpt)
    assert actor.humanline.step == stop * EPOCHS
    for s in range(stop, steps):
        _verl_step(actor, ref, s)
    for a, b in zip(full[0], shards(actor.engine.module)):
        assert torch.equal(a, b), "actor differs from the uninterrupted run's"
    for a, b in zip(full[1], shards(ref.engine.module)):
        assert torch.equal(a, b), "reference differs from the uninterrupted run's"
    assert actor.humanline.syncs == full[2]

    # the humanline folder lost: the marker beside it says the checkpoint is a humanline run's, so it is refused
    actor, ref = _engines(path, cfg)
    assert os.path.isfile(os.path.join(ckpt, "humanline_run.json"))
    if rank == 0:
        os.rename(os.path.join(ckpt, "humanline"), os.path.join(ckpt, "moved"))
    torch.distributed.barrier()
    with pytest.raises(ValueError, match="humanline_state.json is missing, but .*humanline_run.json marks"):
        _worker_object(actor, ref).load_checkpoint(ckpt)
    torch.distributed.barrier()
    # without the marker too (verl's own worker's checkpoint): the reference restarts from the actor, warned
    if rank == 0:
        os.remove(os.path.join(ckpt, "humanline_run.json"))
    torch.distributed.barrier()
    with pytest.warns(UserWarning, match="holds no humanline state"):
        _worker_object(actor, ref).load_checkpoint(ckpt)
    assert all(torch.equal(r, a) for r, a in zip(shards(ref.engine.module), shards(actor.engine.module)))

    # policy_loss.save_reference=False: the counter only; a resume warns and restarts the reference from the actor
    actor.humanline.save_reference = False
    saved_step = actor.humanline.step
    small = os.path.join(out, "small")
    actor.humanline.save_state(small)
    assert os.listdir(small) == ["humanline_state.json"]
    actor, ref = _engines(path, cfg)
    with pytest.warns(UserWarning, match="no reference weights"):
        actor.humanline.load_state(small)
    assert all(torch.equal(r, a) for r, a in zip(shards(ref.engine.module), shards(actor.engine.module)))
    assert actor.humanline.step == saved_step


def test_verl_worker_resumes_exactly(tmp_path):
    from tools.verl_cpu import save_tiny_llama
    save_tiny_llama(str(tmp_path / "model"))
    run(worker, str(tmp_path / "model"), str(tmp_path / "ckpt"))
