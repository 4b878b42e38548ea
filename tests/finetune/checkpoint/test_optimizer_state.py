"""finetune/checkpoint/optimizer_state.py: the optimizer state a checkpoint holds, converted for another AdamW
variant at resume, and gathered from / scattered to FSDP2 shards on 2 gloo ranks whatever the shard sizes.

The recipes' resumes across rank counts and variants are run for real in tests/recipes/test_portable_resume.py.
"""

import logging
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import optimizers
from finetune.base import BadInput
from finetune.checkpoint.optimizer_state import convertible, restore
from optimizers import portable


def stepped(cls, shapes, steps=3, **kw):
    """A model of fp32 parameters of ``shapes`` and ``cls`` stepped ``steps`` times on seeded gradients."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes])
    opt = cls(model.parameters(), lr=0.01, **kw)
    for _ in range(steps):
        for p in model:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return model, opt


def fp32_moments(opt, p) -> dict:
    """A parameter's moments as fp32 [numel], whatever the optimizer stores."""
    st = opt.state[p]
    if hasattr(opt, "param_format"):
        return portable.moments(st, opt.param_format(p), p.numel())
    return {k: st[k].float().reshape(-1) for k in ("exp_avg", "exp_avg_sq")}


def resume_as(opt, model, new_cls, caplog, **kw):
    """``opt``'s state dict as a checkpoint of its class, restored into a fresh ``new_cls`` on the same weights."""
    path = lambda c: "torch.optim.AdamW" if c is torch.optim.AdamW else f"optimizers.{c.__name__}"  # noqa: E731
    saved_path, now = path(type(opt)), path(new_cls)
    new = new_cls(model.parameters(), lr=0.01, **kw)
    state = {"optimizer": opt.state_dict(), "config": {"optimizer": saved_path}}
    with caplog.at_level(logging.WARNING):
        new.load_state_dict(restore(state, [new], model, now=now, log=logging.getLogger("resume-test")))
    return new


SHAPES = [(64, 96), (40,)]  # one quantized tensor (48 blocks of 128), one small enough for fp32 states


def test_8bit_to_4bit_carries_the_moments_within_one_4bit_rounding_and_keeps_the_step(caplog):
    model, opt8 = stepped(optimizers.AdamW8bit, SHAPES)
    opt4 = resume_as(opt8, model, optimizers.AdamW4bit, caplog)
    lines = [r.getMessage() for r in caplog.records if "continues the state" in r.getMessage()]
    assert len(lines) == 1 and "optimizers.AdamW8bit" in lines[0] and "4bit.v4 codes in blocks of 128" in lines[0]
    big, small = list(model)
    assert opt4.state[big]["exp_avg"].dtype == torch.uint8 and opt4.param_format(big).name == "4bit.v4"
    before, after = fp32_moments(opt8, big), fp32_moments(opt4, big)
    # within one 4-bit rounding of each 128-block: m to the nearest of its levels (gaps up to 64/127 of the block
    # max: half of it), sqrt(v) to a 1-mantissa-bit float (within 1/4 of u, so v within (5/4)^2)
    m8, m4 = before["exp_avg"].view(-1, 128), after["exp_avg"].view(-1, 128)
    assert bool(((m8 - m4).abs() <= 32 / 127 * m8.abs().amax(1, keepdim=True) * 1.001).all())
    v8, v4 = before["exp_avg_sq"].view(-1, 128), after["exp_avg_sq"].view(-1, 128)
    floor = (2.0**-7 / 1.5) ** 2 * v8.amax(1, keepdim=True)  # the smallest code: smaller v round up to it
    ratio = v4 / v8.clamp_min(1e-30)
    assert bool(((ratio >= 0.64) & (ratio <= 1.5626) | (v8 < floor)).all())
    assert torch.equal(fp32_moments(opt4, small)["exp_avg"], before_small := fp32_moments(opt8, small)["exp_avg"])
    assert before_small.abs().sum() > 0
    assert float(opt4.state[big]["step"]) == 3.0 and float(opt4.state[small]["step"]) == 3.0


