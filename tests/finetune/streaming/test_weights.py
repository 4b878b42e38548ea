"""Layers whose weights live in host memory (finetune/streaming/weights.py): the same numbers as resident weights,
the schedule of copies (fetched ahead, freed after use, written back after each step), checkpoints read from the
host copies, a forward without gradients, and the checks.

CPU tests go through ``StandInLink`` (synchronous copies: the weights really leave their storages between uses).
"""

import pytest
import torch

import optimizers
import support
from finetune.base import BadInput
from finetune.model.prepare import apply_activation_checkpointing
from finetune.streaming import StreamedStates, StreamedWeights, stream_weights
from finetune.streaming import weights as weights_module

LAYERS, STREAMED = 4, [1, 3]


def build(streamed_layers, trace=None):
    """The 4-layer toy, every layer checkpointed, 4-bit AdamW in backward with streamed states; ``streamed_layers``
    of it with streamed weights."""
    model = support.tiny_decoder(layers=LAYERS)
    apply_activation_checkpointing(model)
    weights = StreamedWeights(model, streamed_layers, torch.device("cpu"), trace=trace) if streamed_layers else None
    optim = {p: optimizers.AdamW4bit([p], lr=1e-2) for p in model.parameters()}
    extra = dict(link=weights.link, after_step=weights.after_step) if weights else {}
    states = StreamedStates(model, optim, torch.device("cpu"), min_bytes=1024, trace=trace, **extra)
    return model, weights, states


def loss_of(model, tokens):
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def train(model, steps):
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        loss = loss_of(model, torch.randint(0, 512, (4, 32), generator=g))
        loss.backward()
        losses.append(loss.item())
    return losses


@pytest.fixture(autouse=True)
def small_weights_stream(monkeypatch):
    monkeypatch.setattr(weights_module, "MIN_BYTES", 1024)  # (a toy's weights are small: stream all but the norms)


def streamed_params(model, weights):
    return [p for i in STREAMED for p in model.layers[i].parameters() if p in weights._host]


def test_streamed_weights_train_bit_identically_to_resident_ones():
    resident, _, _ = build([])
    streamed, weights, _ = build(STREAMED)
    assert train(streamed, 4) == train(resident, 4)
    a, b = resident.state_dict(), streamed.state_dict()  # (the streamed ones: views of their host copies)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # Between steps only the next forward's first streamed layer has bytes on the device.
    held = {i: [p.untyped_storage().nbytes() > 0 for p in model_layer_params(streamed, i, weights)] for i in STREAMED}
    assert held == {1: [True] * len(held[1]), 3: [False] * len(held[3])}


def model_layer_params(model, i, weights):
    return [p for p in model.layers[i].parameters() if p in weights._host]


def test_the_schedule_fetches_ahead_frees_after_use_and_writes_after_each_step():
    trace = []
    model, weights, _ = build(STREAMED, trace)
    train(model, 2)
    ops = [(op, n) for op, n in trace if op.endswith("_weights") or op == "backward_end"]
    ends = [i for i, (op, _) in enumerate(ops) if op == "backward_end"]
    assert len(ends) == 2
    assert ops[ends[0] + 1] == ("fetch_weights", "layers.1")  # the end of a backward sends the next forward's first
    expected = [
        # forward: waiting for layer 1 sends layer 3 on its way; layer 1 is freed after its forward
        ("wait_weights", "layers.1"),
        ("fetch_weights", "layers.3"),
        ("free_weights", "layers.1"),
        ("wait_weights", "layers.3"),  # the last streamed layer stays up: backward needs it first
        # backward: layer 3's weights are there; layer 1's travel while layer 3 (and the resident layer 2) run
        ("wait_weights", "layers.3"),
        ("fetch_weights", "layers.1"),
        *[("write_weights", "layers.3")] * len(model_layer_params(model, 3, weights)),  # each after its step
        ("wait_weights", "layers.1"),
        *[("write_weights", "layers.1")] * len(model_layer_params(model, 1, weights)),
        ("backward_end", None),
    ]
    assert ops[ends[0] + 2 : ends[1] + 1] == expected
    # Each weight goes down right after its own step (and its states' write-back), never before.
    for k, (op, name) in enumerate(trace):
        if op == "write_weights":
            previous = [n for o, n in trace[max(0, k - 3) : k] if o == "step"]
            assert previous and previous[-1].startswith(name + "."), trace[k - 3 : k + 1]


def test_a_forward_without_gradients_frees_every_layer_and_training_goes_on_identically():
    resident, _, _ = build([])
    streamed, weights, _ = build(STREAMED)
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(3))
    train(resident, 2), train(streamed, 2)
    with torch.no_grad():
        assert torch.equal(resident.eval()(tokens), streamed.eval()(tokens))
    assert all(p.untyped_storage().nbytes() == 0 for p in streamed_params(streamed, weights))
    resident.train(), streamed.train()
    assert train(streamed, 2) == train(resident, 2)


