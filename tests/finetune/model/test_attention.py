"""Packed rows' attention (finetune/model/attention.py): ``packed_attention=varlen``, FlashAttention's variable-length kernel.

On the CPU: the varlen plumbing (the collate's sample boundaries, the layouts, each attention layer pointed at it)
against torchtune's dense block-causal mask, with a stand-in for the CUDA kernel; the key's checks. The GPU tests
(the real kernel against flex attention; a recipe run with compile, packing and optimizer-in-backward) are marked
``gpu`` and run on the device."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from conftest import run_here, run_recipe


def tiny_model(num_kv_heads=4):
    from torchtune.models.llama2._component_builders import llama2

    torch.manual_seed(0)
    return llama2(vocab_size=256, num_layers=2, num_heads=4, num_kv_heads=num_kv_heads, embed_dim=64, max_seq_len=64)


def packed_items(rows):
    """torchtune-format packed rows (``packing.PackedSFTDataset`` items) from each row's segment lengths."""
    gen = torch.Generator().manual_seed(1)
    items = []
    for lens in rows:
        n = sum(lens)
        items.append(
            {
                "tokens": torch.randint(0, 256, (n,), generator=gen),
                "labels": torch.zeros(n, dtype=torch.long),
                "input_pos": torch.cat([torch.arange(k) for k in lens]),
                "seq_lens": torch.tensor(lens),
            }
        )
    return items


def test_collate_varlen_marks_every_sample_and_the_padding():
    from finetune.model.attention import collate_varlen

    batch = collate_varlen(packed_items([[3, 2, 1], [4, 2]]))
    assert batch["mask"]["cu_seqlens"].tolist() == [0, 3, 5, 6, 10, 12]
    assert batch["mask"]["cu_seqlens"].dtype == torch.int32
    assert batch["tokens"].shape == batch["labels"].shape == batch["input_pos"].shape == (2, 6)
    with pytest.raises(ValueError, match="seq_lens add up to 5 tokens, not the batch's 6"):
        collate_varlen([{**packed_items([[3, 3]])[0], "seq_lens": torch.tensor([3, 2])}])


def reference_varlen(q, k, v, cu_seqlens, max_len):
    """What FlashAttention's varlen kernel computes, in plain torch: causal attention within each sequence."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        assert end - start <= max_len
        seg = [t[start:end].transpose(0, 1) for t in (q, k, v)]  # [heads, n, dim]
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(*seg, is_causal=True).transpose(0, 1)
    return out


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_varlen_attention_matches_the_block_causal_mask(monkeypatch, kv_heads):
    """The model with varlen attention (the CUDA kernel replaced by reference_varlen) gives the logits and gradients
    of torchtune's dense block-causal mask on the same packed rows: the collate's boundaries, the [tokens, heads,
    dim] layouts and the output's way back are right."""
    from torchtune.data import padded_collate_packed

    from finetune.model import attention as _attention

    monkeypatch.setattr(_attention, "_flash_varlen", reference_varlen)
    items = packed_items([[5, 7, 4], [9, 3, 4], [16]])
    dense, varlen = padded_collate_packed(items), _attention.collate_varlen(items)
    assert dense["mask"].dtype == torch.bool  # (on the CPU torchtune makes the dense mask)

    plain, fast = tiny_model(kv_heads), tiny_model(kv_heads)  # (kv_heads=2: grouped-query attention)
    assert _attention.use_varlen_attention(fast) == 2
    out_plain = plain(dense["tokens"], mask=dense["mask"], input_pos=dense["input_pos"])
    out_fast = fast(varlen["tokens"], mask=varlen["mask"], input_pos=varlen["input_pos"])
    torch.testing.assert_close(out_fast, out_plain, rtol=1e-5, atol=1e-5)
    out_plain.square().mean().backward()
    out_fast.square().mean().backward()
    grads = dict(plain.named_parameters())
    for name, p in fast.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)


@torch.library.custom_op("finetune_tests::varlen", mutates_args=())
def opaque_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int
) -> torch.Tensor:
    """reference_varlen as torch.compile sees FlashAttention's varlen kernel: one opaque operator."""
    return reference_varlen(q, k, v, cu_seqlens, max_len)


@opaque_varlen.register_fake
def _(q, k, v, cu_seqlens, max_len):
    return torch.empty_like(q)


def test_compiled_layers_take_batches_of_any_sample_count_with_the_graph_of_the_first(monkeypatch):
    """A run and a run resumed from its checkpoint take each step with one graph: the batch's number of samples (the
    length of cu_seqlens) is dynamic from the first compile, so a batch with another count compiles nothing. Left to
    torch.compile, the second count compiled a second graph, which the resumed run's first step did not run. The
    model's outputs are those of eager varlen attention."""
    from torch._dynamo.utils import counters

    from finetune.model import attention as _attention

    monkeypatch.setattr(_attention, "_flash_varlen", opaque_varlen)

    def compiled_graphs(hook: bool) -> tuple:
        # (batches of their own: a mark stays on the tensor it was put on)
        batches = [_attention.collate_varlen(packed_items(r)) for r in ([[5, 7, 4], [16]], [[9, 3, 4], [6, 6, 4]])]
        assert [len(b["mask"]["cu_seqlens"]) for b in batches] == [5, 7]
        model, eager = tiny_model(), tiny_model()
        for m in (model, eager):
            _attention.use_varlen_attention(m)
        if not hook:
            model._forward_pre_hooks.clear()
        for layer in model.layers:
            layer.compile(backend="eager")
        torch._dynamo.reset()
        counters.clear()
        counts = []
        for b in batches:
            with torch.no_grad():
                out = model(b["tokens"], mask=b["mask"], input_pos=b["input_pos"])
                torch.testing.assert_close(out, eager(b["tokens"], mask=b["mask"], input_pos=b["input_pos"]))
            counts.append(int(counters["stats"]["unique_graphs"]))
        return tuple(counts)

    without, with_hook = compiled_graphs(False), compiled_graphs(True)
    assert with_hook[0] >= 1 and with_hook[1] == with_hook[0]
    assert without[1] > without[0]  # (what the hook prevents: a second graph for the second count)