def test_4bit_to_torch_adamw_trains_on_from_the_decoded_moments(caplog):
    """torch's AdamW gets the 4-bit moments decoded exactly, and its next step is AdamW's from those moments at
    step 4 (a fresh state would move each weight by about lr: a different update)."""
    model, opt4 = stepped(optimizers.AdamW4bit, SHAPES)
    before = {i: fp32_moments(opt4, p) for i, p in enumerate(model)}
    adamw = resume_as(opt4, model, torch.optim.AdamW, caplog)
    g = torch.Generator().manual_seed(1)
    for i, p in enumerate(model):
        assert torch.equal(adamw.state[p]["exp_avg"].reshape(-1), before[i]["exp_avg"])
        assert torch.equal(adamw.state[p]["exp_avg_sq"].reshape(-1), before[i]["exp_avg_sq"])
        assert float(adamw.state[p]["step"]) == 3.0
        p.grad = torch.randn(p.shape, generator=g)
    expected = []
    for i, p in enumerate(model):
        m = 0.9 * before[i]["exp_avg"] + 0.1 * p.grad.reshape(-1)
        v = 0.999 * before[i]["exp_avg_sq"] + 0.001 * p.grad.reshape(-1) ** 2
        denom = (v / (1 - 0.999**4)).sqrt() + 1e-8
        expected.append(p.detach().reshape(-1) * (1 - 0.01 * 0.01) - 0.01 / (1 - 0.9**4) * m / denom)
    adamw.step()
    for p, want in zip(model, expected):
        torch.testing.assert_close(p.detach().reshape(-1), want, rtol=1e-5, atol=1e-6)


def test_torchao_8bit_converts_out_into_ours(caplog):
    """torchao's states decode themselves: they become our 4-bit codes within one 4-bit rounding, steps kept."""
    torchao_optim = pytest.importorskip("torchao.optim")
    model, ao8 = stepped(torchao_optim.AdamW8bit, [(64, 128), (10,)], steps=2)
    new = optimizers.AdamW4bit(model.parameters(), lr=0.01)
    state = {"optimizer": ao8.state_dict(), "config": {"optimizer": "torchao.optim.AdamW8bit"}}
    new.load_state_dict(restore(state, [new], model, now="optimizers.AdamW4bit"))
    big = model[0]
    before = ao8.state[big]["exp_avg"].dequantize().reshape(-1)
    after = fp32_moments(new, big)["exp_avg"]
    assert float((before - after).norm() / before.norm()) < 0.3  # one 4-bit rounding (measured 0.19)
    assert float(new.state[big]["step"]) == 2.0


def test_conversions_that_cannot_carry_the_state_say_why():
    assert convertible("optimizers.AdamW8bit", "optimizers.AdamW4bit") is None
    assert convertible("torchao.optim.AdamW8bit", "torch.optim.AdamW") is None
    assert "no second moment" in convertible("optimizers.AdamW8bit", "torch.optim.SGD")
    assert "bitsandbytes" in convertible("bitsandbytes.optim.AdamW8bit", "optimizers.AdamW8bit")
    assert "rank count" in convertible("optimizers.AdamW8bit", "torchao.optim.AdamW4bit")
    assert "CPUOffloadOptimizer" in convertible("torch.optim.AdamW", "torchao.optim.CPUOffloadOptimizer")
    model, opt = stepped(torch.optim.AdamW, SHAPES, amsgrad=True)
    new = optimizers.AdamW8bit(model.parameters(), lr=0.01)
    state = {"optimizer": opt.state_dict(), "config": {"optimizer": "torch.optim.AdamW"}}
    with pytest.raises(BadInput, match="amsgrad"):
        restore(state, [new], model, now="optimizers.AdamW8bit")


# -- optimizer_in_bwd's layout: one optimizer per parameter name, or one over all -----------------------------------


def stepped_in_bwd(cls, shapes, steps=3, **kw):
    """``stepped``'s run with optimizer_in_bwd's layout: one ``cls`` per parameter, on the same gradients."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes])
    opts = [cls([p], lr=0.01, **kw) for p in model]
    for _ in range(steps):
        for p, opt in zip(model, opts):
            p.grad = torch.randn(p.shape, generator=g)
            opt.step()
    return model, opts


def saved(path, optimizer, in_bwd: bool) -> dict:
    """A checkpoint's recipe state: the optimizer state of ``optimizer`` (a list: one per parameter) as recorded."""
    return {"optimizer": optimizer, "config": {"optimizer": path, "optimizer_in_bwd": in_bwd}}


def tensors_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)


