"""Every YAML in configs/ loads, resolves and names importable components; the fine-tune
configs also instantiate their parts (the 7B model on the meta device, no weights needed)."""

import importlib.util
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
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


def test_every_config_writes_into_an_output_folder_of_its_own():
    """Two configs of one default output_dir would meet each other's runs there (a resume, the run folder's refusal)
    when a user runs both as given; the 16 GB FP8 configs of two families once named their 32 GB twins' folder."""
    owners = {}
    for path in FINETUNE_CONFIGS:
        output_dir = yaml.safe_load((REPO_ROOT / path).read_text()).get("output_dir")
        if output_dir is not None:
            owners.setdefault(output_dir, []).append(str(path))
    assert {d: paths for d, paths in owners.items() if len(paths) > 1} == {}


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


# -- the FP8 twins ---------------------------------------------------------------------------------------------------

CLASS_CONFIGS = sorted(p for p in ALL_CONFIGS if re.fullmatch(r"\w+_full_\d+gb", p.stem))


def twin(path: Path) -> Path:
    return path.with_name(f"{path.stem}_fp8.yaml")


def load_generator():
    """configs/generate.py, the script that writes the twins (run by path, as a user runs it: not a package)."""
    spec = importlib.util.spec_from_file_location("generate", REPO_ROOT / "configs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATOR = load_generator()
TWINNED = [p for p in CLASS_CONFIGS if str(p.relative_to("configs")) not in GENERATOR.NO_TWIN]


def test_every_memory_class_config_has_a_generated_fp8_twin():
    """Each class config has a row in the generator's table, so each has a twin, or stands in its NO_TWIN with the
    reason."""
    assert not set(GENERATOR.TWINS) & set(GENERATOR.NO_TWIN)
    assert sorted(Path("configs") / name for name in (*GENERATOR.TWINS, *GENERATOR.NO_TWIN)) == CLASS_CONFIGS
    assert not [p for p in CLASS_CONFIGS if p not in TWINNED and (REPO_ROOT / twin(p)).exists()]


@pytest.mark.parametrize("path", TWINNED, ids=str)
def test_a_committed_fp8_twin_is_what_the_generator_writes(path):
    """``<size>_full_<class>_fp8.yaml`` is written by ``python configs/generate.py`` from its bf16 config and its row:
    a setting changed in the bf16 config (or the twin edited by hand) without running the generator fails here."""
    name = str(path.relative_to("configs"))
    committed = (REPO_ROOT / twin(path)).read_text()
    assert committed == GENERATOR.generate(name, GENERATOR.TWINS[name]), "run python configs/generate.py"


@pytest.mark.parametrize("path", TWINNED, ids=str)
def test_an_fp8_twin_differs_from_its_bf16_config_only_in_its_matmuls_and_its_own_settings(path):
    """The same run with FP8 matmuls and FlashAttention's varlen kernel, written to its own output folder, and nothing
    else changed but the settings of the twin's row (e.g. the 3B twins at 24 GiB recompute every other layer)."""
    bf16, fp8 = (OmegaConf.to_container(OmegaConf.load(REPO_ROOT / p)) for p in (path, twin(path)))
    assert fp8.pop("fp8") == "tensorwise" and fp8.pop("packed_attention") == "varlen"
    assert fp8.pop("output_dir") == bf16.pop("output_dir") + "-fp8"
    bf16.pop("fp8", None), bf16.pop("packed_attention", None)
    own = {
        key: yaml.safe_load(value)
        for key, (value, _) in GENERATOR.TWINS[str(path.relative_to("configs"))].settings.items()
    }
    assert {k: fp8.pop(k, None) for k in own} == own
    assert fp8 == bf16


def test_the_generator_check_names_a_stale_twin(tmp_path, monkeypatch, capsys):
    """``--check`` writes nothing and exits 1 naming the twin whose bf16 config changed."""
    shutil.copytree(REPO_ROOT / "configs", tmp_path / "configs", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(GENERATOR, "CONFIGS", tmp_path / "configs")
    assert GENERATOR.main(["--check"]) == 0
    source = tmp_path / "configs/qwen3/8B_full_32gb.yaml"
    source.write_text(source.read_text().replace("batch_size: 16", "batch_size: 8"))
    assert GENERATOR.main(["--check"]) == 1
    assert "configs/qwen3/8B_full_32gb_fp8.yaml" in capsys.readouterr().out
    assert "batch_size: 16" in (tmp_path / "configs/qwen3/8B_full_32gb_fp8.yaml").read_text()
    assert GENERATOR.main([]) == 0
    assert "batch_size: 8" in (tmp_path / "configs/qwen3/8B_full_32gb_fp8.yaml").read_text()


@pytest.mark.parametrize("path", [twin(p) for p in TWINNED], ids=str)
def test_an_fp8_twin_runs_on_fp8_tensor_cores_and_is_refused_before_them(path, monkeypatch):
    """On a GPU of compute capability 9.0 (a stand-in: there is none here) the twin's fp8 and packed_attention are
    accepted as written; an A100 (8.0) is told to use the bf16 config's matmuls, before any work."""
    from finetune.base import BadInput
    from finetune.model import attention
    from finetune.settings import read_fp8, read_packed_attention

    cfg = OmegaConf.load(REPO_ROOT / path)
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a test GPU")
    monkeypatch.setattr(attention, "varlen_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert read_fp8(cfg, cuda, compile_=cfg.compile) == "tensorwise"
    assert read_packed_attention(cfg, cuda, packed=cfg.dataset.packed) == "varlen"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(BadInput, match="compute capability 8.9 or later.*set fp8=null"):
        read_fp8(cfg, cuda, compile_=cfg.compile)


@pytest.mark.parametrize("path", [twin(p) for p in TWINNED if "llama2" not in str(p)], ids=str)
def test_an_fp8_twin_converts_the_query_output_and_mlp_projections_of_its_model(path):
    """The model the twin names, at its real shapes on the meta device, through the recipe's conversion: in every
    layer the query, output and MLP projections run in FP8; the grouped-query key/value projections (at most 1,024
    wide) stay bf16, and so do Qwen3's q/k norms, the embedding and the output layer (tied to the embedding in the 3B
    models). Qwen2.5's q bias stays on its (converted) projection, the same Parameter."""
    from torchao.float8.float8_linear import Float8Linear
    from torchtune.modules import RMSNorm, TiedLinear

    from finetune.model.prepare import convert_to_fp8

    cfg = OmegaConf.load(REPO_ROOT / path)
    with torch.device("meta"):
        model = config.instantiate(cfg.model)
    params = dict(model.named_parameters())
    assert convert_to_fp8(model, cfg.fp8) == 5 * len(model.layers)
    for layer in model.layers:
        attn, mlp = layer.attn, layer.mlp
        assert all(isinstance(m, Float8Linear) for m in (attn.q_proj, attn.output_proj, mlp.w1, mlp.w2, mlp.w3))
        assert type(attn.k_proj) is torch.nn.Linear and type(attn.v_proj) is torch.nn.Linear
        assert attn.k_proj.weight.shape[0] <= 1024
        assert (attn.q_proj.bias is not None) == ("qwen2_5" in str(path))
        if "qwen3" in str(path):
            assert isinstance(attn.q_norm, RMSNorm) and isinstance(attn.k_norm, RMSNorm)
    tied = cfg.model._component_.endswith("_3b")
    assert type(model.output) is (TiedLinear if tied else torch.nn.Linear)
    assert type(model.tok_embeddings) is torch.nn.Embedding
    assert dict(model.named_parameters()) == params  # the same Parameter objects: optimizer and checkpoint unchanged
