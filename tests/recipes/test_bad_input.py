"""Each bad input stops the recipe before training: one line naming the value and the fix,
exit status 2, no traceback, and the checkpoints already in output_dir left as they were.

The cases here need the recipe: records of the data (checked as the dataset is built) and the
command line (read before the config). A bad config value is refused by a settings reader,
which the recipe calls first, before anything is built or written: each reader's refusals are
unit tests (tests/finetune/settings/test_read.py), and one of them (a missing data file) runs
here end to end. Most cases call the recipe's entry point in this process (what `tune run`
calls after its ~8 s of imports); two go through `tune run` itself to show the exit status
reaches the shell.
"""

import hashlib
import json
import sys

import pytest
import torch

from conftest import RECIPE, run_here, run_recipe


def snapshot(folder):
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def out_with_checkpoint(tmp_path):
    """An output_dir that already holds a (stand-in) good checkpoint and metrics."""
    out = tmp_path / "out"
    (out / "epoch_0").mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "recipe_state.pt", "tokenizer.model"):
        (out / "epoch_0" / name).write_bytes(name.encode() * 100)
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    return out


def write_json(path, records):
    path.write_text(json.dumps(records))
    return path


GOOD = {"instruction": "Say hi.", "input": "", "output": "Hi."}

# (id, overrides (callable of tmp_path -> list), words the message must hold ({t} = tmp_path))
CASES = [
    (
        "missing-data-file",
        lambda t: [f"dataset.data_files={t}/nope/alpaca_data.json"],
        [
            "dataset.data_files={t}/nope/alpaca_data.json does not exist",
            "set dataset.data_files=FILE",
            "dataset.source=tatsu-lab/alpaca",
        ],
    ),
    (
        "malformed-data-file",
        lambda t: [f"dataset.data_files={t / 'bad.json'}"],
        ["dataset.data_files={t}/bad.json line 1 is not valid JSON (Expecting value at column 55)", "fix or drop"],
    ),
    (
        "record-without-output",
        lambda t: [f"dataset.data_files={t / 'no_output.json'}"],
        ["record 2 of {t}/no_output.json (counting from 1) has no 'output'"],
    ),
    (
        "records-without-instruction",
        lambda t: [f"dataset.data_files={t / 'no_instruction.json'}"],
        ["have no 'instruction' field"],
    ),
    # The command line itself: an override typed with a space for its '=', one with two, an unknown flag
    (
        "override-without-equals",
        lambda t: ["batch_size", "4"],
        ["the override 'batch_size' has no '='", "batch_size=4"],
    ),
    ("override-with-two-equals", lambda t: ["seed=1=2"], ["the override 'seed=1=2' holds more than one '='"]),
    ("removing-an-absent-key", lambda t: ["~no_such_key"], ["~no_such_key removes a key the config does not have"]),
    # a section torchtune will not remove (it has a _component_) is removed; the settings then say it is required
    ("removing-a-required-section", lambda t: ["~tokenizer"], ["tokenizer is required: the run builds the tokenizer"]),
    ("removing-the-model-section", lambda t: ["~model"], ["without checkpoint_dir the model section is required"]),
    ("removing-a-component", lambda t: ["~loss._component_"], ["~loss._component_ would leave loss without its"]),
    ("unknown-flag", lambda t: ["--no-such-flag"], ["--no-such-flag is not a flag of the recipe"]),
]


# Through `tune run`: one input refused by the command line's parser, one by the settings readers' checks of the config
# (the end-to-end case of tests/finetune/settings/test_read.py's refusals). Both places turn every refusal (a
# BadInput) into the same sys.exit(2), so these two show that status reaches the shell from either; the other cases'
# messages are checked in this process, with the same assertions.
CLI_CASES = ("missing-data-file", "override-without-equals")


