"""optimizers.* on DTensor (FSDP2-style sharded) parameters: 2 CPU ranks over gloo.

Each rank keeps the quantized state of its own shard only, uneven and empty shards included, so stepping the
sharded parameters must equal stepping each rank's local shards as plain tensors, bit for bit.

One pair of spawned ranks checks every variant under test (the ``sharded`` fixture): most of a check is the ranks'
start-up (importing torch and the optimizers), paid once for all.
"""

import importlib
import inspect
import os
import socket
import traceback

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


def _check(mesh, component):
    """(sharded step == local step, states equal, each tensor's local numel) for the class at ``component``."""
    from torch.distributed.tensor import Shard, distribute_tensor

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
    return same, same_state, [p.to_local().numel() for p in sharded]


def _worker(rank, world, port, components, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        for component in components:
            try:
                out[(component, rank)] = _check(mesh, component)
            except Exception:
                # The traceback goes back as this variant's result; the rank then stops (its peer may be waiting in
                # a collective), and the join stops the other.
                out[(component, rank)] = traceback.format_exc()
                raise
    finally:
        dist.destroy_process_group()


def run_sharded(components: list) -> dict:
    """Step each variant of ``components`` on sharded and on local parameters in 2 ranks; its results per rank."""
    world = 2
    out = mp.Manager().dict()
    failed = None
    try:
        mp.start_processes(
            _worker, args=(world, _free_port(), components, out), nprocs=world, join=True, start_method="spawn"
        )
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        failed = f"not checked: the ranks stopped ({e})"
    return {c: [out.get((c, rank), failed) for rank in range(world)] for c in components}


@pytest.fixture(scope="module")
def sharded(request):
    """run_sharded over the variants of this module's selected cases (all registered ones in a full run), once."""
    selected = [
        item.callspec.params["component"]
        for item in request.session.items
        if item.module is request.module and item.originalname == "test_sharded_step_equals_local_step"
    ]
    return run_sharded(list(dict.fromkeys(selected)))


@pytest.mark.parametrize("component", variant_params())
def test_sharded_step_equals_local_step(sharded, component):
    results = sharded[component]
    for rank, result in enumerate(results):
        assert isinstance(result, tuple), f"rank {rank}: {result}"
        same, same_state, _ = result
        assert same and same_state, f"rank {rank}: sharded and local steps differ"
    assert results[1][2][1] == 0, "the 1-row tensor should leave rank 1 an empty shard"
    assert results[0][2][0] != results[1][2][0], "the 129-row tensor should be split unevenly"
