"""optimizers.* on DTensor (FSDP2-style sharded) parameters: 2 CPU ranks over gloo.

Each rank keeps the quantized state of its own shard only, uneven and empty shards included, so stepping the
sharded parameters must equal stepping each rank's local shards as plain tensors, bit for bit.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = [(129, 33), (1, 4096), (4096,), (3, 40), (3, 8)]  # uneven rows, an empty shard, tiny tensors


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, cls_name, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import optimizers
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        g = torch.Generator().manual_seed(0)
        full = [torch.randn(s, generator=g) for s in SHAPES]
        grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(3)]
        cls = getattr(optimizers, cls_name)
        sharded = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in full]
        local = [torch.nn.Parameter(p.to_local().clone()) for p in sharded]
        # The format is chosen from the global size, so make every non-empty local shard big enough to match
        kw = {} if cls_name == "AdamW" else {"min_quant_numel": 1}
        o1, o2 = cls(sharded, lr=0.05, **kw), cls(local, lr=0.05, **kw)
        for step in grads:
            for p, q, gr in zip(sharded, local, step):
                p.grad = distribute_tensor(gr, mesh, [Shard(0)])
                q.grad = p.grad.to_local().clone()
            o1.step()
            o2.step()
        same = all(torch.equal(p.to_local(), q) for p, q in zip(sharded, local))
        same_state = all(torch.equal(o1.state[p][k], o2.state[q][k]) for p, q in zip(sharded, local)
                         for k in o1.state[p] if q.numel() > 0)
        numels = [p.to_local().numel() for p in sharded]
        out[rank] = (same, same_state, numels)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cls_name", ["AdamW8bit", "AdamW4bit", "AdamWFp8", "AdamW"])
def test_sharded_step_equals_local_step(cls_name):
    world = 2
    out = mp.Manager().dict()
    mp.start_processes(_worker, args=(world, _free_port(), cls_name, out), nprocs=world, join=True,
                       start_method="spawn")
    assert sorted(out.keys()) == [0, 1]
    for rank in range(world):
        same, same_state, numels = out[rank]
        assert same and same_state, f"rank {rank}: sharded and local steps differ"
    assert out[1][2][1] == 0, "the 1-row tensor should leave rank 1 an empty shard"
    assert out[0][2][0] != out[1][2][0], "the 129-row tensor should be split unevenly"
