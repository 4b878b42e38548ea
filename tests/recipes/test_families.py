"""Every model family on the fine-tune recipe, each on a toy model of its architecture.

The toys are tests/support.py's, saved by transformers as a user saves a model: each family's real config.json with
2 layers of width 64 (4 query heads in 2 key/value groups; Qwen3 with head_dim 32, not 64 / 4; Qwen3-MoE with 8
experts of 32, 2 per token), the family's RoPE, tying and biases, random values, and a 1,024-token byte-level BPE trained here on Alpaca, saved as the family's
tokenizer.json and tokenizer_config.json (special tokens, chat template). Per family:

- the HF round trip in both directions: transformers' checkpoint into our torchtune model, and our written folder
  into transformers, with the same logits (fp32: 1e-5; bf16: bf16's resolution, but for the mixture of experts, whose
  routing near-ties two implementations may break otherwise in bf16: the written bf16 values' fp32 logits, 1e-5),
  config.json naming the right class, tying, RoPE scaling and dtype;
- a packed fine-tune on a chat dataset (OpenAI messages, the family's chat template) against recorded losses, and
  its resume from step_3 continuing with the same losses;
- the saved checkpoint evaluated by recipes/evaluate.py with the score lm-eval's own `hf` path gives on that folder.

The twelve fine-tunes run in one subprocess (``python tests/support.py``, its run_batch), started with conftest's pinned environment (the
recorded losses need it), so torch and torchtune are imported once, not twelve times. Everything else runs in this
process. About 55 s on 2 cores.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from omegaconf import OmegaConf

import support
from conftest import DATA_DIR, EVAL_CONFIG, REPO_ROOT, TINY_CONFIG, eval_recipe_module, read_metrics, recipe_env
from finetune.checkpoint import hf_format

RTOL = 1e-4
FINETUNED = ["llama3_1_8b", "llama3_2_3b", "qwen2_5_7b", "qwen3_8b", "mistral_7b", "qwen3_moe_30b"]
ROUND_TRIP = FINETUNED + ["qwen2_5_3b"]  # Qwen 2.5's small sizes tie their embeddings

# Recorded from the runs below (6 steps of 2 packed rows of 256 tokens, torch AdamW at lr 1e-2 with clipping, fp32)
# with conftest's pinned environment on one thread: (losses, trained tokens per step).
RECORDED = {
    "llama3_1_8b": (
        [
            6.9760026931762695,
            6.7641682624816895,
            6.6657795906066895,
            6.30583381652832,
            6.279289722442627,
            6.3631696701049805,
        ],
        [424, 308, 387, 187, 318, 442],
    ),
    "llama3_2_3b": (
        [
            7.028775691986084,
            6.906717777252197,
            6.671886920928955,
            6.260674953460693,
            6.263761520385742,
            6.404506206512451,
        ],
        [424, 308, 387, 187, 318, 442],
    ),
    "qwen2_5_7b": (
        [
            7.044110298156738,
            6.918975353240967,
            6.706796646118164,
            6.623137950897217,
            6.309818267822266,
            6.4032673835754395,
        ],
        [300, 225, 411, 367, 327, 356],
    ),
    "qwen3_8b": (
        [
            7.057321071624756,
            6.997349262237549,
            6.6935133934021,
            6.552544116973877,
            6.382091999053955,
            6.414689540863037,
        ],
        [300, 246, 427, 372, 332, 366],
    ),
    "mistral_7b": (
        [
            6.976432800292969,
            6.917613983154297,
            6.622755527496338,
            6.48940372467041,
            6.3842902183532715,
            6.433936595916748,
        ],
        [406, 237, 422, 281, 422, 300],
    ),
    # (the loss trained: cross-entropy + 0.001 x the load-balancing loss; Qwen3's tokenizer, so Qwen3's tokens)
    "qwen3_moe_30b": (
        [
            7.006186485290527,
            6.961615562438965,
            6.596314430236816,
            6.555429935455322,
            6.321135997772217,
            6.392730236053467,
        ],
        [300, 246, 427, 372, 332, 366],
    ),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The toy models run faster on one thread than on two (this module's tests run in one pytest worker)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build_model(spec, hf, dtype=torch.float32):
    """Our torchtune model for config.json ``hf``, built as the recipe builds it (the spec's sizes builder)."""
    from torchtune import config, training

    cfg = OmegaConf.from_dotlist(support.model_overrides(spec, hf))
    with training.set_default_dtype(dtype):
        return config.instantiate(cfg.model)


@pytest.fixture(scope="module")
def bpe():
    return support.train_bpe(support.alpaca_texts(DATA_DIR, 2000), support.TOY_BPE_SIZE)


@pytest.fixture(scope="module")
def sources(tmp_path_factory, bpe):
    """Each family's toy HF checkpoint, made by transformers: {key: (folder, config.json)}."""
    root = tmp_path_factory.mktemp("sources")
    return {key: (root / key, support.make_checkpoint(root / key, support.TOYS[key], bpe)) for key in ROUND_TRIP}


def chat_file(path: Path, n: int = 48) -> Path:
    """Conversations in OpenAI's format from the first Alpaca records; every third one has a second turn."""
    records = json.loads((DATA_DIR / "alpaca" / "alpaca_data.json").read_text())[: n + n // 3]
    turns = [
        [
            {"role": "user", "content": r["instruction"] + (f"\n\n{r['input']}" if r["input"] else "")},
            {"role": "assistant", "content": r["output"]},
        ]
        for r in records
    ]
    conversations, it = [], iter(turns)
    for i, turn in zip(range(n), it):
        conversations.append(turn + (next(it) if i % 3 == 2 else []))
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


def finetune_args(key, source, hf, data, out, cache, *extra):
    spec = support.TOYS[key]
    return [
        "--config",
        TINY_CONFIG,
        f"data_dir={DATA_DIR}",
        f"output_dir={out}",
        f"checkpoint_dir={source}",
        "metric_logger=null",
        "batch_size=2",
        "max_steps_per_epoch=6",
        "optimizer.lr=1e-2",
        "lr_scheduler.num_warmup_steps=0",
        "save_every_n_steps=3",
        f"pack_cache_dir={cache}",
        "tokenizer._component_=finetune.data.HFTokenizer",
        f"tokenizer.path={source / 'tokenizer.json'}",
        "~tokenizer.prompt_template",
        "tokenizer.max_seq_len=256",
        "tokenizer.chat_template=True",
        "dataset._component_=torchtune.datasets.chat_dataset",
        f"dataset.data_files={data}",
        "dataset.conversation_column=messages",
        "dataset.conversation_style=openai",
        "dataset.train_on_input=False",
        "dataset.packed=True",
        *support.model_overrides(spec, hf),
        *extra,
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sources):
    """Per family, a 6-step packed chat fine-tune saving step_3, and a resume from that step_3: one process."""
    root = tmp_path_factory.mktemp("runs")
    data, cache = chat_file(root / "chat.jsonl"), root / "pack_cache"
    batch = []
    for key in FINETUNED:
        source, hf = sources[key]
        batch.append(finetune_args(key, source, hf, data, root / key / "full", cache))
        batch.append(
            finetune_args(
                key,
                source,
                hf,
                data,
                root / key / "resumed",
                cache,
                f"resume_from_checkpoint={root / key / 'full' / 'step_3'}",
            )
        )
    spec_file = root / "runs.json"
    spec_file.write_text(json.dumps(batch))
    # One thread: at these sizes a second one costs more in handing work over than it computes (and the recorded
    # losses are of one thread's summation order).
    proc = subprocess.run(
        [sys.executable, support.__file__, str(spec_file)],
        cwd=REPO_ROOT,
        env=recipe_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == json.dumps([0] * len(batch)), (
        proc.stdout + proc.stderr
    )[-4000:]
    return {
        key: (read_metrics(root / key / "full"), read_metrics(root / key / "resumed"), root / key / "full")
        for key in FINETUNED
    }


# -- the HF round trip --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ROUND_TRIP)
def test_hf_round_trip(key, sources, tmp_path):
    spec, (source, hf) = support.TOYS[key], sources[key]
    family = hf_format.family_of(support.model_overrides(spec, hf)[0].split("=", 1)[1])
    assert family.name == spec.family and family.model_type == hf["model_type"]
    tokens = torch.randint(0, hf["vocab_size"], (2, 23), generator=torch.Generator().manual_seed(0))

    # transformers' checkpoint -> our model (fp32)
    ours = build_model(spec, hf)
    ours_hf = hf_format.hf_config(ours, torch.float32, hf, family)
    hf_format.load_weights(ours, source, ours_hf, family)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)

    # our model -> our folder -> transformers (bf16, as the recipes write it)
    ours_bf16 = build_model(spec, hf, torch.bfloat16)
    ours_bf16.load_state_dict({k: v.to(torch.bfloat16) for k, v in ours.state_dict().items()})
    folder = tmp_path / "written"
    folder.mkdir()
    written = hf_format.hf_config(ours_bf16, torch.bfloat16, None, family, tokenizer=None)
    hf_format.write_folder(folder, ours_bf16.state_dict(), written, family, source / "tokenizer.json")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [family.architecture] and config["torch_dtype"] == "bfloat16"
    assert config["tie_word_embeddings"] == hf["tie_word_embeddings"]
    toy = spec.hf  # the config the source checkpoint was made from
    assert config["rope_scaling"] == toy.get("rope_scaling") and config["rope_theta"] == toy["rope_theta"]
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in folder.iterdir()}
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype="auto").eval()
    assert type(reloaded) is type(theirs) and reloaded.dtype == torch.bfloat16
    assert reloaded.config.tie_word_embeddings == hf["tie_word_embeddings"]
    with torch.no_grad():
        if spec.family != "qwen3_moe":
            expected = ours_bf16(tokens).float()
            # bf16's resolution: four of its steps (2^-7 relative) at the largest logit; the two implementations sum
            # in other orders (a mixture of experts: a near-tie between two experts may route a token otherwise, and
            # its logits move far more; the fp32 check below holds every family)
            torch.testing.assert_close(
                reloaded(tokens).logits.float(), expected, rtol=0, atol=4 * 2**-7 * expected.abs().max().item()
            )
        # the same weights: the fp32 logits of the written bf16 values, transformers' and ours
        ours_fp32 = build_model(spec, hf)
        ours_fp32.load_state_dict({k: v.float() for k, v in ours_bf16.state_dict().items()})
        torch.testing.assert_close(reloaded.float()(tokens).logits, ours_fp32(tokens), rtol=1e-5, atol=1e-5)


