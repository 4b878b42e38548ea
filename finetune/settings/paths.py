"""The paths a run reads, checked before anything is built: the tokenizer file, the dataset's local files,
``checkpoint_dir`` (an HF model folder) and ``resume_from_checkpoint``."""

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from finetune.base import BadInput, hf_weight_files
from finetune.checkpoint.checkpointer import RECIPE_STATE_FILE
from finetune.checkpoint.hf_format import WEIGHTS_FILE

# Loaders of HF `datasets` that read local files named in `data_files`.
LOCAL_DATASET_SOURCES = ("json", "csv", "parquet", "text", "arrow")


def _fix_for(cfg: DictConfig, section: str, key: str, what: str) -> str:
    """The fix for a missing file: name the key the user actually sets (the folder the path is built from, if any)."""
    node = cfg.get(section)
    raw = str(OmegaConf.to_container(node, resolve=False).get(key, "")) if OmegaConf.is_dict(node) else ""
    if "${data_dir}" in raw:
        return f"set data_dir=DIR (the folder holding {what}, e.g. ../shared/data)"
    if "${checkpoint_dir}" in raw:
        return f"set checkpoint_dir=DIR (the HF model folder, which holds {Path(raw).name})"
    return f"set {section}.{key}=FILE"


def dataset_files(cfg: DictConfig, section: str, node: DictConfig) -> list:
    """The local files a dataset section (``node``, the config's ``section``: dataset or dataset_val) reads, each
    checked to exist; [] for a hub dataset."""
    source = node.get("source")
    if source not in LOCAL_DATASET_SOURCES:
        return []
    files = node.get("data_files")
    if files is None:
        raise BadInput(f"{section}.source={source} needs {section}.data_files=FILE")
    if isinstance(files, str):
        files = [files]
    elif OmegaConf.is_dict(files):
        files = [f for v in files.values() for f in ([v] if isinstance(v, str) else v)]
    data_files = [str(f) for f in files]
    for f in data_files:
        if not Path(f).is_file():
            raise BadInput(
                f"{section}.data_files={f} does not exist; "
                + _fix_for(cfg, section, "data_files", "alpaca/alpaca_data.json")
                + f", or take Alpaca from the hub with {section}.source=tatsu-lab/alpaca ~{section}.data_files"
            )
    return data_files


def tokenizer_file(cfg: DictConfig) -> Path:
    """``tokenizer.path``, which must be set and exist."""
    if cfg.tokenizer.get("path") is None:
        raise BadInput(
            "tokenizer.path is not set: the tokenizer's file is required; set tokenizer.path=FILE (the model's "
            "tokenizer.model or tokenizer.json), or keep the config file's"
        )
    tok = Path(cfg.tokenizer.path)
    if not tok.is_file():
        raise BadInput(
            f"tokenizer.path={tok} does not exist; "
            + _fix_for(cfg, "tokenizer", "path", "llama2_tokenizer/tokenizer.model")
        )
    return tok


def checkpoint_folders(cfg: DictConfig) -> tuple:
    """(checkpoint_dir, resume_from_checkpoint), each None or a folder that exists and holds what it must."""
    ckpt = cfg.get("checkpoint_dir")
    checkpoint_dir = Path(ckpt) if ckpt else None
    if checkpoint_dir is not None and (not checkpoint_dir.is_dir() or not hf_weight_files(checkpoint_dir)):
        raise BadInput(
            f"checkpoint_dir={ckpt} is not a folder with HF weights (*.safetensors or pytorch_model*.bin); "
            "point it at the downloaded model (e.g. Llama-2-7b-hf), or set checkpoint_dir=null for random "
            "init"
        )
    resume = cfg.get("resume_from_checkpoint")
    resume_dir = Path(resume) if resume else None
    if resume_dir is not None:
        missing = [f for f in (WEIGHTS_FILE, RECIPE_STATE_FILE) if not (resume_dir / f).is_file()]
        if missing:
            raise BadInput(
                f"resume_from_checkpoint={resume} lacks {', '.join(missing)}; point it at a step_N or "
                "epoch_E folder this recipe wrote (or use checkpoint_dir=... to start a new run from its "
                "weights)"
            )
    return checkpoint_dir, resume_dir
