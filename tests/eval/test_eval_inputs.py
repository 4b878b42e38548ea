"""recipes/evaluate.py on folders that are not what their config.json says: one ``error:`` line and exit status 2
each, before any score (and before transformers builds anything large).

- a config.json without the model's sizes: transformers would build its default Llama, 7B parameters in fp32
  (27 GB: killed for memory on a 24 GB host);
- weights of another width than config.json's (transformers' error is a table of every tensor);
- a shard named by model.safetensors.index.json outside the folder;
- a planted pytorch_model.bin (a pickle that runs code: torch's refusal would advise weights_only=False; the
  wording: tests/eval/test_eval_folder_checks.py);
- NaN weights (the score would be nan, with exit status 0).
"""

import json
import os
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


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return support.make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), LLAMA2_TOKENIZER)


def copy(checkpoint: Path, dest: Path) -> Path:
    return Path(shutil.copytree(checkpoint, dest))


def evaluate(capsys, ckpt: Path) -> str:
    """The eval recipe in this process, as `tune run` calls it; returns its one error line (asserting exit 2)."""
    cfg = OmegaConf.merge(
        OmegaConf.load(EVAL_CONFIG),
        {
            "checkpoint_dir": str(ckpt),
            "data_dir": str(DATA_DIR),
            "device": "cpu",
            "limit": 1,
            "output_dir": str(ckpt / "e"),
        },
    )
    status = eval_recipe_module().recipe_main.__wrapped__(cfg)
    err = capsys.readouterr().err.strip()
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert status == 2 and len(errors) == 1 and err.endswith(errors[0]), err[-2000:]
    assert not list((ckpt / "e").glob("results_*.json"))  # (no score)
    return errors[0]


def test_config_without_sizes_is_refused_before_building_a_model(checkpoint, tmp_path):
    """(Checked on check_checkpoint itself: where the sizes are missing, the old code went on to build 7B in fp32.)"""
    ckpt = copy(checkpoint, tmp_path / "epoch_0")
    config = json.loads((ckpt / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers"):
        config.pop(key)
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        EvalInputError,
        match=r"config.json lacks the model's sizes \(hidden_size=None, "
        r"num_hidden_layers=None; .*default 7B model",
    ):
        check_checkpoint(ckpt)


def test_weights_of_another_width(capsys, checkpoint, tmp_path):
    ckpt = copy(checkpoint, tmp_path / "epoch_0")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "hidden_size": 128, "head_dim": 32}))
    err = evaluate(capsys, ckpt)
    assert (
        "config.json says hidden_size=128 but model.safetensors holds model.embed_tokens.weight of shape [32000, 64]"
        in err
    )


def test_a_shard_outside_the_folder(capsys, checkpoint, tmp_path):
    ckpt = copy(checkpoint, tmp_path / "epoch_0")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (ckpt / "model.safetensors").rename(elsewhere / "model-00001-of-00001.safetensors")
    names = load_file(elsewhere / "model-00001-of-00001.safetensors")
    (ckpt / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "../elsewhere/model-00001-of-00001.safetensors" for k in names}})
    )
    err = evaluate(capsys, ckpt)
    assert "names weight files outside" in err and "../elsewhere/model-00001-of-00001.safetensors" in err


class _Planted:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_pytorch_model_bin(capsys, checkpoint, tmp_path):
    ckpt = copy(checkpoint, tmp_path / "epoch_0")
    tensors = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    marker = tmp_path / "ran"
    torch.save({**tensors, "extra": _Planted(marker)}, ckpt / "pytorch_model.bin")
    err = evaluate(capsys, ckpt)
    assert "pytorch_model.bin is a pickle that names" in err and "refused" in err
    assert "weights_only=False" not in err and not marker.exists()


def test_nan_weights_are_an_error_not_a_score(capsys, checkpoint, tmp_path):
    ckpt = copy(checkpoint, tmp_path / "epoch_0")
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    err = evaluate(capsys, ckpt)
    assert "holds non-finite weights (model.layers.1.mlp.down_proj.weight has NaN or inf)" in err
