"""FP8 matmuls (``fp8=tensorwise`` / ``rowwise``): the key's checks, which layers convert, and a run on the CPU, where
torch emulates the FP8 matmuls. The GPU tests (compile, optimizer-in-backward, activation checkpointing, packing on
FP8 tensor cores) are marked ``gpu`` and run on the device."""

import math

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from conftest import run_here, run_recipe


def test_a_bad_value_is_refused_before_training(tmp_path):
    run = run_here(tmp_path / "out", "fp8=fast")
    assert run.returncode == 2
    assert "fp8='fast' is not an FP8 recipe; use fp8=tensorwise" in run.error
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "capability, compile_, words",
    [
        ((8, 0), True, "needs FP8 tensor cores (compute capability 8.9 or later"),
        ((9, 0), False, "needs compile=True on a GPU"),
        ((9, 0), True, None),
    ],
)
def test_the_gpu_checks(monkeypatch, capability, compile_, words):
    """A GPU without FP8 tensor cores, and FP8 without compile, are one-line errors (checked with a stand-in GPU)."""
    from finetune.base import BadInput
    from finetune.settings import read_fp8

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a test GPU")
    cfg = OmegaConf.create({"fp8": "tensorwise"})
    if words is None:
        assert read_fp8(cfg, torch.device("cuda"), compile_=compile_) == "tensorwise"
    else:
        with pytest.raises(BadInput, match=words.replace("(", r"\(")):
            read_fp8(cfg, torch.device("cuda"), compile_=compile_)
    assert read_fp8(OmegaConf.create({"fp8": None}), torch.device("cuda"), compile_=False) is None


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_every_projection_of_llama2_7b_converts_and_the_output_stays_bf16(recipe):
    """At Llama2-7B's shapes (built on the meta device: no memory) all 7 projections of each of the 32 layers run in
    FP8; the output projection (the logits) and the embedding do not. The same Parameter objects stay in place, so
    the optimizer and the checkpoint see the weights as before."""
    from torchao.float8.float8_linear import Float8Linear
    from torchtune.models.llama2 import llama2_7b

    from finetune.model.prepare import convert_to_fp8

    with torch.device("meta"):
        model = llama2_7b()
    weights = {name: p for name, p in model.named_parameters()}
    assert convert_to_fp8(model, recipe) == 32 * 7
    assert type(model.output) is torch.nn.Linear and isinstance(model.layers[5].mlp.w2, Float8Linear)
    assert all(p is weights[name] for name, p in model.named_parameters())


def test_small_layers_stay_bf16():
    """torchao's thresholds: a 3B model's 1024-wide key/value projections stay in bf16 under tensorwise, and a
    layer whose dimensions are not multiples of 16 never converts."""
    from finetune.model.prepare import fp8_suits

    kv = torch.nn.Linear(3072, 1024, device="meta")
    assert not fp8_suits("layers.0.attn.k_proj", kv, "tensorwise")
    assert fp8_suits("layers.0.attn.q_proj", torch.nn.Linear(3072, 3072, device="meta"), "tensorwise")
    assert not fp8_suits("layers.0.mlp.w1", torch.nn.Linear(4096, 11004, device="meta"), "tensorwise")
    assert not fp8_suits("output", torch.nn.Linear(4096, 32000, device="meta"), "tensorwise")


# The FAST model with a 1040-wide MLP, so that w1 and w3 (64 -> 1040) are large enough to convert.
WIDE_MLP = ["model.intermediate_dim=1040", "max_steps_per_epoch=4"]


def test_a_cpu_run_trains_like_bf16_matmuls_and_writes_the_same_checkpoint(tmp_path, caplog):
    plain = run_here(tmp_path / "plain", *WIDE_MLP)
    fp8 = run_here(tmp_path / "fp8", *WIDE_MLP, "fp8=tensorwise")
    assert plain.ok and fp8.ok, fp8.stderr[-3000:]
    assert "fp8=tensorwise: 2 linear layers run their matmuls in FP8" in caplog.text
    # FP8's rounding moves the losses a little (e4m3 keeps 3 mantissa bits; the dynamic scales keep the range).
    assert fp8.losses != plain.losses
    assert fp8.losses == pytest.approx(plain.losses, rel=2e-2)
    a, b = (load_file(r.output_dir / "epoch_0" / "model.safetensors") for r in (plain, fp8))
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}


def test_fp8_on_a_model_with_no_layer_to_convert_is_one_error_line(tmp_path):
    """The tiny config's projections are all too small for FP8: asking for it is refused before training, not
    trained in plain matmuls with an info line."""
    run = run_here(tmp_path / "fp8", "fp8=tensorwise")
    assert run.returncode == 2 and run.metrics == []
    assert "fp8=tensorwise converts no layer of this model" in run.error and "fp8=null" in run.error