def test_a_checkpoint_of_another_family_or_tying_is_refused(sources):
    """Building Llama 3.1 for a Qwen checkpoint, or an untied model for a tied one, is one BadInput naming a fix."""
    from finetune.base import BadInput

    llama = support.TOYS["llama3_1_8b"]
    model = build_model(llama, llama.hf)
    with pytest.raises(BadInput, match=r"model_type='qwen2'.*torchtune\.models\.qwen2_5\.qwen2_5_7b_base"):
        hf_format.hf_config(model, torch.float32, sources["qwen2_5_7b"][1], hf_format.FAMILIES["llama3"])
    with pytest.raises(BadInput, match="tie_word_embeddings=True"):
        hf_format.hf_config(model, torch.float32, sources["llama3_2_3b"][1], hf_format.FAMILIES["llama3"])


def test_eval_takes_every_family():
    from eval.checkpoint import MODEL_TYPES

    assert {f.model_type for f in hf_format.FAMILIES.values()} <= set(MODEL_TYPES)


# -- fine-tune, resume, the saved folder, eval ---------------------------------------------------------------------


@pytest.mark.parametrize("key", FINETUNED)
def test_packed_chat_finetune_losses_and_exact_resume(key, runs):
    full, resumed, _ = runs[key]
    assert [m["step"] for m in full] == [1, 2, 3, 4, 5, 6]
    losses, tokens = [m["loss"] for m in full], [m["tokens"] for m in full]
    assert key in RECORDED, f"record {key}: ({losses}, {tokens})"
    assert losses == pytest.approx(RECORDED[key][0], rel=RTOL)
    assert tokens == RECORDED[key][1]
    assert [m["step"] for m in resumed] == [4, 5, 6]
    assert [m["loss"] for m in resumed] == pytest.approx(losses[3:], rel=RTOL)


