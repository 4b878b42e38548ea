"""Any Hugging Face folder of a supported family, any size, with the family's shipped 80 GB config and only
``checkpoint_dir=`` (plus what the CPU needs, support.CPU_OVERRIDES): the model is the folder's.

The folders are tests/support.py's ANY_FOLDERS, saved by transformers: per family a config.json that no released
model has (width 48 with head_dim 16, 3 layers, RoPE bases and norm eps no release has, Llama 3.1's RoPE scaling
with every number changed, tying flipped against the config's builder). Each trains for 2 steps; its epoch_0 holds
the source's config.json (only the dtype is the run's), the tokenizer's files, and weights that transformers loads
into the model the recipe trained (same logits). A folder the family cannot honour is refused before anything is
tokenized. The six fine-tunes run in one subprocess (support.run_batch); about 40 s on 2 cores.
"""

import json
import subprocess
import sys
import time

import pytest
import torch
import transformers
from omegaconf import OmegaConf

import support
from conftest import DATA_DIR, LLAMA2_TOKENIZER, REPO_ROOT, recipe_env, run_command
from finetune.base import BadInput
from finetune.checkpoint import hf_format
from finetune.settings import read_settings

KEYS = list(support.ANY_FOLDERS)


def build(built: dict) -> torch.nn.Module:
    """The model of a resolved model section, as the recipes instantiate it."""
    from torchtune import config

    return config.instantiate(OmegaConf.create(built))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each family's odd folder, with the chat template also in chat_template.jinja (where transformers 5 keeps
    it) for the families with a tokenizer.json."""
    root = tmp_path_factory.mktemp("folders")
    bpe = support.train_bpe(support.alpaca_texts(DATA_DIR, 500), support.TOY_BPE_SIZE)
    made = {}
    for key in KEYS:
        folder = root / key
        made[key] = (folder, support.make_any_folder(folder, key, bpe, LLAMA2_TOKENIZER))
        toy, _ = support.ANY_FOLDERS[key]
        if toy.family != "llama2":
            (folder / "chat_template.jinja").write_text(toy.template)
    return made


@pytest.fixture(scope="module")
def runs(tmp_path_factory, folders):
    """Per family: its 80 GB config, checkpoint_dir and the CPU overrides; one process for the six."""
    root = tmp_path_factory.mktemp("runs")
    data = root / "alpaca.json"
    data.write_text(json.dumps(json.loads((DATA_DIR / "alpaca" / "alpaca_data.json").read_text())[:48]))
    batch = [
        [
            "--config",
            support.ANY_FOLDERS[key][1],
            f"checkpoint_dir={folders[key][0]}",
            f"output_dir={root / key}",
            f"data_dir={DATA_DIR}",
            f"dataset.data_files={data}",
            f"pack_cache_dir={root / 'cache'}",
            *support.CPU_OVERRIDES,
        ]
        for key in KEYS
    ]
    spec_file = root / "runs.json"
    spec_file.write_text(json.dumps(batch))
    proc = subprocess.run(
        [sys.executable, support.__file__, str(spec_file)],
        cwd=REPO_ROOT,
        env=recipe_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == json.dumps([0] * len(batch)), (
        proc.stdout + proc.stderr
    )[-4000:]
    return {key: root / key for key in KEYS}, proc.stdout + proc.stderr


@pytest.mark.parametrize("key", KEYS)
def test_the_80gb_config_trains_the_folders_model(key, folders, runs):
    (folder, src), out = folders[key], runs[0][key]
    assert f"built from {folder / 'config.json'}" in runs[1]
    ckpt = out / "epoch_0"
    written = json.loads((ckpt / "config.json").read_text())
    assert written == src  # (fp32 run, fp32 source: not even the dtype differs)
    toy, _ = support.ANY_FOLDERS[key]
    tokenizer_files = (
        {"tokenizer.model"}
        if toy.family == "llama2"
        else {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    )
    assert tokenizer_files <= {p.name for p in ckpt.iterdir()}
    for name in tokenizer_files:
        assert (ckpt / name).read_bytes() == (folder / name).read_bytes()

    family, built = hf_format.resolve_model(src, None)
    ours = build(built)
    hf_format.load_weights(ours, ckpt, written, family)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    source = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = torch.randint(0, src["vocab_size"], (2, 29), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = ours.eval()(tokens)
        assert (logits - theirs(tokens).logits).abs().max().item() <= 1e-4
        assert (logits - source(tokens).logits).abs().max().item() > 1e-3  # it trained


def test_a_folder_the_family_cannot_honour_is_refused_before_tokenizing(tmp_path, folders):
    """Qwen2.5's 80 GB config on a folder with a sliding window, all of Alpaca to tokenize: one error line naming
    the field, exit 2, nothing tokenized, built or written; the check itself well under 10 s."""
    folder, src = folders["qwen2_5"]
    bad = tmp_path / "windowed"
    bad.mkdir()
    for f in folder.iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(
        json.dumps({**src, "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 0})
    )
    overrides = [
        f"checkpoint_dir={bad}",
        f"data_dir={DATA_DIR}",
        f"output_dir={tmp_path / 'out'}",
        f"pack_cache_dir={tmp_path / 'cache'}",
        *support.CPU_OVERRIDES,
    ]
    # The check itself, in this process (the subprocess below also pays for importing torch and torchtune)
    cfg = OmegaConf.merge(
        OmegaConf.load(REPO_ROOT / "configs/qwen2_5/7B_full_80gb.yaml"), OmegaConf.from_dotlist(overrides)
    )
    started = time.monotonic()
    with pytest.raises(BadInput, match="^checkpoint_dir's config.json has use_sliding_window=True"):
        read_settings(cfg)
    assert time.monotonic() - started < 10

    proc = subprocess.run(
        [
            *run_command("recipes/full_finetune_single_device.py"),
            "--config",
            "configs/qwen2_5/7B_full_80gb.yaml",
            *overrides,
        ],
        cwd=REPO_ROOT,
        env=recipe_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("error: checkpoint_dir's config.json has use_sliding_window=True")
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()


def test_the_model_section_is_optional_with_a_folder(folders, tmp_path):
    """The folder says the family: no model section at all is the folder's model; without a folder it is refused."""
    folder, src = folders["mistral"]
    overrides = [
        f"checkpoint_dir={folder}",
        f"data_dir={DATA_DIR}",
        f"output_dir={tmp_path / 'out'}",
        *support.CPU_OVERRIDES,
    ]
    cfg = OmegaConf.merge(
        OmegaConf.load(REPO_ROOT / "configs/mistral/7B_full_80gb.yaml"), OmegaConf.from_dotlist(overrides)
    )
    del cfg["model"]
    s = read_settings(cfg)
    assert s.family == "mistral" and s.model._component_ == "finetune.model.from_hf_config.decoder"
    assert (s.model.head_dim, s.model.rope_base, s.model.norm_eps) == (16, 30000.0, 2e-6)
    assert f"built from {folder / 'config.json'}" in s.model_note
    cfg.checkpoint_dir = None
    cfg.tokenizer.path = str(folder / "tokenizer.json")
    with pytest.raises(BadInput, match=r"^model._component_ is not set; name a model builder"):
        read_settings(cfg)
