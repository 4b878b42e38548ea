"""Any Hugging Face folder of a supported family, any size, with the family's shipped 80 GB config and only
``checkpoint_dir=`` plus the CPU overrides docs/models.md gives ("Try a family on the CPU in a minute"): the model is
the folder's.

The folders are made as the docs make them, by ``python -m finetune.toy_folder --family <key>`` (transformers'
AutoConfig, from_config, save_pretrained), with tests/support.py's ANY_FOLDERS fields set on top: per family a
config.json that no released model has (width 48 with head_dim 16, 3 layers, RoPE bases and norm eps no release
has, Llama 3.1's RoPE scaling with every number changed, tying flipped against the config's builder). Each runs the
docs' command (its overrides read from the page) on a slice of Alpaca of 8 records (2-3 steps); its epoch_0 holds
the source's config.json (only the dtype is the run's), the tokenizer's files, and weights that transformers loads
into the model the recipe trained (same logits). A folder the family cannot honour is refused before anything is
tokenized. The six fine-tunes and the refused start run in this process (conftest.run_here: nothing here depends on
the process, and a subprocess would spend most of its time importing torch and transformers again).
"""

import json
import shlex
from pathlib import Path

import pytest
import torch
import transformers
from omegaconf import OmegaConf

import support
from conftest import DATA_DIR, REPO_ROOT, run_here
from finetune import toy_folder
from finetune.base import BadInput
from finetune.checkpoint import hf_format
from finetune.model import from_hf_config
from finetune.settings import read_settings

KEYS = list(support.ANY_FOLDERS)
MODELS_DOC = REPO_ROOT / "docs" / "models.md"


def documented_command() -> list:
    """The fine-tune command of docs/models.md's "Try a family on the CPU in a minute", as the shell splits it."""
    section = MODELS_DOC.read_text().split("## Try a family on the CPU in a minute", 1)[1].split("\n## ", 1)[0]
    lines = iter(section.splitlines())
    command = next((line for line in lines if line.startswith("    tune run ")), None)
    assert command, "docs/models.md: no `tune run` command in the section"
    while command.endswith("\\"):
        command = command[:-1] + next(lines)
    return shlex.split(command)


def documented_cpu_overrides() -> list:
    """The overrides the docs give beside checkpoint_dir= and output_dir=."""
    command = documented_command()
    return [
        a for a in command[command.index("--config") + 2 :] if a.split("=")[0] not in ("checkpoint_dir", "output_dir")
    ]


def test_the_docs_give_the_overrides_the_toy_folder_command_prints():
    """The docs' command is the one ``toy_folder`` prints for its folder, overrides included (so the runs below,
    which take the docs' list, test what a newcomer types)."""
    command = documented_command()
    folder = next(a.split("=", 1)[1] for a in command if a.startswith("checkpoint_dir="))
    config = command[command.index("--config") + 1]
    assert command == toy_folder.train_command(config, Path(folder))
    assert documented_cpu_overrides() == toy_folder.CPU_OVERRIDES
    assert config == f"configs/{toy_folder.MODELS['qwen3']['config']}.yaml"


def build(built: dict) -> torch.nn.Module:
    """The model of a resolved model section, as the recipes instantiate it."""
    from torchtune import config

    return config.instantiate(OmegaConf.create(built))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each family's odd folder, made by toy_folder (as the docs make one) with ANY_FOLDERS' fields set; the
    tokenizer's (and, but for Llama 2's SentencePiece, its chat_template.jinja, where transformers 5 keeps it) are
    toy_folder's."""
    root = tmp_path_factory.mktemp("folders")
    made = {}
    for key in KEYS:
        toy, _ = support.ANY_FOLDERS[key]
        fields = {k: v for k, v in toy.hf.items() if k != "vocab_size"}  # (the vocabulary is the tokenizer's)
        made[key] = (root / key, toy_folder.make_toy_folder(root / key, family=key, fields=fields, data_dir=DATA_DIR))
        assert made[key][1]["config"] == support.ANY_FOLDERS[key][1]
    return {key: (folder, summary["config_json"]) for key, (folder, summary) in made.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, folders):
    """Per family: the docs' command (its 80 GB config, checkpoint_dir, the documented CPU overrides) on 8 Alpaca
    records."""
    root = tmp_path_factory.mktemp("runs")
    data = root / "alpaca.json"
    data.write_text(json.dumps(json.loads((DATA_DIR / "alpaca" / "alpaca_data.json").read_text())[:8]))
    said = []
    for key in KEYS:
        run = run_here(
            root / key,
            f"checkpoint_dir={folders[key][0]}",
            f"dataset.data_files={data}",
            f"pack_cache_dir={root / 'cache'}",
            *documented_cpu_overrides(),
            config=support.ANY_FOLDERS[key][1],
            fast=False,
        )
        assert run.ok, (key, (run.stdout + run.stderr)[-4000:])
        said.append(run.stdout + run.stderr)
    return {key: root / key for key in KEYS}, "".join(said)