def test_optimizer_in_backward_states_join_and_split_exactly_with_their_param_groups(caplog):
    """One optimizer per parameter and one over all step each parameter with the same arithmetic (fp32 weights), so
    the per-parameter states joined are the one optimizer's, tensor for tensor, and split back are the per-parameter
    ones; the scheduled lr of the saved param group is carried either way, and each conversion says so in one line."""
    log = logging.getLogger("resume-test")
    model_b, per = stepped_in_bwd(optimizers.AdamW8bit, SHAPES)
    model_1, one = stepped(optimizers.AdamW8bit, SHAPES)
    for opt in [one, *per]:  # as the lr schedule leaves them (its optimizer, the first, also has initial_lr)
        opt.param_groups[0]["lr"] = 0.004
    one.param_groups[0]["initial_lr"] = per[0].param_groups[0]["initial_lr"] = 0.01
    names = [n for n, _ in model_b.named_parameters()]

    joined_into = optimizers.AdamW8bit(model_b.parameters(), lr=0.01)
    state = saved("optimizers.AdamW8bit", {n: o.state_dict() for n, o in zip(names, per)}, True)
    with caplog.at_level(logging.WARNING):
        joined_into.load_state_dict(restore(state, [joined_into], model_b, now="optimizers.AdamW8bit", log=log))
    assert all(tensors_equal(joined_into.state[p], one.state[q]) for p, q in zip(model_b, model_1))
    assert joined_into.param_groups[0]["lr"] == 0.004 and joined_into.param_groups[0]["initial_lr"] == 0.01

    split_into = [optimizers.AdamW8bit([p], lr=0.01) for p in model_1]
    state = saved("optimizers.AdamW8bit", one.state_dict(), False)
    loaded = restore(state, split_into, model_1, now="optimizers.AdamW8bit", in_bwd=True, log=log)
    assert list(loaded) == names
    for opt, name, p, q in zip(split_into, names, model_1, model_b):
        opt.load_state_dict(loaded[name])
        assert tensors_equal(opt.state[p], per[names.index(name)].state[q])
        assert opt.param_groups[0]["lr"] == 0.004
    # (names as activation checkpointing's wrapper leaves them: the same parameters, which a resume may wrap or not)
    wrapped = {f"_checkpoint_wrapped_module.{n}": v for n, v in loaded.items()}
    again = restore(
        saved("optimizers.AdamW8bit", wrapped, True), split_into, model_1, now="optimizers.AdamW8bit", in_bwd=True
    )
    assert list(again) == names

    lines = [r.getMessage() for r in caplog.records if "continues the state" in r.getMessage()]
    assert len(lines) == 2, lines
    assert lines[0].startswith("optimizer_in_bwd=False continues the state saved with optimizer_in_bwd=True: the ")
    assert "2 parameters were joined into one optimizer's" in lines[0] and "nothing rounded" in lines[0]
    assert lines[1].startswith("optimizer_in_bwd=True continues the state saved with optimizer_in_bwd=False")
    assert "split into one optimizer per parameter" in lines[1]


def test_another_layout_and_another_class_at_once(caplog):
    """optimizer_in_bwd's 8-bit states into one torch AdamW (the moments decoded exactly), and one torch AdamW's
    state into 8-bit optimizers in backward (within one 8-bit rounding), step counts kept, one line each."""
    log = logging.getLogger("resume-test")
    model, per = stepped_in_bwd(optimizers.AdamW8bit, SHAPES)
    names = [n for n, _ in model.named_parameters()]
    adamw = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = saved("optimizers.AdamW8bit", {n: o.state_dict() for n, o in zip(names, per)}, True)
    with caplog.at_level(logging.WARNING):
        adamw.load_state_dict(restore(state, [adamw], model, now="torch.optim.AdamW", log=log))
    for p, opt in zip(model, per):
        assert torch.equal(adamw.state[p]["exp_avg"].reshape(-1), fp32_moments(opt, p)["exp_avg"])
        assert torch.equal(adamw.state[p]["exp_avg_sq"].reshape(-1), fp32_moments(opt, p)["exp_avg_sq"])
        assert float(adamw.state[p]["step"]) == 3.0

    per8 = [optimizers.AdamW8bit([p], lr=0.01) for p in model]
    state = saved("torch.optim.AdamW", adamw.state_dict(), False)
    with caplog.at_level(logging.WARNING):
        loaded = restore(state, per8, model, now="optimizers.AdamW8bit", in_bwd=True, log=log)
    for name, p, opt in zip(names, model, per8):
        opt.load_state_dict(loaded[name])
        assert float(opt.state[p]["step"]) == 3.0
        for key, want in fp32_moments(adamw, p).items():
            got = fp32_moments(opt, p)[key]
            assert float((got - want).norm() / want.norm()) < 0.02, (name, key)  # one 8-bit rounding (fp32: exact)
    assert per8[0].state[model[0]]["exp_avg"].dtype == torch.uint8  # (the big tensor in 8-bit codes again)
    lines = [r.getMessage() for r in caplog.records if "continues the state" in r.getMessage()]
    assert len(lines) == 2, lines
    assert lines[0].startswith(
        "optimizer=torch.optim.AdamW optimizer_in_bwd=False continues the state optimizers.AdamW8bit saved with "
        "optimizer_in_bwd=True: the states of 2 parameters were joined into one optimizer's"
    )
    assert "decoded to fp32" in lines[0] and "tensors in the parameters' dtype" in lines[0]
    assert "split into one optimizer per parameter" in lines[1] and "8bit" in lines[1]


