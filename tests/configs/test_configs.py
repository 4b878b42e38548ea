"""Every YAML in configs/ loads, resolves and names importable components; the fine-tune
configs also instantiate their parts (the 7B model on the meta device, no weights needed)."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import config, training
from torchtune.config._utils import _get_component_from_path

import support
from conftest import DATA_DIR, LLAMA2_TOKENIZER, REPO_ROOT

ALL_CONFIGS = sorted(p.relative_to(REPO_ROOT) for p in (REPO_ROOT / "configs").rglob("*.yaml"))
FINETUNE_CONFIGS = [p for p in ALL_CONFIGS if "full_finetune_single_device" in (REPO_ROOT / p).read_text()]


def components(node, where=""):
    if OmegaConf.is_dict(node):
        if "_component_" in node and node._component_:
            yield where, node._component_
        for key, value in node.items():
            yield from components(value, f"{where}.{key}" if where else str(key))
    elif OmegaConf.is_list(node):
        for i, value in enumerate(node):
            yield from components(value, f"{where}[{i}]")


def load(path: Path, tmp_path: Path):
    cfg = OmegaConf.load(REPO_ROOT / path)
    overrides = {"data_dir": str(DATA_DIR), "output_dir": str(tmp_path / "out")}
    if cfg.get("checkpoint_dir") is not None and "tokenizer" in cfg:
        # The 7B config reads the tokenizer from the (absent) checkpoint folder: stand one in (Llama 2's
        # tokenizer.model; for the other families, support.py's stand-in tokenizer of the family).
        fake = tmp_path / "ckpt"
        fake.mkdir()
        (fake / "tokenizer.model").symlink_to(LLAMA2_TOKENIZER)
        if str(cfg.tokenizer.get("path", "")).endswith("tokenizer.json"):
            toy = next(t for t in support.TOYS.values() if t.key.split("_")[0] in str(path))
            support.write_tokenizer(fake, toy, support.train_bpe(support.alpaca_texts(DATA_DIR, 200), 512))
        overrides["checkpoint_dir"] = str(fake)
    return OmegaConf.merge(cfg, {k: v for k, v in overrides.items() if k in cfg})


def test_found_the_configs():
    assert Path("configs/tiny.yaml") in FINETUNE_CONFIGS
    assert Path("configs/llama2/7B_full.yaml") in FINETUNE_CONFIGS


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=str)
def test_config_loads_and_components_import(path, tmp_path):
    cfg = load(path, tmp_path)
    OmegaConf.to_container(cfg, resolve=True)  # every ${...} resolves
    for where, component in components(cfg):
        assert callable(_get_component_from_path(component)), f"{path}: {where}._component_={component}"


@pytest.mark.parametrize("path", FINETUNE_CONFIGS, ids=str)
def test_finetune_config_instantiates(path, tmp_path):
    from finetune.optimizer import resolve_optimizer

    cfg = load(path, tmp_path)
    header = (REPO_ROOT / path).read_text().split("\n\n")[0]
    assert f"--config {path}" in header, "the header comment gives the launch command"

    tokenizer = config.instantiate(cfg.tokenizer)
    assert tokenizer.vocab_size == 32000 or "tokenizer.json" in str(cfg.tokenizer.path)  # (the stand-in's size)
    # The recipe builds the samples unpacked and packs them itself (finetune/data/packing.py) when dataset.packed=True.
    assert cfg.dataset.get("packed", False) in (True, False)
    dataset = config.instantiate(OmegaConf.merge(cfg.dataset, {"packed": False}), tokenizer)
    assert len(dataset) == 52002 and len(dataset[0]["tokens"]) > 0

    dtype = training.get_dtype(cfg.dtype, device=torch.device("cpu"))
    with training.set_default_dtype(dtype), torch.device("meta"):
        model = config.instantiate(cfg.model)
    assert model.tok_embeddings.weight.shape[0] >= tokenizer.vocab_size

    loss = config.instantiate(cfg.loss)
    params = [torch.nn.Parameter(torch.zeros(4, 4, dtype=dtype))]
    optimizer = resolve_optimizer(cfg.optimizer).build(params)
    scheduler = config.instantiate(cfg.lr_scheduler, optimizer, num_training_steps=100)
    assert scheduler.get_last_lr()[0] >= 0 and loss.ignore_index == -100
    _get_component_from_path(cfg.metric_logger._component_)


def test_7b_config_is_the_real_job(tmp_path):
    cfg = load(Path("configs/llama2/7B_full.yaml"), tmp_path)
    assert cfg.model._component_ == "torchtune.models.llama2.llama2_7b"
    assert (cfg.batch_size, cfg.epochs, cfg.dtype) == (16, 1, "bf16")
    assert cfg.enable_activation_checkpointing is True
    assert cfg.optimizer._component_ == "torch.optim.AdamW" and cfg.optimizer.fused is True
