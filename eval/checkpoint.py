"""Check and load an HF-format checkpoint folder and its tokenizer.

A checkpoint folder (docs/CONVENTIONS.md) holds config.json, model.safetensors (or shards and
model.safetensors.index.json) and the tokenizer: Llama 2's SentencePiece tokenizer.model, or the tokenizer.json and
tokenizer_config.json of the other families (Llama 3.x, Qwen 2.5 / 3, Mistral). Everything is checked before
anything heavy is loaded, so a partial or foreign checkpoint fails with one message that says what to change: a
config.json without the model's sizes (transformers would build its default 7B model in fp32), sizes (the layer count
included) that are not those of the weight files (finetune/weight_shapes.py reads them from the files' headers, for
the fine-tune recipes too: a config.json of 200,000 layers over the weights of 2 is refused before transformers builds
anything), a shard named
outside the folder, a pytorch_model.bin that holds anything but tensors, and, once loaded, non-finite weights.
"""

import json
import os
import tempfile
from pathlib import Path

import sentencepiece
import torch
import transformers

from eval.errors import EvalInputError
from finetune.base import BadInput, hf_weight_files
from finetune.weight_shapes import check_folder

# The model_types of the fine-tune recipes' families (finetune/checkpoint/hf_format.py FAMILIES; a test holds the two together):
# transformers' AutoModelForCausalLM loads each.
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
FIX_CONFIG = "restore the config.json the weights were saved with"
FIX_CHECKPOINT = "point checkpoint_dir at a finished checkpoint folder (the fine-tune recipe's {output_dir}/epoch_N or step_N, or any HF-format folder of a supported family)"


def check_checkpoint(checkpoint_dir, tokenizer_path=None) -> tuple[Path, Path]:
    """The checkpoint folder and its tokenizer.model, or an EvalInputError naming what is missing or wrong."""
    if checkpoint_dir in (None, "", "???"):
        raise EvalInputError(f"checkpoint_dir is not set: {FIX_CHECKPOINT}, e.g. checkpoint_dir=/tmp/tiny/epoch_0")
    ckpt = Path(checkpoint_dir)
    if not ckpt.is_dir():
        raise EvalInputError(f"checkpoint_dir={ckpt} does not exist: {FIX_CHECKPOINT}")

    config_file = ckpt / "config.json"
    if not config_file.is_file():
        raise EvalInputError(
            f"checkpoint_dir={ckpt} has no config.json (a partial or non-HF checkpoint): {FIX_CHECKPOINT}"
        )
    try:
        config = json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EvalInputError(
            f"checkpoint_dir={ckpt}: config.json is not valid JSON ({e}) (a partial write?): {FIX_CHECKPOINT}"
        )
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in MODEL_TYPES:
        raise EvalInputError(
            f"checkpoint_dir={ckpt} holds a {model_type!r} model (config.json model_type); this eval takes "
            f"model_type {' or '.join(repr(t) for t in MODEL_TYPES)} checkpoints: point checkpoint_dir at one of those"
        )
    # The sizes (there, positive, bounded) and against the weight files' headers, then config.json as transformers
    # reads it, both before anything is built or the tokenizer is loaded (AutoTokenizer reads config.json too, and
    # would blame tokenizer.json). The check is the fine-tune recipes' own, so the two refuse the same folders.
    files = _weight_files(ckpt)
    try:
        check_folder(ckpt, config, files, FIX_CHECKPOINT)
    except BadInput as e:
        raise EvalInputError(str(e)) from None
    try:
        transformers.AutoConfig.from_pretrained(ckpt)
    except Exception as e:  # transformers' validators raise ValueError, TypeError, its own StrictDataclass errors
        raise EvalInputError(
            f"checkpoint_dir={ckpt}: config.json is not a {model_type} config transformers accepts "
            f"({' '.join(str(e).split())[:300]}): {FIX_CONFIG}"
        ) from None

    tokenizer = Path(tokenizer_path) if tokenizer_path else _tokenizer_file(ckpt)
    if not tokenizer.is_file():
        what = (
            f"tokenizer_path={tokenizer} does not exist"
            if tokenizer_path
            else f"checkpoint_dir={ckpt} has no tokenizer.model (nor tokenizer.json)"
        )
        raise EvalInputError(
            f"{what}: set tokenizer_path= the model's tokenizer.json, or <data_dir>/llama2_tokenizer/tokenizer.model for Llama 2 (or copy it into the checkpoint)"
        )
    if tokenizer.suffix == ".json":
        try:
            tokenizer_vocab = len(load_tokenizer(tokenizer, add_bos=False))
        except Exception as e:  # tokenizers and transformers raise several types for a file they cannot read
            raise EvalInputError(
                f"tokenizer {tokenizer} is not a Hugging Face tokenizer.json ({' '.join(str(e).split())[:200]}): copy the model's tokenizer.json and tokenizer_config.json into the checkpoint"
            )
    else:
        try:
            tokenizer_vocab = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer)).vocab_size()
        except Exception as e:  # sentencepiece raises RuntimeError/OSError for anything it cannot parse
            raise EvalInputError(
                f"tokenizer {tokenizer} is not a SentencePiece model ({e}): set tokenizer_path=<data_dir>/llama2_tokenizer/tokenizer.model"
            )
    if tokenizer_vocab > config.get("vocab_size", 0):
        raise EvalInputError(
            f"tokenizer {tokenizer} has {tokenizer_vocab} tokens but checkpoint_dir={ckpt} has vocab_size "
            f"{config.get('vocab_size')}: use the tokenizer the model was trained with (tokenizer_path=...)"
        )
    return ckpt, tokenizer