@pytest.mark.parametrize("key", KEYS)
def test_the_80gb_config_trains_the_folders_model(key, folders, runs):
    (folder, src), out = folders[key], runs[0][key]
    assert f"built from {folder / 'config.json'}" in runs[1]
    toy, _ = support.ANY_FOLDERS[key]
    as_read = from_hf_config.read_config(src)  # (the odd fields reached config.json, as transformers reads it)
    assert from_hf_config.rope_of(as_read)["rope_theta"] == toy.hf["rope_theta"]
    assert (as_read.rms_norm_eps, as_read.hidden_size, as_read.num_hidden_layers) == tuple(
        toy.hf[k] for k in ("rms_norm_eps", "hidden_size", "num_hidden_layers")
    )
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) >= 2
    ckpt = out / "epoch_0"
    written = json.loads((ckpt / "config.json").read_text())
    assert written == src  # (fp32 run, fp32 source: not even the dtype differs)
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
    """Qwen2.5's 80 GB config on a folder with a sliding window, with the docs' CPU overrides: one error line naming
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
        *documented_cpu_overrides(),
    ]
    # The check itself, from the settings (the recipe's start below runs it before the data is built)
    cfg = OmegaConf.merge(
        OmegaConf.load(REPO_ROOT / "configs/qwen2_5/7B_full_80gb.yaml"), OmegaConf.from_dotlist(overrides)
    )
    with pytest.raises(BadInput, match="^checkpoint_dir's config.json has use_sliding_window=True"):
        read_settings(cfg)

    run = run_here(tmp_path / "out", *overrides, config="configs/qwen2_5/7B_full_80gb.yaml", fast=False)
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.error.startswith("error: checkpoint_dir's config.json has use_sliding_window=True")
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()


def test_the_model_section_is_optional_with_a_folder(folders, tmp_path):
    """The folder says the family: no model section at all is the folder's model; without a folder it is refused."""
    folder, src = folders["mistral"]
    overrides = [
        f"checkpoint_dir={folder}",
        f"data_dir={DATA_DIR}",
        f"output_dir={tmp_path / 'out'}",
        *documented_cpu_overrides(),
    ]
    cfg = OmegaConf.merge(
        OmegaConf.load(REPO_ROOT / "configs/mistral/7B_full_80gb.yaml"), OmegaConf.from_dotlist(overrides)
    )
    del cfg["model"]
    s = read_settings(cfg)
    model = s.model.section
    assert s.model.family == "mistral" and model._component_ == "finetune.model.from_hf_config.decoder"
    assert (model.head_dim, model.rope_base, model.norm_eps) == (16, 30000.0, 2e-6)
    assert f"built from {folder / 'config.json'}" in s.model.note
    cfg.checkpoint_dir = None
    cfg.tokenizer.path = str(folder / "tokenizer.json")
    with pytest.raises(
        BadInput,
        match=r"^model._component_ is not set, and without checkpoint_dir the model section is required; name a model builder",
    ):
        read_settings(cfg)


def test_the_distributed_recipe_refuses_a_mixture_of_experts(folders, tmp_path):
    """Its loop has no load-balancing loss yet: a qwen3_moe folder is one line naming the recipe that trains it,
    before anything is built."""
    folder, _ = folders["qwen3_moe"]
    cfg = OmegaConf.merge(
        OmegaConf.load(REPO_ROOT / "configs/qwen3_moe/30B_A3B_full_80gb.yaml"),
        OmegaConf.from_dotlist(
            [f"checkpoint_dir={folder}", f"data_dir={DATA_DIR}", f"output_dir={tmp_path / 'out'}"]
            + documented_cpu_overrides()
            + ["optimizer_in_bwd=False", "enable_activation_checkpointing=False"]
        ),
    )
    for key in ("stream_optimizer_states", "host_memory_limit_gib"):  # (one-device keys)
        del cfg[key]
    with pytest.raises(BadInput, match=r"^the distributed recipe does not train a mixture of experts \(qwen3_moe\)"):
        read_settings(cfg, distributed=True)
