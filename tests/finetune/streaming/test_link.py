"""The host slots behind streamed states and weights (finetune/streaming/link.py): every slot its own storage, apart
from the others, and no more host memory taken than the slots need, less a chunk's tail.

The sizes are scaled down 64 times (the constants patched to match) so that the tests take little memory: the layout
is the same at any scale.
"""

import pytest

from finetune.streaming import link

SCALE = 64
# The 4-bit AdamW states of Llama 3.1 8B, one parameter's storages at a time in backward order (output, then the
# layers from the last, then the embedding): two 4-bit code storages and two scale storages a parameter.
CODES_AND_SCALES = {
    "vocab": (262_668_288, 16_416_768),
    "mlp": (29_360_128, 1_835_008),
    "wide": (8_388_608, 524_288),
    "kv": (2_097_152, 131_072),
}
LAYER = ["wide", "kv", "kv", "wide", "mlp", "mlp", "mlp"]


def llama3_1_8b_state_sizes():
    names = ["vocab"] + [n for _ in range(32) for n in reversed(LAYER)] + ["vocab"]
    return [s // SCALE for n in names for s in (*CODES_AND_SCALES[n],) * 2]


@pytest.fixture
def scaled(monkeypatch):
    monkeypatch.setattr(link, "CHUNK_BYTES", link.CHUNK_BYTES // SCALE)
    monkeypatch.setattr(link, "LARGE_BYTES", link.LARGE_BYTES // SCALE)


def test_the_states_of_an_8b_model_take_their_size_and_at_most_a_chunk_more(scaled):
    """The slots as the states ask for them, one at a time: a slot that does not fit the last chunk's tail goes to
    an earlier chunk's, and a large one gets its own region. (Opening a new chunk whenever the last one was full
    took 9.13 GB for these 8.53 GB of states, 0.6 GB a 32 GB desktop does not have.)"""
    sizes = llama3_1_8b_state_sizes()
    slots = link.HostSlots(pin=False)
    taken = [slots.take(n) for n in sizes]
    need = sum(sizes)
    assert need <= slots.nbytes <= need + link.CHUNK_BYTES
    assert [t.numel() for t in taken] == sizes


def test_slots_are_aligned_own_storages_that_never_overlap(scaled):
    slots = link.HostSlots(pin=False)
    sizes = [100_000, 250_000, 3_000, 70_000, 60_000, 5_000, 200_000, 1]
    taken = [slots.take(n) for n in sizes]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in taken)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    homes = [(h.data_ptr(), h.data_ptr() + h.numel()) for h in slots.chunks + slots.regions]
    for t in taken:  # (in a chunk or region, at a multiple of 512 bytes from its start)
        (base,) = [b for b, end in homes if b <= t.data_ptr() and t.data_ptr() + t.numel() <= end]
        assert (t.data_ptr() - base) % link.ALIGN == 0
    assert len({t.untyped_storage().data_ptr() for t in taken}) == len(taken)
    assert all(t.untyped_storage().nbytes() == n for t, n in zip(taken, sizes))  # (torch.save writes no chunk)
    for i, t in enumerate(taken):  # (each slot holds its bytes while the others are written)
        t.fill_(i)
    assert all(bool((t == i).all()) for i, t in enumerate(taken))


def test_a_large_slot_takes_its_exact_size_and_a_known_set_one_region(scaled):
    slots = link.HostSlots(pin=False)
    big = link.LARGE_BYTES + 12_345
    slots.take(big)
    assert slots.nbytes == big and not slots.chunks
    slots.take_all([1_000, 2_000])
    assert slots.nbytes == big + link.ALIGN * 2 + 2_000  # (the second slot starts at the next 512-byte boundary)


@pytest.mark.gpu
def test_on_cuda_slots_are_page_locked_at_their_exact_size():
    """On a GPU the large slot's region is pinned in place (cudaHostRegister), not rounded up by torch's pinned
    allocator, and the copy engines read it."""
    slots = link.HostSlots(pin=True)
    big = link.LARGE_BYTES + 4096
    slot = slots.take(big)
    assert slot.is_pinned() and slots.nbytes == big and not slots.alone
    slot.fill_(7)
    assert int(slot.to("cuda", non_blocking=True).sum()) == 7 * big
