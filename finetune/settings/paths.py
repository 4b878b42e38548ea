"""The paths a run reads, checked before anything is built: the tokenizer file, the dataset's local files,
``checkpoint_dir`` (an HF model folder, whose config.json is read here once) and ``resume_from_checkpoint``."""

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from finetune.base import BadInput, hf_weight_files
from finetune.checkpoint.checkpointer import RECIPE_STATE_FILE
from finetune.checkpoint.hf_format import WEIGHTS_FILE, read_source_config

# Loaders of HF `datasets` that read local files named in `data_files`.
LOCAL_DATASET_SOURCES = ("json", "csv", "parquet", "text", "arrow")


def check_paths(cfg: DictConfig) -> dict:
    """The tokenizer file, the dataset's local files, checkpoint_dir and resume_from_checkpoint exist and look right."""

    def fix_for(section: str, key: str, what: str) -> str:
        # Name the key the user actually sets: the folder the path is built from, if any.
        raw = str(OmegaConf.to_container(cfg[section], resolve=False).get(key, ""))
        if "${data_dir}" in raw:
            return f"set data_dir=DIR (the folder holding {what}, e.g. ../shared/data)"
        if "${checkpoint_dir}" in raw:
            return f"set checkpoint_dir=DIR (the HF model folder, which holds {Path(raw).name})"
        return f"set {section}.{key}=FILE"

    tok = Path(cfg.tokenizer.path)
    if not tok.is_file():
        raise BadInput(
            f"tokenizer.path={tok} does not exist; " + fix_for("tokenizer", "path", "llama2_tokenizer/tokenizer.model")
        )

    source, data_files = cfg.dataset.get("source"), []
    if source in LOCAL_DATASET_SOURCES:
        files = cfg.dataset.get("data_files")
        if files is None:
            raise BadInput(f"dataset.source={source} needs dataset.data_files=FILE")
        if isinstance(files, str):
            files = [files]
        elif OmegaConf.is_dict(files):
            files = [f for v in files.values() for f in ([v] if isinstance(v, str) else v)]
        data_files = [str(f) for f in files]
        for f in data_files:
            if not Path(f).is_file():
                raise BadInput(
                    f"dataset.data_files={f} does not exist; "
                    + fix_for("dataset", "data_files", "alpaca/alpaca_data.json")
                    + ", or take Alpaca from the hub with dataset.source=tatsu-lab/alpaca ~dataset.data_files"
                )

    ckpt = cfg.get("checkpoint_dir")
    checkpoint_dir = Path(ckpt) if ckpt else None
    if checkpoint_dir is not None and (not checkpoint_dir.is_dir() or not hf_weight_files(checkpoint_dir)):
        raise BadInput(
            f"checkpoint_dir={ckpt} is not a folder with HF weights (*.safetensors or pytorch_model*.bin); "
            "point it at the downloaded model (e.g. Llama-2-7b-hf), or set checkpoint_dir=null for random "
            "init"
        )
    source_config = read_source_config(checkpoint_dir)

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
    return dict(
        tokenizer_path=tok,
        data_files=data_files,
        checkpoint_dir=checkpoint_dir,
        resume_dir=resume_dir,
        source_config=source_config,
    )
