"""Check and load an HF-format Llama checkpoint folder and its SentencePiece tokenizer.

A checkpoint folder (docs/CONVENTIONS.md) holds config.json, model.safetensors (or shards and
model.safetensors.index.json) and a copy of tokenizer.model. Everything is checked before anything heavy is
loaded, so a partial or foreign checkpoint fails with one message that says what to change.
"""

import json
import os
import tempfile
from pathlib import Path

import sentencepiece
import torch
import transformers
from safetensors import safe_open

from eval.errors import EvalInputError
from finetune_base import BadInput, hf_weight_files

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
FIX_CHECKPOINT = "point checkpoint_dir at a finished checkpoint folder (the fine-tune recipe's {output_dir}/epoch_N or step_N, or any HF-format Llama folder)"


def check_checkpoint(checkpoint_dir, tokenizer_path=None) -> tuple[Path, Path]:
    """The checkpoint folder and its tokenizer.model, or an EvalInputError naming what is missing or wrong."""
    if checkpoint_dir in (None, "", "???"):
        raise EvalInputError(f"checkpoint_dir is not set: {FIX_CHECKPOINT}, e.g. checkpoint_dir=/tmp/tiny/epoch_0")
    ckpt = Path(checkpoint_dir)
    if not ckpt.is_dir():
        raise EvalInputError(f"checkpoint_dir={ckpt} does not exist: {FIX_CHECKPOINT}")

    config_file = ckpt / "config.json"
    if not config_file.is_file():
        raise EvalInputError(f"checkpoint_dir={ckpt} has no config.json (a partial or non-HF checkpoint): {FIX_CHECKPOINT}")
    try:
        config = json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EvalInputError(f"checkpoint_dir={ckpt}: config.json is not valid JSON ({e}) (a partial write?): {FIX_CHECKPOINT}")
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type != "llama":
        raise EvalInputError(
            f"checkpoint_dir={ckpt} holds a {model_type!r} model (config.json model_type); this eval takes "
            f"Llama-architecture checkpoints (model_type 'llama'): point checkpoint_dir at a Llama checkpoint"
        )

    for shard in _weight_files(ckpt):
        if shard.suffix != ".safetensors":
            continue  # a .bin pickle is opened only by transformers' loader, with weights_only=True
        try:
            with safe_open(str(shard), framework="pt"):
                pass
        except Exception as e:  # safetensors raises its own error type for truncated or garbled files
            raise EvalInputError(f"checkpoint_dir={ckpt}: weights file {shard.name} is unreadable ({e}) (a partial write?): {FIX_CHECKPOINT}")

    tokenizer = Path(tokenizer_path) if tokenizer_path else ckpt / "tokenizer.model"
    if not tokenizer.is_file():
        what = f"tokenizer_path={tokenizer} does not exist" if tokenizer_path else f"checkpoint_dir={ckpt} has no tokenizer.model"
        raise EvalInputError(f"{what}: set tokenizer_path=<data_dir>/llama2_tokenizer/tokenizer.model (or copy that file into the checkpoint)")
    try:
        tokenizer_vocab = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer)).vocab_size()
    except Exception as e:  # sentencepiece raises RuntimeError/OSError for anything it cannot parse
        raise EvalInputError(f"tokenizer {tokenizer} is not a SentencePiece model ({e}): set tokenizer_path=<data_dir>/llama2_tokenizer/tokenizer.model")
    if tokenizer_vocab > config.get("vocab_size", 0):
        raise EvalInputError(
            f"tokenizer {tokenizer} has {tokenizer_vocab} tokens but checkpoint_dir={ckpt} has vocab_size "
            f"{config.get('vocab_size')}: use the tokenizer the model was trained with (tokenizer_path=...)"
        )
    return ckpt, tokenizer


def _weight_files(ckpt: Path) -> list[Path]:
    """The folder's weight files by the recipes' one definition (finetune_base: safetensors, or
    pytorch_model*.bin, which transformers loads with weights_only=True), or an EvalInputError."""
    try:
        files = hf_weight_files(ckpt)
    except BadInput as e:
        raise EvalInputError(f"checkpoint_dir={ckpt}: {e}") from None
    if not files:
        raise EvalInputError(f"checkpoint_dir={ckpt} has no model.safetensors (nor its shards, nor "
                             f"pytorch_model*.bin; a partial checkpoint?): {FIX_CHECKPOINT}")
    return files


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise EvalInputError(f"device={device!r} is not a device name: use device=cpu, cuda, cuda:N or auto")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EvalInputError(f"device={device} but CUDA is not available here: use device=cpu (or auto)")
    return dev


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise EvalInputError(f"dtype={dtype!r} is not supported: use dtype=fp32 (exact) or dtype=bf16 (faster on GPU)")
    return DTYPES[dtype]


def load_model(ckpt: Path, device: torch.device, dtype: torch.dtype) -> transformers.LlamaForCausalLM:
    """The checkpoint's weights in eval mode on `device`; missing tensors are an error, not a random init."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # missing weights get our one-line error, not transformers' report too
    try:
        model, info = transformers.LlamaForCausalLM.from_pretrained(ckpt, dtype=dtype, output_loading_info=True)
    finally:
        transformers.logging.set_verbosity(verbosity)
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise EvalInputError(f"checkpoint_dir={ckpt} lacks {len(missing)} weights (e.g. {missing[:3]}) that config.json needs: {FIX_CHECKPOINT}")
    return model.to(device).eval()


def load_tokenizer(tokenizer_model: Path, add_bos: bool) -> transformers.PreTrainedTokenizerFast:
    """An HF fast tokenizer converted offline from the SentencePiece file; it encodes exactly as SentencePiece
    does, with BOS prepended when `add_bos` (see docs/eval.md, "BOS")."""
    with tempfile.TemporaryDirectory() as tmp:
        # from_pretrained converts a folder's tokenizer.model; a folder of its own keeps any tokenizer.json or
        # tokenizer_config.json beside the checkpoint from changing the result.
        os.symlink(Path(tokenizer_model).resolve(), Path(tmp) / "tokenizer.model")
        return transformers.PreTrainedTokenizerFast.from_pretrained(tmp, add_bos_token=add_bos, add_eos_token=False)
