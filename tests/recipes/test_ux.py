"""The recipe as a newcomer meets it: the manual's resume commands (docs/recipes.md) run as written, `--help` lists
the config keys, known third-party noise is filtered by message, and a run ends with a summary."""

import ast
import logging
import re
import runpy
import shlex
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from conftest import DATA_DIR, FAST, REPO_ROOT, TINY_CONFIG, TUNE, read_metrics, recipe_env

# The FAST model's size keys only: the manual's own step counts and checkpoint cadence must hold as written.
SMALL_MODEL = [
    o
    for o in FAST
    if o.split("=")[0]
    in (
        "model.num_layers",
        "model.embed_dim",
        "model.num_heads",
        "model.num_kv_heads",
        "tokenizer.max_seq_len",
        "batch_size",
    )
]


# The page that holds the runnable checkpoint/resume example (the recipes' manual, which `--help` prints).
MANUAL = "docs/recipes.md"


def doc_section_commands(page: str, title: str):
    """Each ```bash block of the section ``## {title}`` of the Markdown page ``page`` as its list of `tune run`
    commands."""
    text = (REPO_ROOT / page).read_text()
    start = text.index(f"\n## {title}\n") + 1
    end = text.find("\n## ", start + 1)
    section = text[start : end if end != -1 else None]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return [[line for line in block.splitlines() if line.startswith("tune run ")] for block in blocks]


def as_test_command(line: str, tmp_path):
    """The documented command with its outputs/ under tmp_path, the data folder, the FAST model and no wandb."""
    args = [a.replace("=outputs/", f"={tmp_path}/outputs/") for a in shlex.split(line)]
    assert args[:2] == ["tune", "run"] and "--config" in args, line
    at = args.index("--config") + 2
    extra = [f"data_dir={DATA_DIR}", *SMALL_MODEL, "metric_logger=null"]
    return [TUNE] + args[1:at] + extra + args[at:]


def test_manual_resume_commands_run_as_written(tmp_path):
    blocks = doc_section_commands(MANUAL, "Checkpoints and resume")
    assert [len(b) for b in blocks] == [1, 1], blocks  # a run with periodic checkpoints, then a resume from one
    outputs = []
    for block in blocks:
        proc = subprocess.run(
            as_test_command(block[0], tmp_path),
            cwd=REPO_ROOT,
            env=recipe_env(),
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, (block[0], proc.stderr[-3000:])
        outputs.append(proc)
        out = tmp_path / "outputs" / re.search(r"output_dir=outputs/(\S+)", block[0]).group(1)
        if len(outputs) == 1:
            first = read_metrics(out)
            assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["epoch_0", "step_6"]
    # The resume re-trained steps 7-12: each step is recorded once, with the uninterrupted run's losses.
    again = read_metrics(out)
    assert [m["step"] for m in again] == [m["step"] for m in first] == list(range(1, 13))
    assert [m["loss"] for m in again] == pytest.approx([m["loss"] for m in first], rel=1e-5)
    # The end of each run sums it up; no config dump, the banner names our recipe by its file.
    first_out, resumed_out = (p.stdout + p.stderr for p in outputs)
    assert "Run done: trained steps 1-12 (12 steps)" in first_out and f"Metrics: {out}/metrics.jsonl" in first_out
    assert f"Checkpoints: {out}/epoch_0 (latest; also step_6)" in first_out
    assert "Run done: trained steps 7-12 (6 steps)" in resumed_out
    assert "dropped 6 record(s) after step 6" in resumed_out
    for text in (first_out, resumed_out):
        assert "Training with recipes/full_finetune_single_device.py" in text
        assert "resolved config" not in text and "\nbatch_size: " not in text


RECIPES = [
    ("recipes/full_finetune_single_device.py", TINY_CONFIG),
    ("recipes/full_finetune_distributed.py", TINY_CONFIG),
    ("recipes/evaluate.py", "configs/eval/truthfulqa_mc2.yaml"),
]


def flat_config(path):
    def walk(node, prefix=""):
        for key, value in node.items():
            if isinstance(value, dict):
                yield from walk(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value

    return dict(walk(OmegaConf.to_container(OmegaConf.load(REPO_ROOT / path), resolve=False)))


def recipe_help_text(recipe, config, flag, monkeypatch, capsys) -> str:
    """`--help` runs the recipe file as `tune run` does (its __main__ block), here in this process."""
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setattr(sys, "argv", [recipe, "--config", config, flag])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(REPO_ROOT / recipe), run_name="__main__")
    assert stop.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("recipe, config", RECIPES, ids=[r.split("/")[1] for r, _ in RECIPES])
def test_help_prints_the_key_index_the_manuals_path_and_every_config_key(recipe, config, capsys, monkeypatch):
    """`--help`: the recipe's key index (its docstring), where its manual is, and the config's keys; the ~600-line
    manual itself only with `--help=all`."""
    out = recipe_help_text(recipe, config, "--help", monkeypatch, capsys)
    doc = ast.get_docstring(ast.parse((REPO_ROOT / recipe).read_text()))
    assert out.startswith(doc.strip())
    if "finetune" in recipe:
        assert f"The manual: {REPO_ROOT / MANUAL} (--help=all prints it here)." in out
        assert "## Features (each behind" not in out and len(out.splitlines()) < 200
        full = recipe_help_text(recipe, config, "--help=all", monkeypatch, capsys)
        assert full.startswith((REPO_ROOT / MANUAL).read_text().rstrip()) and "## Features (each behind" in full
    lines = out.splitlines()
    yaml = {None: "null", True: "true", False: "false"}
    for key, value in flat_config(config).items():
        shown = yaml.get(value, value) if isinstance(value, (bool, type(None))) else value
        assert any(re.fullmatch(rf"  {re.escape(key)} +{re.escape(str(shown))}", line) for line in lines), (key, shown)
    if "finetune" in recipe:
        assert "overwrite" in out.split("not set in this config")[1]  # a key the config file does not set


def test_help_reaches_the_recipe_through_tune_run():
    proc = subprocess.run(
        [TUNE, "run", RECIPES[0][0], "--config", TINY_CONFIG, "--help"],
        cwd=REPO_ROOT,
        env=recipe_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Skipping import of cpp extensions" not in proc.stdout + proc.stderr  # (torchao's, filtered in `tune`)
    assert "resume_from_checkpoint" in proc.stdout and "The manual: " in proc.stdout
    assert re.search(r"\n  save_every_n_steps +null\n", proc.stdout)


def test_known_third_party_noise_is_dropped_by_message_only():
    from finetune.reporting import console

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append((record.name, record.getMessage()))

    console.quiet_known_noise()
    handler = Keep()
    loggers = [
        logging.getLogger(name) for name in ("torchao", "bitsandbytes.backends.cpu.ops", "lm_eval.models.huggingface")
    ]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        logging.getLogger("torchao").warning("Skipping import of cpp extensions due to incompatible torch version")
        logging.getLogger("torchao").warning("something else from torchao")
        logging.getLogger("bitsandbytes.backends.cpu.ops").warning(
            "... Please make sure you already `pip install kernels` and the kernels >= 0.11.1"
        )
        logging.getLogger("lm_eval.models.huggingface").warning("`pretrained` model kwarg is not of type `str`. Many")
        logging.getLogger("lm_eval.models.huggingface").warning("another lm-eval warning")
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    assert seen == [
        ("torchao", "something else from torchao"),
        ("lm_eval.models.huggingface", "another lm-eval warning"),
    ]
