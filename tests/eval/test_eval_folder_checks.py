"""recipes/evaluate.py checks a folder's config.json against its weight files before anything is built: the layer
count from the tensors' names, the sizes from their shapes, read from the safetensors headers (finetune/weight_shapes.py,
the fine-tune recipes' check too).
Each refusal is one ``error:`` line naming the file at fault (config.json, or the weight file holding the odd tensor),
both values and the fix, with exit status 2.

Each case is asked of ``check_checkpoint`` first: where that check went missing, the recipe would go on to build
200,000 layers (minutes, tens of GB); asked first, the test fails at once instead. The folders are made by
transformers (tests/support.py): the tiny Llama with Llama 2's tokenizer.model, the same re-saved in two shards, and
a Qwen 2.5 toy with its tokenizer.json.
"""

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

import support
from conftest import DATA_DIR, EVAL_CONFIG, LLAMA2_TOKENIZER, eval_recipe_module
from eval.checkpoint import check_checkpoint
from eval.errors import EvalInputError

SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """2 layers of width 64, 4 heads of 16 (4 key/value heads), MLP 128, vocabulary 32,000."""
    return support.make_tiny_llama(tmp_path_factory.mktemp("llama") / "model", LLAMA2_TOKENIZER)


@pytest.fixture(scope="module")
def sharded(llama, tmp_path_factory) -> Path:
    """The tiny Llama in two shards: lm_head.weight in the first, the embedding and the layers in the second."""
    folder = tmp_path_factory.mktemp("sharded") / "model"
    assert support.make_sharded(llama, folder, "9MB") == SHARDS
    return folder


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    """A Qwen 2.5 toy (2 layers) with its tokenizer.json: AutoTokenizer reads this folder's config.json too."""
    folder = tmp_path_factory.mktemp("qwen2_5") / "model"
    bpe = support.train_bpe(support.alpaca_texts(DATA_DIR, 200), support.TOY_BPE_SIZE)
    support.make_checkpoint(folder, support.TOYS["qwen2_5_7b"], bpe)
    return folder


def with_config(source: Path, dest: Path, **fields) -> Path:
    """A copy of folder ``source`` whose config.json has ``fields`` changed."""
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, **fields}, indent=2))
    return dest


def refused(capsys, ckpt: Path) -> str:
    """The folder's one ``error:`` line: check_checkpoint refuses it (before anything is built), and the recipe, run
    as `tune run` calls it, prints that message as its one error line and exits 2 with no score."""
    with pytest.raises(EvalInputError) as caught:
        check_checkpoint(ckpt)
    capsys.readouterr()
    cfg = OmegaConf.merge(
        OmegaConf.load(EVAL_CONFIG),
        {"checkpoint_dir": str(ckpt), "data_dir": str(DATA_DIR), "device": "cpu", "limit": 1},
        {"output_dir": str(ckpt.parent / "eval")},
    )
    status = eval_recipe_module().recipe_main.__wrapped__(cfg)
    err = capsys.readouterr().err.strip()
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert status == 2 and errors == [f"error: {caught.value}"] and err.endswith(errors[0]), err[-2000:]
    assert not (ckpt.parent / "eval").exists()  # (no score)
    return errors[0]


def test_a_llama_config_of_200000_layers_over_the_weights_of_2(capsys, llama, tmp_path):
    """The old eval passed its checks and transformers built layers for minutes, memory rising, with no output."""
    err = refused(capsys, with_config(llama, tmp_path / "model", num_hidden_layers=200000))
    assert (
        "config.json says num_hidden_layers=200000 but the weight files (model.safetensors) hold 2 layers "
        "(model.layers.0 to model.layers.1; none of model.layers.2 to model.layers.199999): "
        'set "num_hidden_layers": 2 in config.json, or restore the config.json these weights were saved with' in err
    )


def test_a_qwen_config_of_200000_layers_blames_config_json_not_the_tokenizer(capsys, qwen, tmp_path):
    """The old eval refused this folder only when AutoTokenizer read its config.json, with a message (on two lines)
    that blamed tokenizer.json."""
    err = refused(capsys, with_config(qwen, tmp_path / "model", num_hidden_layers=200000))
    assert "config.json says num_hidden_layers=200000 but the weight files (model.safetensors) hold 2 layers" in err
    assert 'set "num_hidden_layers": 2 in config.json' in err and "tokenizer" not in err


