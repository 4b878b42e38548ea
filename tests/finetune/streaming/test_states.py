"""Optimizer states streamed from host memory (finetune/streaming): the same numbers as states kept on the device,
the schedule of copies around each step, checkpoints, and the host-memory check.

The CPU tests go through ``StandInLink`` (synchronous copies between CPU tensors: the states really leave their
storages between steps); the GPU test runs the real two-stream ``CudaLink`` with the Triton 4-bit step.
"""

import pytest
import torch
from torchtune import training

import optimizers
import support
from finetune.streaming import StreamedStates
from finetune.streaming.states import _tensors, state_bytes

OPTIMIZERS = {
    "torch-AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "AdamW8bit": lambda ps: optimizers.AdamW8bit(ps, lr=1e-2),
    "AdamW4bit": lambda ps: optimizers.AdamW4bit(ps, lr=1e-2),
}


def train(build, *, streamed: bool, steps: int, device: str = "cpu", dtype=torch.float32, resume=None, **kw):
    """``steps`` in-backward steps of the tiny decoder on fixed random tokens; returns the model, the losses and
    the StreamedStates (None when resident). ``resume``: an optimizer state dict to load before the first step."""
    model = support.tiny_decoder(device).to(dtype)
    optim_dict = {p: build([p]) for p in model.parameters()}
    if streamed:  # (a toy's states are small: stream every one of at least 1 KiB)
        states = StreamedStates(model, optim_dict, torch.device(device), **{"min_bytes": 1024, **kw})
    else:
        states = None
        training.register_optim_in_bwd_hooks(model, optim_dict)
    if resume is not None:
        model.load_state_dict(resume["model"])
        (states or training.create_optim_in_bwd_wrapper(model, optim_dict)).load_state_dict(resume["optimizer"])
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 512, (4, 32), generator=g).to(device)
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
    return model, losses, states, optim_dict


def streamed_storages(states: StreamedStates):
    return [s for pairs in states._pairs.values() for s, _ in pairs]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_streamed_states_train_bit_identically_to_resident_ones(name):
    resident, losses, _, _ = train(OPTIMIZERS[name], streamed=False, steps=4)
    streamed, streamed_losses, states, _ = train(OPTIMIZERS[name], streamed=True, steps=4, ahead_bytes=1 << 18)
    assert streamed_losses == losses
    for a, b in zip(resident.parameters(), streamed.parameters()):
        assert torch.equal(a, b)
    # The states really left: between steps only the prefetched ones have bytes in their storages.
    storages = streamed_storages(states)
    assert len(storages) >= 8
    held = sum(s.nbytes() for s in storages)
    assert held == states.device_bytes <= states.ahead_bytes + max(states._bytes.values())
    assert held < sum(states._bytes.values()) / 2


def test_each_step_waits_for_its_fetch_and_the_next_fetch_overlaps_it():
    trace = []
    _, _, states, _ = train(OPTIMIZERS["AdamW4bit"], streamed=True, steps=3, ahead_bytes=1 << 18, trace=trace)
    ends = [i for i, (op, _) in enumerate(trace) if op == "backward_end"]
    assert len(ends) == 3
    first, later = trace[: ends[0]], trace[ends[1] + 1 : ends[2]]
    streamed = {n for n, p in states._by_name.items() if states._pairs.get(p)}
    order = [n for op, n in first if op == "step"]
    # The first backward creates each state at its step and writes it out right after; nothing is fetched.
    assert [op for op, _ in first if op == "fetch"] == []
    assert [n for op, n in first if op == "write"] == [n for n in order if n in streamed]
    for name in streamed:
        ops = [op for op, n in later if n == name]
        # fetched (in the forward pass or ahead in backward), then waited for, stepped, written back; once each
        fetched = "fetch" in ops or ("fetch", name) in trace[ends[0] : ends[1]]
        assert fetched and ops[-3:] == ["wait", "step", "write"], (name, ops)
    # Double buffering: when a streamed parameter steps, the next streamed one in the order is already fetched.
    seq = [n for n in order if n in streamed]
    window = trace[ends[1] + 1 : ends[2]]
    for cur, nxt in zip(seq, seq[1:]):
        step_at = window.index(("step", cur))
        fetched_next = ("fetch", nxt) in window[:step_at] or ("fetch", nxt) in trace[ends[0] : ends[1] + 1]
        assert fetched_next, f"{nxt} was not on its way when {cur} stepped"
    # At the end of a backward the next one's first states are fetched, within the look-ahead.
    after_end = trace[ends[1] + 1 :]
    head = []
    for op, n in after_end:
        if op != "fetch":
            break
        head.append(n)
    assert head and head == seq[: len(head)] and len(head) < len(seq)
    assert sum(states._bytes[states._by_name[n]] for n in head[:-1]) <= states.ahead_bytes