def _tokenizer_file(ckpt: Path) -> Path:
    """The folder's tokenizer: a SentencePiece tokenizer.model (Llama 2) if it has one, else tokenizer.json."""
    sentencepiece_model = ckpt / "tokenizer.model"
    return (
        sentencepiece_model
        if sentencepiece_model.is_file() or not (ckpt / "tokenizer.json").is_file()
        else ckpt / "tokenizer.json"
    )


def _weight_files(ckpt: Path) -> list[Path]:
    """The folder's weight files by the recipes' one definition (finetune.base: safetensors, or
    pytorch_model*.bin, which transformers loads with weights_only=True), or an EvalInputError."""
    try:
        files = hf_weight_files(ckpt)
    except BadInput as e:
        raise EvalInputError(f"checkpoint_dir={ckpt}: {e}") from None
    if not files:
        raise EvalInputError(
            f"checkpoint_dir={ckpt} has no model.safetensors (nor its shards, nor "
            f"pytorch_model*.bin; a partial checkpoint?): {FIX_CHECKPOINT}"
        )
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


def load_model(ckpt: Path, device: torch.device, dtype: torch.dtype) -> transformers.PreTrainedModel:
    """The checkpoint's weights in eval mode on `device` (the class config.json's model_type names, as lm-eval's
    `hf` path loads it); missing tensors, tensors of other shapes and non-finite values are errors, not a score."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # missing weights get our one-line error, not transformers' report too
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, output_loading_info=True)
    except (RuntimeError, ValueError, OSError) as e:  # e.g. a shard's tensor of another shape than config.json's
        raise EvalInputError(
            f"checkpoint_dir={ckpt} does not load ({' '.join(str(e).split())[:300]}): {FIX_CHECKPOINT}"
        ) from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise EvalInputError(
            f"checkpoint_dir={ckpt} lacks {len(missing)} weights (e.g. {missing[:3]}) that config.json needs: {FIX_CHECKPOINT}"
        )
    bad = next((name for name, p in model.named_parameters() if not torch.isfinite(p).all()), None)
    if bad is not None:
        raise EvalInputError(
            f"checkpoint_dir={ckpt} holds non-finite weights ({bad} has NaN or inf): the run that wrote it "
            "diverged; evaluate an earlier checkpoint (step_N), or resume that run with a lower optimizer.lr"
        )
    return model.to(device).eval()


def load_tokenizer(tokenizer_file: Path, add_bos: bool) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer lm-eval's `hf` path would load for the folder, built offline.

    tokenizer.json: transformers' AutoTokenizer on its folder, exactly as lm-eval loads a checkpoint folder (the
    class comes from tokenizer_config.json and config.json's model_type: Qwen2Tokenizer for Qwen), with
    `add_bos_token` passed as lm-eval passes it. A SentencePiece tokenizer.model (Llama 2): an HF fast tokenizer
    converted offline from the file alone; it encodes exactly as SentencePiece does, with BOS prepended when
    `add_bos` (see docs/eval.md, "BOS")."""
    tokenizer_file = Path(tokenizer_file)
    if tokenizer_file.suffix == ".json":
        return transformers.AutoTokenizer.from_pretrained(tokenizer_file.parent, add_bos_token=add_bos)
    tokenizer_model = tokenizer_file
    with tempfile.TemporaryDirectory() as tmp:
        # from_pretrained converts a folder's tokenizer.model; a folder of its own keeps any tokenizer.json or
        # tokenizer_config.json beside the checkpoint from changing the result.
        os.symlink(Path(tokenizer_model).resolve(), Path(tmp) / "tokenizer.model")
        return transformers.PreTrainedTokenizerFast.from_pretrained(tmp, add_bos_token=add_bos, add_eos_token=False)