def test_a_qwen_config_transformers_rejects_blames_config_json(capsys, qwen, tmp_path):
    """Sizes that fit the weights but a config.json transformers' validators reject (layer_types for 3 layers of 2):
    read as transformers reads it before the tokenizer is, so the message names config.json."""
    config = json.loads((qwen / "config.json").read_text())
    err = refused(capsys, with_config(qwen, tmp_path / "model", layer_types=config["layer_types"] * 2))
    assert "config.json is not a qwen2 config transformers accepts" in err and "layer_types" in err
    assert "restore the config.json the weights were saved with" in err and "tokenizer" not in err


@pytest.mark.parametrize(
    "field, said, message",
    [
        (
            "hidden_size",
            128,
            f"config.json says hidden_size=128 but {SHARDS[1]} holds model.embed_tokens.weight of shape [32000, 64], "
            'so the weights\' hidden_size is 64: set "hidden_size": 64 in config.json',
        ),
        (
            "vocab_size",
            32064,
            f"config.json says vocab_size=32064 but {SHARDS[1]} holds model.embed_tokens.weight of shape [32000, 64], "
            'so the weights\' vocab_size is 32000: set "vocab_size": 32000 in config.json',
        ),
        (
            "intermediate_size",
            256,
            f"config.json says intermediate_size=256 but {SHARDS[1]} holds model.layers.0.mlp.gate_proj.weight of "
            'shape [128, 64], so the weights\' intermediate_size is 128: set "intermediate_size": 128 in config.json',
        ),
        (
            "num_key_value_heads",
            2,
            f"config.json says num_key_value_heads=2 (x head_dim 16 = 32 rows) but {SHARDS[1]} holds "
            "model.layers.0.self_attn.k_proj.weight of shape [64, 64], 4 key/value heads of 16: "
            'set "num_key_value_heads": 4 in config.json',
        ),
    ],
)
def test_a_size_of_config_json_against_the_shard_that_holds_it(capsys, sharded, tmp_path, field, said, message):
    """The old eval compared the embedding only (in words naming neither file's fix) and left the MLP width and the
    key/value heads to transformers' loader, after building the model."""
    err = refused(capsys, with_config(sharded, tmp_path / "model", **{field: said}))
    assert message in err, err


def test_a_tensor_of_another_model_names_its_shard(capsys, sharded, tmp_path):
    """config.json agrees with the embedding and layer 0, but the first shard's lm_head is of another width."""
    ckpt = Path(shutil.copytree(sharded, tmp_path / "model"))
    save_file({"lm_head.weight": torch.zeros(32000, 32)}, ckpt / SHARDS[0], metadata={"format": "pt"})
    err = refused(capsys, ckpt)
    assert (
        f"{SHARDS[0]} holds lm_head.weight of shape [32000, 32] but config.json's sizes make it [32000, 64]" in err
        and f"re-copy {SHARDS[0]}" in err
    )


class _Planted:
    """Unpickled, it runs ``touch MARKER``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickled_weights_file_with_code_is_refused_as_a_pickle(capsys, llama, tmp_path):
    """The old message said the file held a reference 'which a recipe state file never does': wrong words for a
    weights file, and no way out. Now: the file is a pickle, the eval does not unpickle it, and what to do."""
    ckpt = Path(shutil.copytree(llama, tmp_path / "model"))
    marker = tmp_path / "ran"
    torch.save({**load_file(ckpt / "model.safetensors"), "extra": _Planted(marker)}, ckpt / "pytorch_model.bin")
    (ckpt / "model.safetensors").unlink()
    err = refused(capsys, ckpt)
    assert re.search(r"pytorch_model\.bin is a pickle that names (posix|os|nt)\.system besides tensors", err), err
    assert "never unpickles more of a file it is handed (there is no option to)" in err
    assert "use the model's weights as safetensors (model.safetensors" in err and "remove pytorch_model.bin" in err
    assert "recipe state file" not in err and "weights_only=False" not in err and not marker.exists()
