"""Spawn helper for CPU distributed tests: ``run(fn, *args)`` runs ``fn(rank, world_size, *args)`` in 2 processes
(gloo, a free port on 127.0.0.1). ``fn`` must live in an importable module (a test module is fine)."""
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world_size, port, args, gpu=False):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    if not gpu:  # CPU ranks on gloo, also on a GPU machine (a second rank would ask for cuda:1)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}")
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Leave without interpreter teardown: threads that DeepSpeed or gloo still hold at exit can abort the process
    # ("terminate called without an active exception") after every check has passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def check_paced(syncer, slices, tag) -> None:
    """With ``slices`` > 1: the copy went in parts through the step (the hooks saw the wrapped model's leaf modules,
    and no part waited for ``wait()``)."""
    if slices > 1:
        assert syncer._pace.expect and syncer._pace.expect >= slices - 1, tag
        assert syncer._pace.issued["points"] > 0 and syncer._pace.issued["wait"] == 0, (tag, syncer._pace.issued)


def run(fn, *args, world_size: int = 2) -> None:
    """Run ``fn`` on ``world_size`` spawned ranks; an exception on any rank fails the caller with its traceback."""
    mp.spawn(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True)