# On the device: FP8 tensor cores, compile, packing, optimizer-in-backward, activation checkpointing. A 2-layer model
# at Llama2-7B's width (4096), so that every projection converts under both recipes.
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


@pytest.fixture(scope="module")
def gpu_bf16_run(tmp_path_factory):
    """The GPU model with bf16 matmuls: the losses the FP8 runs are compared with."""
    out = tmp_path_factory.mktemp("bf16")
    run = run_recipe(out / "out", *GPU_MODEL, f"pack_cache_dir={out / 'cache'}", fast=False)
    assert run.ok, run.stderr[-3000:]
    return run


@pytest.mark.gpu
@pytest.mark.parametrize("recipe, ac", [("tensorwise", True), ("rowwise", False)])
def test_gpu_fp8_with_compile_in_backward_and_checkpointing(gpu_bf16_run, tmp_path, recipe, ac):
    fp8 = run_recipe(
        tmp_path / "fp8",
        *GPU_MODEL,
        f"pack_cache_dir={tmp_path / 'cache'}",
        f"fp8={recipe}",
        f"enable_activation_checkpointing={ac}",
        fast=False,
    )
    assert fp8.ok, fp8.stderr[-3000:]
    assert f"fp8={recipe}: 14 linear layers" in fp8.stdout + fp8.stderr
    assert all(map(math.isfinite, fp8.losses)) and fp8.losses[-1] < fp8.losses[0]
    assert fp8.losses == pytest.approx(gpu_bf16_run.losses, rel=3e-2)
    graphs = [m["compiled_graphs"] for m in fp8.metrics]
    assert graphs[-1] == graphs[1], graphs  # nothing recompiles after the first steps


# The other families' layers under FP8 (configs/<family>/*_fp8.yaml): support.py's toys of Qwen2.5 3B (q/k/v biases,
# tied embeddings) and Qwen3 8B (q/k norms), built by the recipe's builders, widened until torchao's thresholds let
# their layers convert: queries of 4 x 272 = 1,088 (out > 1,024), an MLP of 1,040.
@pytest.mark.parametrize(
    "key, width, converted",
    [
        ("qwen2_5_3b", 1088, ["q_proj", "output_proj", "w1", "w2", "w3"]),  # (1,088 / 4 heads: heads of 272)
        ("qwen3_8b", 256, ["q_proj", "w1", "w3"]),  # (heads of 272 on a 256 residual: the output stays small)
    ],
)
def test_biases_qk_norms_and_tied_embeddings_train_under_fp8(key, width, converted):
    """The converted query projection keeps its bias (the same Parameter) and Qwen3's q/k norms act on its output;
    the 544-wide key/value projections, the norms, the embedding and the output layer tied to it stay as they were.
    A forward and backward on the CPU (FP8 emulated) agree with the unconverted model within FP8's rounding, and the
    bias, the norms and the tied embedding get gradients."""
    import copy

    from torchtune.config._utils import _get_component_from_path

    import support
    from finetune.model.prepare import convert_to_fp8

    toy = support.TOYS[key]
    sizes = dict(vocab_size=1024, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=width, max_seq_len=128)
    torch.manual_seed(0)
    extra = dict(toy.builder_extra, **({"head_dim": 272} if key == "qwen3_8b" else {}))
    plain = _get_component_from_path(toy.sizes_builder)(**sizes, intermediate_dim=1040, **extra)
    model = copy.deepcopy(plain)
    params = dict(model.named_parameters())
    assert convert_to_fp8(model, "tensorwise") == len(converted) * 2
    layer = model.layers[0]
    modules = {"q_proj": layer.attn.q_proj, "output_proj": layer.attn.output_proj, **dict(layer.mlp.named_children())}
    assert sorted(n for n, m in modules.items() if type(m).__name__ == "Float8Linear") == sorted(converted)
    assert type(layer.attn.k_proj) is torch.nn.Linear and layer.attn.k_proj.weight.shape[0] == 544
    assert dict(model.named_parameters()) == params
    if key == "qwen2_5_3b":
        assert layer.attn.q_proj.bias is params["layers.0.attn.q_proj.bias"]
        assert model.output.tied_module is model.tok_embeddings
    tokens = torch.randint(0, 1024, (1, 32), generator=torch.Generator().manual_seed(1))  # (FP8 on the CPU is slow)
    losses = []
    for m in (plain, model):
        logits = m(tokens)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 1024), tokens[:, 1:].reshape(-1))
        loss.backward()
        losses.append(loss.item())
    assert losses[1] != losses[0] and losses[1] == pytest.approx(losses[0], rel=2e-2)
    grads = [model.tok_embeddings.weight.grad]
    grads += [layer.attn.q_proj.bias.grad] if key == "qwen2_5_3b" else [layer.attn.q_norm.scale.grad]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