def test_stream_weights_checks_the_count():
    model = support.tiny_decoder(layers=LAYERS)
    apply_activation_checkpointing(model)
    with pytest.raises(BadInput, match=r"stream_layers=5 is more than the model's 4 layers"):
        stream_weights(model, 5, torch.device("cpu"))


def test_spread_places_the_streamed_layers_evenly():
    assert weights_module.spread(2, 4) == [1, 3]
    assert weights_module.spread(4, 32) == [4, 12, 20, 28]
    assert len(weights_module.spread(14, 32)) == 14 and weights_module.spread(32, 32) == list(range(32))


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_on_cuda_twenty_streamed_steps_equal_the_resident_ones(compiled):
    """The two-stream CudaLink with the Triton 4-bit step, bf16, per-layer compile as the recipe does it: weights
    and states streamed train the resident run's losses and weights, bit for bit."""
    from torchtune import training

    runs = []
    for streamed_layers in ([], STREAMED):
        model = support.tiny_decoder(device="cpu", layers=LAYERS, width=256).to(torch.bfloat16)
        apply_activation_checkpointing(model)
        device = torch.device("cuda")
        if streamed_layers:
            weights = StreamedWeights(model, streamed_layers, device)
        else:
            weights = None
            model.to(device)
        optim = {p: optimizers.AdamW4bit([p], lr=1e-3) for p in model.parameters()}
        extra = dict(link=weights.link, after_step=weights.after_step) if weights else {}
        StreamedStates(model, optim, device, min_bytes=1024, **extra)
        if compiled:
            training.compile_model(model, verbose=False)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(20):
            loss = loss_of(model, torch.randint(0, 512, (4, 64), generator=g).to(device))
            loss.backward()
            losses.append(loss.item())
        runs.append((losses, {k: v.cpu() for k, v in model.state_dict().items()}))
    (losses, a), (streamed_losses, b) = runs
    assert streamed_losses == losses
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family", ["llama2", "llama3_1", "qwen2"])
def test_a_model_built_on_the_meta_device_and_streamed_computes_what_the_resident_one_does(family):
    """The recipe's path with stream_layers and a checkpoint: the model is built on the meta device, takes the
    checkpoint's tensors (``assign``), and StreamedWeights builds what is not in the state dict (RoPE's cache; Llama
    3's scaled RoPE builds none on the meta device) on the device."""
    import importlib

    builder = getattr(importlib.import_module(f"torchtune.models.{family}"), family)
    sizes = dict(vocab_size=512, num_layers=LAYERS, num_heads=4, num_kv_heads=2, embed_dim=128, max_seq_len=64)
    sizes.update(intermediate_dim=256) if family != "llama2" else None
    torch.manual_seed(0)
    resident = builder(**sizes)
    with torch.device("meta"):
        streamed = builder(**sizes)
    streamed.load_state_dict({k: v.clone() for k, v in resident.state_dict().items()}, assign=True)
    for model in (resident, streamed):
        apply_activation_checkpointing(model)
    StreamedWeights(streamed, STREAMED, torch.device("cpu"))
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(streamed(tokens), resident(tokens))


def test_the_host_room_check_counts_states_and_weights_and_names_the_layers_that_fit(monkeypatch):
    from finetune.streaming import room, states

    model = support.tiny_decoder(layers=LAYERS)
    build = lambda params: optimizers.AdamW4bit(params, lr=1e-2)  # noqa: E731
    need = room.check_host_room(model, build=build, states=True, layers=2, device=torch.device("cpu"))
    per_layer = need["2 layers' weights"] // 2
    assert need["optimizer states"] == states.state_bytes(build, model.parameters(), torch.device("cpu"))
    monkeypatch.setattr(room, "available_host_bytes", lambda: need["optimizer states"] + per_layer + 1)
    with pytest.raises(BadInput, match=r"stream fewer layers \(stream_layers=1 fits"):
        room.check_host_room(model, build=build, states=True, layers=2, device=torch.device("cpu"))


def test_the_streamed_weights_take_exactly_their_bytes_each_in_a_storage_of_its_own():
    """Chunks of torch's pinned allocator left tails and rounded up to a power of two (7.0 GiB of host memory for
    Llama2-7B's 14 streamed layers, 5.3 GiB of weights): the weights now share one region of their exact size,
    and each slot keeps a storage of its own (a checkpoint of one tensor must not carry the region)."""
    model, weights, _ = build(STREAMED)
    sizes = [p.numel() * p.element_size() for i in STREAMED for p in weights_module.streamed_params(model.layers[i])]
    (region,) = weights.link.slots.regions
    assert not weights.link.slots.chunks
    assert sum(sizes) <= region.numel() < sum(sizes) + 512 * len(sizes)
    slots = list(weights._host.values())
    assert [s.numel() for s in slots] == sizes
    assert all(s.untyped_storage().nbytes() == s.numel() for s in slots)
    assert len({s.data_ptr() for s in slots}) == len(slots)
    assert all((s.data_ptr() - region.data_ptr()) % 512 == 0 for s in slots)
