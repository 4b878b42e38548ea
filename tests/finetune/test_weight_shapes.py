"""finetune/weight_shapes.py: a folder's config.json sizes against its weight files' headers, for sign and for range,
before anything is built, with one checker for the fine-tune recipes (at settings time, before the data) and the eval.

Each case is asked of ``read_settings`` first: where the check went missing, the recipe would go on to build the
model config.json describes (100,000 layers: minutes, then the allocator gives up); asked first, the test fails at
once instead. The folder is tests/support.py's tiny Llama (2 layers of width 64, vocabulary 32,000), saved by
transformers, started with Llama 2's shipped config and the CPU overrides docs/models.md gives.
"""

import json
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

import support
from conftest import DATA_DIR, LLAMA2_TOKENIZER, REPO_ROOT, run_here
from eval.checkpoint import check_checkpoint
from eval.errors import EvalInputError
from finetune.base import BadInput
from finetune.settings import read_settings
from finetune.toy_folder import CPU_OVERRIDES

CONFIG = "configs/llama2/7B_full_80gb.yaml"


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return support.make_tiny_llama(tmp_path_factory.mktemp("llama") / "model", LLAMA2_TOKENIZER)


def with_config(source: Path, dest: Path, **fields) -> Path:
    """A copy of folder ``source`` whose config.json has ``fields`` changed (None: the field removed)."""
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    config = {k: v for k, v in {**config, **fields}.items() if v is not None}
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


def overrides(folder: Path, out: Path) -> list:
    return [f"checkpoint_dir={folder}", f"data_dir={DATA_DIR}", f"output_dir={out}", *CPU_OVERRIDES]


def settings_refusal(folder: Path, out: Path) -> str:
    cfg = OmegaConf.merge(OmegaConf.load(REPO_ROOT / CONFIG), OmegaConf.from_dotlist(overrides(folder, out)))
    with pytest.raises(BadInput) as caught:
        read_settings(cfg)
    return str(caught.value)


@pytest.mark.parametrize(
    "fields, words",
    [
        (
            {"num_hidden_layers": 100000},
            "config.json says num_hidden_layers=100000 but the weight files (model.safetensors) hold 2 layers "
            '(model.layers.0 to model.layers.1; none of model.layers.2 to model.layers.99999): set "num_hidden_layers": '
            "2 in config.json",
        ),
        ({"num_hidden_layers": 0}, "config.json says num_hidden_layers=0, not a positive integer"),
        ({"hidden_size": -64}, "config.json says hidden_size=-64, not a positive integer"),
        (
            {"vocab_size": 10**12},
            "config.json says vocab_size=1000000000000 but model.safetensors holds model.embed_tokens.weight of shape "
            '[32000, 64], so the weights\' vocab_size is 32000: set "vocab_size": 32000 in config.json',
        ),
        (
            {"intermediate_size": 10**9},
            "config.json says intermediate_size=1000000000 but model.safetensors holds "
            "model.layers.0.mlp.gate_proj.weight of shape [128, 64]",
        ),
        (
            {"max_position_embeddings": 10**12},
            "config.json says max_position_embeddings=1000000000000, more than any model's (at most 16777216",
        ),
        # (a field left out: transformers' default 11008 would be built, and the weights then blamed on the config's
        # model section)
        ({"intermediate_size": None}, "config.json lacks the model's sizes (intermediate_size=None;"),
    ],
    ids=["100000-layers", "0-layers", "negative-width", "vocab-1e12", "mlp-1e9", "positions-1e12", "no-mlp-size"],
)
def test_config_json_sizes_are_checked_against_the_weights_first(llama, tmp_path, fields, words):
    """One line naming checkpoint_dir's config.json, the field and (where one shows it) the tensor, from the settings
    (before the data or the model is built: a test of the time would fail under load, so the
    order is what is asserted), and the same line from the eval's check."""
    folder = with_config(llama, tmp_path / "model", **fields)
    message = settings_refusal(folder, tmp_path / "out")
    assert message.startswith(f"checkpoint_dir={folder}: ") and words in message and "\n" not in message, message
    with pytest.raises(EvalInputError) as caught:
        check_checkpoint(folder)
    assert str(caught.value) == message


def test_the_recipe_refuses_before_the_data_is_built(llama, tmp_path):
    """`num_hidden_layers=100000` over the weights of 2 layers: one error line, exit 2 within seconds; nothing
    tokenized (no pack cache), no run folder."""
    folder = with_config(llama, tmp_path / "model", num_hidden_layers=100000)
    out, cache = tmp_path / "out", tmp_path / "cache"
    assert "num_hidden_layers=100000" in settings_refusal(folder, out)  # (the recipe would build it otherwise)
    run = run_here(out, *overrides(folder, out), f"pack_cache_dir={cache}", config=CONFIG, fast=False)
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.error.startswith(f"error: checkpoint_dir={folder}: config.json says num_hidden_layers=100000 but")
    assert not out.exists() and not cache.exists()


def test_weights_lacking_a_tensor_blame_the_folder_not_the_model_section(llama, tmp_path):
    """Sizes that agree, but a weight file without one tensor: the loader's refusal names the folder's config.json
    (the model is the one it describes), not the config's model section, which plays no part with checkpoint_dir."""
    folder = with_config(llama, tmp_path / "model")
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    run = run_here(tmp_path / "out", *overrides(folder, tmp_path / "out"), config=CONFIG, fast=False)
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.error.startswith(
        f"error: the weights in {folder} do not fit the model {folder / 'config.json'} describes ("
    )
    assert "layers.1.mlp.w3.weight" in run.error and "model section" not in run.error


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"moe_intermediate_size": 48}, "config.json says moe_intermediate_size=48 but"),
        ({"num_local_experts": 16}, "config.json says num_local_experts=16 but"),  # (as transformers 5 writes it)
        ({"num_local_experts": None, "num_experts": 16}, "config.json says num_experts=16 but"),  # (as published)
    ],
    ids=["expert-width", "expert-count", "expert-count-published"],
)
def test_a_mixture_of_experts_sizes_are_checked_against_its_experts(tmp_path, fields, words):
    """The experts' width and count are read off the router's and the experts' headers, as the dense sizes are."""
    bpe = support.train_bpe(support.alpaca_texts(DATA_DIR, 200), support.TOY_BPE_SIZE)
    source = tmp_path / "moe"
    support.make_checkpoint(source, support.TOYS["qwen3_moe_30b"], bpe)
    folder = with_config(source, tmp_path / "model", **fields)
    with pytest.raises(EvalInputError) as caught:
        check_checkpoint(folder)
    assert str(caught.value).startswith(f"checkpoint_dir={folder}: ") and words in str(caught.value), caught.value
    check_checkpoint(source)  # (the folder as written passes)