# -- 2 gloo ranks: shards smaller than a block ---------------------------------------------------------------------

# (3, 40): shards of 80 and 40 elements, both under one block, the second starting inside one; (4, 256): shards on
# block boundaries; (9, 64): 320 and 256 elements, the second starting inside a block.
RANK_SHAPES = [(3, 40), (4, 256), (9, 64)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, key, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        from finetune.checkpoint.optimizer_state import gather_full, load_full

        cls = optimizers.VARIANTS[key].cls
        mesh = init_device_mesh("cpu", (world,))
        one, single = stepped(cls, RANK_SHAPES, min_quant_numel=1)  # one device's run, on every rank
        sd = single.state_dict()  # (views of its live buffers: copied before it steps on)
        saved = {**sd, "state": {i: {k: v.clone() for k, v in e.items()} for i, e in sd["state"].items()}}
        sharded = [torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])) for p in one]
        opt = cls(sharded, lr=0.01, min_quant_numel=1)
        load_full(None, opt, saved, torch.device("cpu"))
        fmt = single.format
        formats = [opt.param_format(p).name == fmt.name for p in sharded]
        dtypes = [opt.state[p]["exp_avg"].dtype == fmt.code_dtype for p in sharded]
        local_numels = [p.to_local().numel() for p in sharded]
        loaded = gather_full(None, opt, main=rank == 0, device=torch.device("cpu"))  # loaded and gathered, no step
        g = torch.Generator().manual_seed(5)
        for _ in range(2):  # both go on with the same gradients
            for p, q in zip(one, sharded):
                p.grad = torch.randn(p.shape, generator=g)
                q.grad = distribute_tensor(p.grad, mesh, [Shard(0)])
            single.step()
            opt.step()
        full = gather_full(None, opt, main=rank == 0, device=torch.device("cpu"))
        result = {"formats": formats, "dtypes": dtypes, "numels": local_numels}
        if rank == 0:
            errors, exact = [], []
            round_trip = [
                all(torch.equal(loaded["state"][i][k], v) for k, v in saved["state"][i].items() if k != "step")
                for i in range(len(RANK_SHAPES))
            ]
            for i, p in enumerate(one):
                a = portable.moments(single.state[p], fmt, p.numel())
                b = portable.moments(full["state"][i], fmt, p.numel())
                errors.append([float((a[k] - b[k]).norm() / a[k].norm()) for k in a])  # relative L2
                exact.append(
                    all(torch.equal(full["state"][i][k], single.state[p][k]) for k in single.state[p] if k != "step")
                )
                assert full["state"][i]["exp_avg"].shape == single.state[p]["exp_avg"].shape
            result.update(errors=errors, exact=exact, round_trip=round_trip, step=float(full["state"][0]["step"]))
        out[rank] = result
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("key", ["ours8", "ours4"])
def test_shards_smaller_than_a_block_stay_quantized_in_the_whole_tensors_blocks(key):
    """One device's state loaded into 2 ranks' FSDP2 shards (some under one block), stepped on, gathered back: every
    shard keeps the format's codes (no fp32 fallback), and the gathered state has the whole tensor's blocks and
    equals one device's where the split is on a block boundary, within the format's rounding elsewhere. (After
    steps, 4-bit differs by design even there: its first moment is rounded stochastically with bits drawn by the
    element's index in the shard; test_distributed.py's docstring.)"""
    out = mp.Manager().dict()
    mp.start_processes(_worker, args=(2, _free_port(), key, out), nprocs=2, join=True, start_method="spawn")
    for rank in (0, 1):
        assert all(out[rank]["formats"]) and all(out[rank]["dtypes"]), out[rank]
    assert out[0]["numels"][0] == 80 and out[1]["numels"][0] == 40  # both shorter than a block
    exact, errors = out[0]["exact"], out[0]["errors"]
    assert out[0]["round_trip"][1], "the (4, 256) tensor is split on a block boundary: loaded and gathered exactly"
    assert exact[1] or key == "ours4", "and stepped on: bit for bit as one device"
    # Relative L2 error after 2 steps. 8-bit: one more rounding of the blocks that straddle a split (3-4 mantissa
    # bits; measured 0.02-0.04). 4-bit: its first moment is rounded stochastically, by bits drawn independently on
    # each side, between levels up to half a block max apart: the split-on-a-boundary tensor, which no conversion
    # touched, already differs by 0.38 (measured), the others by 0.37-0.50.
    bound = {"ours8": 0.05, "ours4": 0.7}[key]
    assert all(e <= bound for row in errors for e in row), errors
    assert out[0]["step"] == 5.0
