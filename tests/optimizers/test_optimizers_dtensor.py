"""optimizers.* on DTensor (FSDP2-style sharded) parameters: 2 CPU ranks over gloo.

Each rank keeps the quantized state of its own shard only, uneven and empty shards included, so stepping the
sharded parameters must equal stepping each rank's local shards as plain tensors, bit for bit.
"""

import importlib
import inspect
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


def variant_params() -> list:
    """One case per registered variant (optimizers.VARIANTS, read at collection time): its class's config path."""
    import optimizers

    return [pytest.param(v.component, id=v.key) for v in optimizers.VARIANTS.values()]


def _worker(rank, world, port, component, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        g = torch.Generator().manual_seed(0)
        full = [torch.randn(s, generator=g) for s in SHAPES]
        grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(3)]
        module, _, name = component.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        sharded = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in full]
        local = [torch.nn.Parameter(p.to_local().clone()) for p in sharded]
        # The format is chosen from the global size, so make every non-empty local shard big enough to match
        kw = {"min_quant_numel": 1} if "min_quant_numel" in inspect.signature(cls.__init__).parameters else {}
        o1, o2 = cls(sharded, lr=0.05, **kw), cls(local, lr=0.05, **kw)
        for step in grads:
            for p, q, gr in zip(sharded, local, step):
                p.grad = distribute_tensor(gr, mesh, [Shard(0)])
                q.grad = p.grad.to_local().clone()
            o1.step()
            o2.step()
        same = all(torch.equal(p.to_local(), q) for p, q in zip(sharded, local))
        same_state = all(
            torch.equal(o1.state[p][k], o2.state[q][k])
            for p, q in zip(sharded, local)
            for k in o1.state[p]
            if q.numel() > 0
        )
        numels = [p.to_local().numel() for p in sharded]
        out[rank] = (same, same_state, numels)
    finally:
        dist.destroy_process_group()


def run_sharded(component: str) -> None:
    """Step the variant at ``component`` on sharded and on local parameters in 2 ranks; assert they agree."""
    world = 2
    out = mp.Manager().dict()
    mp.start_processes(
        _worker, args=(world, _free_port(), component, out), nprocs=world, join=True, start_method="spawn"
    )
    assert sorted(out.keys()) == [0, 1]
    for rank in range(world):
        same, same_state, numels = out[rank]
        assert same and same_state, f"rank {rank}: sharded and local steps differ"
    assert out[1][2][1] == 0, "the 1-row tensor should leave rank 1 an empty shard"
    assert out[0][2][0] != out[1][2][0], "the 129-row tensor should be split unevenly"


@pytest.mark.parametrize("component", variant_params())
def test_sharded_step_equals_local_step(component):
    run_sharded(component)
