"""Run a test body on several gloo processes (torch.multiprocessing spawn).

Each worker initializes the default process group, runs `fn(rank, world_size, *args)` and
destroys the group; an exception in any worker fails the test with that worker's traceback.
Test cases are grouped into a few long-lived workers since a process costs seconds of imports.
"""

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world_size, port, fn, args):
    torch.set_num_threads(1)  # several workers share few cores; OMP_NUM_THREADS is read too early
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn, world_size: int, *args) -> None:
    mp.spawn(_worker, args=(world_size, free_port(), fn, args), nprocs=world_size, join=True)