def test_a_checkpoint_of_streamed_states_resumes_exactly_and_equals_the_resident_one():
    build = OPTIMIZERS["AdamW4bit"]
    _, full_losses, _, _ = train(build, streamed=True, steps=5)
    model, _, states, optim_dict = train(build, streamed=True, steps=3)
    resident_model, _, _, resident_dict = train(build, streamed=False, steps=3)
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optimizer": states.state_dict()}
    resident = training.create_optim_in_bwd_wrapper(resident_model, resident_dict).state_dict()  # what it writes
    compared = 0
    for name, sd in saved["optimizer"].items():
        for pid, entry in sd["state"].items():
            for key, value in entry.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(resident[name]["state"][pid][key]))
                compared += 1
    assert compared > 20
    # Resumed into fresh streamed states: the last two steps of the uninterrupted run, exactly. The generator
    # restarts, so step 4 of the resumed run sees step 1's tokens: run the data forward by the 3 steps taken.
    model2 = support.tiny_decoder()
    optim2 = {p: build([p]) for p in model2.parameters()}
    states2 = StreamedStates(model2, optim2, torch.device("cpu"), min_bytes=1024)
    model2.load_state_dict(saved["model"])
    states2.load_state_dict(saved["optimizer"])
    assert states2.device_bytes == 0  # loaded one parameter at a time, each written out
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        torch.randint(0, 512, (4, 32), generator=g)
    losses = []
    for _ in range(2):
        tokens = torch.randint(0, 512, (4, 32), generator=g)
        loss = torch.nn.functional.cross_entropy(model2(tokens)[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
    assert losses == full_losses[3:]


def test_states_kept_on_the_device_within_the_budget_never_travel_and_the_steps_stay_identical():
    build = OPTIMIZERS["AdamW4bit"]
    _, all_streamed, every, _ = train(build, streamed=True, steps=3)
    sizes = sorted(every._bytes.values(), reverse=True)
    budget = sum(sizes[:3]) + sizes[-1]  # room for a few parameters' states, not all
    trace = []
    model, losses, states, _ = train(build, streamed=True, steps=4, resident_bytes=budget, trace=trace)
    resident_model, resident_losses, _, _ = train(build, streamed=False, steps=4)
    assert losses == resident_losses and losses[:3] == all_streamed
    for a, b in zip(resident_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    kept = {states._name[p] for p in states._resident}
    assert kept and 0 < sum(states._resident.values()) <= budget
    # the first parameters the first backward stepped, while their states fit; the others still travel
    first = [n for op, n in trace if op == "step"]
    streamed = {n for n, p in states._by_name.items() if states._pairs.get(p)}
    assert streamed and not kept & streamed
    assert first.index(min(kept, key=first.index)) < first.index(min(streamed, key=first.index))
    assert not [n for op, n in trace if op in ("fetch", "write") and n in kept]
    # kept ones hold their bytes between steps and take no host slot; the host holds only the streamed ones
    assert all(s.nbytes() > 0 for p in states._resident for s in every_storage(states, p))
    host = sum(h.numel() for pairs in states._pairs.values() for _, h in pairs)
    assert host == sum(states._bytes.values()) == sum(every._bytes.values()) - sum(states._resident.values())
    assert states.metrics()["resident_state_gib"] == sum(states._resident.values()) / 2**30
    # A checkpoint holds the kept states as they are; a run that streams everything resumes from it exactly.
    saved = states.state_dict()
    fresh = StreamedStates(model, {p: build([p]) for p in model.parameters()}, torch.device("cpu"), min_bytes=1024)
    fresh.load_state_dict(saved)
    again = fresh.state_dict()
    for name, sd in saved.items():
        for pid, entry in sd["state"].items():
            for key, value in entry.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(again[name]["state"][pid][key]))


def every_storage(states: StreamedStates, p):
    return {t.untyped_storage() for t in _tensors(states._optims[p].state) if t.numel() >= 256}


def test_the_host_bytes_of_the_streamed_states_come_from_the_configured_format():
    """(The refusal of a machine without the room: tests/finetune/streaming/test_weights.py, with the weights'.)"""
    model = support.tiny_decoder()
    n = sum(p.numel() for p in model.parameters())
    need = state_bytes(OPTIMIZERS["AdamW8bit"], model.parameters(), torch.device("cpu"), min_bytes=0)
    assert 2 * n <= need <= 2.2 * n  # two 8-bit moments per element, plus their block scales
    need4 = state_bytes(OPTIMIZERS["AdamW4bit"], model.parameters(), torch.device("cpu"), min_bytes=0)
    assert n <= need4 <= 1.1 * n  # two 4-bit moments per element, plus their block scales


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["AdamW4bit", "torch-AdamW"])
def test_on_cuda_twenty_streamed_steps_equal_the_resident_ones(name):
    """The two-stream link on a GPU, bf16 weights (stochastic rounding for ours): 20 steps, bit-identical."""
    build = OPTIMIZERS[name]
    kw = dict(steps=20, device="cuda", dtype=torch.bfloat16)
    resident, losses, _, _ = train(build, streamed=False, **kw)
    streamed, streamed_losses, states, _ = train(build, streamed=True, ahead_bytes=1 << 18, **kw)
    assert streamed_losses == losses
    for a, b in zip(resident.parameters(), streamed.parameters()):
        assert torch.equal(a, b)
    figures = states.metrics()
    assert figures["host_copy_gb"] > 0 and figures["copy_wait_ms"] >= 0
    assert states.peak_device_bytes < sum(states._bytes.values())


@pytest.mark.gpu
def test_on_cuda_states_partly_kept_on_the_gpu_step_as_the_resident_ones():
    """resident_bytes on the real link: about half the states stay on the GPU, the rest travel; 20 steps equal the
    resident run's, and only the travelling ones are copied."""
    build = OPTIMIZERS["AdamW4bit"]
    kw = dict(steps=20, device="cuda", dtype=torch.bfloat16)
    _, _, every, _ = train(build, streamed=True, steps=1, device="cuda", dtype=torch.bfloat16)
    half = sum(every._bytes.values()) // 2
    resident, losses, _, _ = train(build, streamed=False, **kw)
    kept, kept_losses, states, _ = train(build, streamed=True, ahead_bytes=1 << 18, resident_bytes=half, **kw)
    assert kept_losses == losses
    for a, b in zip(resident.parameters(), kept.parameters()):
        assert torch.equal(a, b)
    assert 0 < sum(states._resident.values()) <= half and sum(states._bytes.values()) > 0
    # (step 1 writes each travelling state out; later steps bring it up and back, and the last prefetches a few)
    assert 0 < states.metrics()["host_copy_gb"] * 1e9 <= 2 * 20 * sum(states._bytes.values())