@pytest.mark.parametrize(
    "make_overrides, words, via_cli",
    [pytest.param(o, w, i in CLI_CASES, id=i + ("-via-tune-run" if i in CLI_CASES else "")) for i, o, w in CASES],
)
def test_bad_input_stops_before_training(tmp_path, out_with_checkpoint, make_overrides, words, via_cli):
    (tmp_path / "bad.json").write_text('[{"instruction": "a", "output": "b"}, {"instruction": ')
    write_json(tmp_path / "no_output.json", [GOOD, {"instruction": "Say bye.", "input": ""}, GOOD])
    write_json(tmp_path / "no_instruction.json", [{"input": "", "output": "x"}] * 3)
    before = snapshot(out_with_checkpoint)

    if via_cli:
        run = run_recipe(out_with_checkpoint, *make_overrides(tmp_path))
    else:
        run = run_here(out_with_checkpoint, *make_overrides(tmp_path))

    assert run.returncode == 2, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, run.stderr[-3000:]
    for word in words:
        assert word.format(t=tmp_path) in errors[0], errors[0]
    assert "Traceback" not in run.stderr
    assert "step 1 |" not in run.stdout  # nothing trained
    assert snapshot(out_with_checkpoint) == before
    assert not (out_with_checkpoint / "wandb").exists()


@pytest.mark.parametrize("override", ["output_dir=null", "output_dir="])
def test_an_output_dir_that_names_no_folder_is_one_error_line(tmp_path, override):
    run = run_here(tmp_path / "out", override)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "names no folder for the run's checkpoints" in run.error and "set output_dir=" in run.error


@pytest.mark.parametrize("below", [False, True], ids=["a-file", "below-a-file"])
def test_an_output_dir_where_a_file_stands_is_one_error_line(tmp_path, below):
    """A file at output_dir, or above it: said so (the OS's words were "not writable (File exists)"), and the file
    is left as it was. (A path below a file cannot be created by anyone, root included.)"""
    blocker = tmp_path / "file"
    blocker.write_text("a run's notes")
    out = blocker / "out" if below else blocker
    run = run_here(out)
    assert run.returncode == 2, run.stderr[-3000:]
    what = f"lies below {blocker}, which is a file" if below else "is a file"
    assert (
        run.error == f"error: output_dir={out} {what}, not a folder; set output_dir=DIR to a folder (made if missing)"
    )
    assert blocker.read_text() == "a run's notes"


@pytest.mark.parametrize(
    "text, words",
    [
        ("batch_size: [1\nseed: 2\n", "is not valid YAML: did not find expected ',' or ']' at line 2, column 5"),
        ("- batch_size: 1\n", "is not a config of key: value lines"),
    ],
    ids=["syntax", "a-list"],
)
def test_a_config_file_that_is_not_yaml_of_keys_is_one_error(tmp_path, text, words, capsys, monkeypatch):
    config = tmp_path / "mine.yaml"
    config.write_text(text)
    from recipes.full_finetune_single_device import recipe_main

    monkeypatch.setattr(sys, "argv", [RECIPE, "--config", str(config), f"output_dir={tmp_path / 'out'}"])
    with pytest.raises(SystemExit) as stop:
        recipe_main()
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err
    (error,) = [line for line in err.splitlines() if line.startswith("error: ")]
    assert error.startswith(f"error: --config {config} {words}"), error
    assert not (tmp_path / "out").exists()


def test_a_state_file_edited_to_name_another_optimizer_is_one_error(tmp_path):
    """An optimizers.AdamW8bit checkpoint whose recipe_state.pt was edited to record torch.optim.AdamW: torch's
    AdamW would load the 8-bit codes and fail at the first step with a shape error. One line names the writer."""
    trained = tmp_path / "trained"
    run = run_here(trained, "optimizer=optimizers.AdamW8bit", "max_steps_per_epoch=4", "save_every_n_steps=2")
    assert not run.returncode, run.stderr[-3000:]  # (sys.exit(None): done)
    state_file = trained / "step_2" / "recipe_state.pt"
    state = torch.load(state_file, weights_only=True)
    state["config"]["optimizer"] = "torch.optim.AdamW"
    torch.save(state, state_file)
    # (edited on purpose: without the checksum beside it, as the refusal of an edited file says, it is read unverified)
    state_file.with_name("recipe_state.pt.crc32").unlink()
    run = run_here(
        tmp_path / "out",
        "optimizer=torch.optim.AdamW",
        "max_steps_per_epoch=4",
        f"resume_from_checkpoint={trained / 'step_2'}",
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: the optimizer state in {state_file} was written by optimizers.AdamW8bit (state format '8bit.v3'), "
        "which torch.optim.AdamW cannot load (was the file's recorded optimizer edited?); resume with "
        "optimizer=optimizers.AdamW8bit, or start a new run from its weights with checkpoint_dir=... and no "
        "resume_from_checkpoint"
    ]
    assert "step 3 |" not in run.stdout