@pytest.mark.parametrize("key", FINETUNED)
def test_saved_checkpoint_is_the_model_in_transformers(key, runs, sources):
    """The recipe's epoch_0: transformers loads it as the family's class, with our model's logits."""
    spec, (_, hf), out = support.TOYS[key], sources[key], runs[key][2]
    ckpt = out / "epoch_0"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "recipe_state.pt"} <= {
        p.name for p in ckpt.iterdir()
    }
    config = json.loads((ckpt / "config.json").read_text())
    assert config["model_type"] == hf["model_type"] and config["eos_token_id"] == hf["eos_token_id"]
    family = hf_format.family_of(support.model_overrides(spec, hf)[0].split("=", 1)[1])
    ours = build_model(spec, hf)
    hf_format.load_weights(ours, ckpt, config, family)
    assert not torch.equal(ours.tok_embeddings.weight, build_model(spec, hf).tok_embeddings.weight)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    tokens = torch.randint(0, hf["vocab_size"], (1, 31), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("key", FINETUNED)
def test_eval_of_the_saved_checkpoint_equals_lm_eval_hf(key, runs, tmp_path):
    from eval.parity import run_lm_eval_hf

    ckpt = runs[key][2] / "epoch_0"
    cfg = OmegaConf.merge(
        OmegaConf.load(EVAL_CONFIG),
        {
            "checkpoint_dir": str(ckpt),
            "data_dir": str(DATA_DIR),
            "device": "cpu",
            "limit": 2,
            "output_dir": str(tmp_path),
        },
    )
    assert eval_recipe_module().recipe_main.__wrapped__(cfg) == 0
    (results_file,) = tmp_path.glob("results_*.json")
    ours = json.loads(results_file.read_text())["results"]["truthfulqa_mc2"]["acc,none"]
    ref, _ = run_lm_eval_hf(ckpt, DATA_DIR, limit=2, batch_size=8, add_bos=False)
    assert 0.0 < ours < 1.0
    assert ours == pytest.approx(ref["results"]["truthfulqa_mc2"]["acc,none"], abs=1e-4)