def test_varlen_attention_refuses_another_mask():
    from finetune.model.attention import varlen_attention

    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="needs the batch's mask from finetune.model.attention.collate_varlen"):
        varlen_attention(q, q, q, mask=torch.ones(1, 4, 4, dtype=torch.bool))


@pytest.mark.parametrize(
    "settings, words",
    [
        ({"packed_attention": "flash"}, "packed_attention='flash' is not an attention of packed rows"),
        ({"packed_attention": "varlen", "dataset": {"packed": False}}, "needs dataset.packed=True"),
        ({"packed_attention": "varlen", "dataset": {"packed": True}}, "needs device=cuda"),
    ],
)
def test_packed_attention_checks(settings, words):
    from finetune.base import BadInput
    from finetune.settings import read_packed_attention

    packed = settings.get("dataset", {}).get("packed", False)  # (read by the settings, then passed on)
    with pytest.raises(BadInput, match=words):
        read_packed_attention(OmegaConf.create(settings), torch.device("cpu"), packed=packed)
    assert read_packed_attention(OmegaConf.create({}), torch.device("cpu"), packed=False) == "flex"


@pytest.mark.parametrize(
    "capability, available, words",
    [
        ((7, 5), True, r"compute capability 8.0 or later"),
        ((9, 0), False, r"needs torch.nn.attention.varlen"),
        ((9, 0), True, None),
    ],
)
def test_packed_attention_gpu_checks(monkeypatch, capability, available, words):
    """An older GPU, and a torch without the kernel, are one-line errors (checked with a stand-in GPU)."""
    from finetune.base import BadInput
    from finetune.model import attention as _attention
    from finetune.settings import read_packed_attention

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a test GPU")
    monkeypatch.setattr(_attention, "varlen_available", lambda: available)
    cfg = OmegaConf.create({"packed_attention": "varlen", "dataset": {"packed": True}})
    if words is None:
        assert read_packed_attention(cfg, torch.device("cuda"), packed=True) == "varlen"
    else:
        with pytest.raises(BadInput, match=words):
            read_packed_attention(cfg, torch.device("cuda"), packed=True)


def test_a_bad_value_is_refused_before_training(tmp_path):
    run = run_here(tmp_path / "out", "packed_attention=flash")
    assert run.returncode == 2
    assert "packed_attention='flash' is not an attention of packed rows; use packed_attention=flex" in run.error
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


# On the device: the real kernel, compile, packing, optimizer-in-backward. A 2-layer model at Llama2-7B's width.
GPU_MODEL = [
    "device=cuda",
    "dtype=bf16",
    "model.num_layers=2",
    "model.embed_dim=4096",
    "model.num_heads=32",
    "model.num_kv_heads=32",
    "tokenizer.max_seq_len=512",
    "dataset.packed=True",
    "batch_size=4",
    "max_steps_per_epoch=8",
    "compile=True",
    "optimizer=optimizers.AdamW4bit",
    "optimizer_in_bwd=True",
    "clip_grad_norm=null",
    "optimizer.lr=2e-4",
]


@pytest.mark.gpu
def test_gpu_varlen_trains_as_flex(tmp_path):
    runs = {}
    for name, extra in (("flex", ["packed_attention=flex"]), ("fast", ["packed_attention=varlen"])):
        runs[name] = run_recipe(tmp_path / name, *GPU_MODEL, f"pack_cache_dir={tmp_path / 'cache'}", *extra, fast=False)
        assert runs[name].ok, runs[name].stderr[-3000:]
    fast = runs["fast"]
    assert "packed_attention=varlen: 2 attention layers" in fast.stdout + fast.stderr
    assert all(map(math.isfinite, fast.losses)) and fast.losses[-1] < fast.losses[0]
    assert fast.losses == pytest.approx(runs["flex"].losses, rel=2e-2)
    graphs = [m["compiled_graphs"] for m in fast.metrics]
    assert graphs[-1] == graphs[2], graphs  # nothing recompiles once the sample count is dynamic


@pytest.mark.gpu
def test_gpu_varlen_kernel_matches_flex_on_one_layer():
    """The real kernel against flex attention's BlockMask on packed rows of random lengths: outputs and the input
    gradient agree within bf16 rounding."""
    from torch.nn.attention.flex_attention import flex_attention
    from torchtune.modules.attention_utils import packed_block_causal_mask

    from finetune.model import attention as _attention

    lens = [[100, 200, 150, 62], [512], [300, 212]]
    items = packed_items(lens)
    batch = _attention.collate_varlen(items)
    q, k, v = (torch.randn(3, 8, 512, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    ref = flex_attention(q, k, v, block_mask=packed_block_causal_mask([torch.tensor(x) for x in lens]))
    out = _attention.varlen_attention(q, k, v, mask={"cu_seqlens": batch["mask"]["cu_seqlens"].cuda()})
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    g = torch.randn_like(out)
    (dq_ref,) = torch.autograd.grad(ref, q, g)
    (dq,) = torch.autograd.grad(out, q, g)
    torch.testing.assert_close(dq, dq_ref, rtol=5e-2, atol=5e-2)
