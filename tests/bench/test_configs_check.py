"""bench/configs_check.py's anchor: the stock low-memory row of a results file from the same device call gives each
config of its family a ratio, and a file without that family's measured row is refused before anything runs; its
transformers check holds a mixture of experts' per-expert tensors to the slices transformers stacks them into; the
whole check of one config on a toy folder, on the CPU; the card each config runs on (its class's cap where it sets
none); the folders --folders makes, one model at a time, and what --budget-s leaves for the next call."""

import json
import re
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import DATA_DIR, REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "bench"))

import configs_check
from finetune import toy_folder


def results(tmp_path, *records):
    path = tmp_path / "anchor.json"
    path.write_text(json.dumps({"command": "x", "records": list(records)}))
    return path


def test_the_anchor_is_the_familys_measured_stock_low_memory_row(tmp_path):
    path = results(
        tmp_path,
        {"name": "stock_low_memory", "family": "qwen3_8b", "tok_s": 5000.0, "command": "qwen3"},
        {"name": "stock_80gb", "family": "llama3_1_8b", "tok_s": 9000.0},
        {"name": "stock_low_memory", "family": "llama3_1_8b", "tok_s": 6500.0, "command": "stock 8B"},
    )
    anchor = configs_check.read_anchor("llama3_1", path)
    assert anchor == {"tok_s": 6500.0, "command": "stock 8B", "file": "anchor.json"}
    # bench/e2e.py's rows name no family: they are Llama2-7B's
    assert (
        configs_check.read_anchor("llama2", results(tmp_path, {"name": "stock_low_memory", "tok_s": 7000.0}))["tok_s"]
        == 7000.0
    )


def test_a_file_without_the_familys_measured_row_is_refused(tmp_path, capsys):
    failed = {"name": "stock_low_memory", "family": "llama3_1_8b", "error": "out of memory"}
    with pytest.raises(SystemExit):
        configs_check.read_anchor("llama3_1", results(tmp_path, failed))
    assert "no measured stock_low_memory row of llama3_1" in capsys.readouterr().err


def test_transformers_loads_a_mixture_of_experts_folder_expert_by_expert(tmp_path):
    """A qwen3_moe folder in our writer's per-expert names (the streamed toy: one model.safetensors, as a run saves)
    passes: transformers 5 holds the experts stacked, and each file tensor is compared with its slice there."""
    folder = tmp_path / "moe"
    toy_folder.make_toy_folder(folder, family="qwen3_moe", data_dir=DATA_DIR, stream=True)
    assert configs_check.transformers_loads(folder)
    scope = {"re": re}
    exec(configs_check._HELD, scope)
    gate_up, down = torch.arange(24).view(2, 4, 3), torch.arange(12).view(2, 3, 2)  # (2 experts: I=2, H=3)
    held = {"model.layers.0.mlp.experts.gate_up_proj": gate_up, "model.layers.0.mlp.experts.down_proj": down}
    experts = "model.layers.0.mlp.experts.1"
    assert torch.equal(scope["held"](held, f"{experts}.gate_proj.weight"), gate_up[1, :2])
    assert torch.equal(scope["held"](held, f"{experts}.up_proj.weight"), gate_up[1, 2:])
    assert torch.equal(scope["held"](held, f"{experts}.down_proj.weight"), down[1])
    assert scope["held"]({"lm_head.weight": down}, "model.layers.0.mlp.experts.1.up_proj.weight") is None


def test_a_config_without_a_cap_of_its_own_runs_on_a_card_of_its_class():
    """An 80 GB GPU would lend a 24 GB config spare memory its card has not (a background save's copy goes there):
    the configs that set no device_memory_limit_gib run at their class's cap; the 16 and 12 GB configs keep their
    own, and a cap or a CPU device given with --set is the run's."""
    cap = configs_check.harness.CLASS_GIB

    def card(config, *sets):
        return configs_check.class_card(config, SimpleNamespace(set=list(sets)))

    assert card("llama3_2/3B_full_24gb_fp8") == [f"device_memory_limit_gib={cap['24gb']}"]
    assert card("qwen3/8B_full_32gb", "device=cuda:0") == [f"device_memory_limit_gib={cap['32gb']}"]
    assert card("mistral/7B_full_80gb_fp8") == [f"device_memory_limit_gib={cap['80gb']}"]
    assert card("llama2/7B_full_16gb_fp8") == [] and card("qwen2_5/3B_full_12gb") == []  # (their own: 14.2, 10.3)
    assert card("llama3_2/3B_full_24gb", "device=cpu") == []
    assert card("llama3_2/3B_full_24gb", "device_memory_limit_gib=20") == []


# A toy Llama 3.2 folder's check on the CPU: our 24 GB config's GPU-only settings off, 200 records, 3 steps.
TOY_CPU = ["device=cpu", "dtype=fp32", "compile=False", "batch_size=2", "tokenizer.max_seq_len=128", "fp8=null"]


def check_toy(tmp_path, *flags: str) -> dict:
    """bench/configs_check.py's main() on a toy folder of llama3_2/3B_full_24gb, with ``flags``; its one row."""
    folder = tmp_path / "toy"
    toy_folder.make_toy_folder(folder, family="llama3_2", data_dir=DATA_DIR)
    out = tmp_path / "check.json"
    argv = ["--configs", "llama3_2/3B_full_24gb", "--checkpoint", f"llama3_2={folder}", "--data-dir", str(DATA_DIR)]
    argv += ["--work-dir", str(tmp_path / "work"), "--steps", "3", "--skip-steps", "1", *flags]
    argv += ["--out", str(out), "--allow-dirty", "--timeout", "600"]
    argv += [a for o in [*TOY_CPU, "dataset.split=train[:200]"] for a in ("--set", o)]
    configs_check.main(argv)
    (row,) = json.loads(out.read_text())["rows"]
    return row


def test_a_config_is_checked_end_to_end_on_a_toy_folder(tmp_path):
    """The whole check on the CPU, as on the GPU with a toy's sizes: a run that saves at step 2 and at its end, the
    resume from step_2/ in the other save mode beside transformers' load and the eval, and a passing row, with what
    the step save cost training and where its copy went."""
    row = check_toy(tmp_path, "--save-every", "2", "--eval-limit", "2", "--eval-set", "batch_size=2")
    assert row["passed"], row.get("error") or row.get("resume_error") or row["checks"]
    assert row["resumed_losses"] == row["losses"][2:] and len(row["tok_s_per_step"]) == 3
    assert row["checks"]["resumed_first_step_equal"] and row["resumed_first_step_ulps"] == 0.0  # (the CPU: exact)
    assert len(row["gc_ms_per_step"]) == 3 and all(ms is not None and ms >= 0 for ms in row["gc_ms_per_step"])
    assert row["compiled_graphs_per_step"] == [None] * 3 and row["resumed_compiled_graphs"] == [None]  # (compile=False)
    assert row["resumed_peak_rss_gib"] > 0  # (its load's peak: the resume's footprint a desktop must have)
    # each process's own memory and its mapped file pages (its libraries at least), sampled while it ran
    for prefix in ("", "resumed_"):
        assert row[f"{prefix}own_gib_peak"] > 0.1 and row[f"{prefix}file_gib_peak"] > 0.01
    assert row["eval_beside_resume"] and 0.0 <= row["eval"]["truthfulqa_mc2"] <= 1.0
    (saved,) = row["saves_blocked_s"].items()  # (the step save's cost to training; the epoch's has no step after it)
    assert saved[0] == "2" and saved[1]["checkpoint_blocked_s"] >= 0 and saved[1]["checkpoint_staged_host_gib"] > 0
    phases = row["phases_s"]  # (the step lines' and saves' seconds, as the series' samples: training ends at step 3)
    assert [step for step, _ in phases["steps"]] == [1, 2, 3] and phases["trained"] == phases["steps"][-1][1]
    assert len(phases["saves"]) == 2 and all(start <= end for start, end in phases["saves"])
    # each sample: seconds, host GB taken, GPU MiB, compile workers GB, the kernel's dirty pages, shared memory and
    # MemTotal's change; the run's own memory beside it on the same clock, half a second apart or more
    assert all(len(sample) == 7 and sample[4] >= 0 for sample in row["series"])
    # where each peak's drop went: /proc/meminfo's fields that moved, at the training peak and the saving peak
    assert {"training_peak", "saving_peak"} <= set(row["meminfo_change_gb"])
    assert all("t" in change for change in row["meminfo_change_gb"].values())
    own = row["own_series"]
    assert len(own) > 2 and all(b[0] - a[0] >= 0.5 - 1e-9 for a, b in zip(own, own[1:]))  # (tenths, as floats)
    assert 0.1 < max(s[1] for s in own) <= row["own_gib_peak"] and own[-1][2] > 0  # (its libraries, mapped)
    assert not (tmp_path / "work" / "llama3_2_3B_full_24gb").exists()  # (the run folders go after each config)
    # the files its runs loaded: the recipes, the library's modules the run, the resume and the eval imported; not
    # the MoE blocks, which a dense model's run never loads, nor the streaming modules, which a config that streams
    # nothing never loads (a change to them leaves the row current)
    imported = set(row["imported"])
    assert {"recipes/full_finetune_single_device.py", "recipes/evaluate.py", "eval/truthfulqa.py"} <= imported
    assert {"finetune/checkpoint/checkpointer.py", "finetune/model/loss.py", "optimizers/adamw4bit.py"} <= imported
    assert "finetune/model/moe.py" not in imported and all((REPO_ROOT / f).is_file() for f in imported)
    assert [f for f in imported if f.startswith("finetune/streaming/")] == ["finetune/streaming/__init__.py"]


def test_a_resumes_first_loss_may_sit_a_float32_step_from_the_run_it_continues_and_no_further():
    """The first resumed loss is one forward of the restored weights; cut-cross-entropy sums a row's vocabulary blocks
    in the order they take a lock, so the same forward can land a float32 step away (Mistral's 16 GB FP8 row: 2**-20
    at a loss of 9.6). A resume that restored something else is hundreds of steps off; a missing loss is not equal."""
    run = [9.6187162399292, 9.263671875]
    assert configs_check.float32_steps(9.618717193603516, run[0]) == 1.0
    assert configs_check.first_step_equal([9.618717193603516, 9.263258934020996], run)
    assert configs_check.first_step_equal(run, run) and configs_check.float32_steps(run[0], run[0]) == 0.0
    three_steps_off = float(np.nextafter(np.nextafter(np.nextafter(np.float32(run[0]), 99), 99), 99))
    assert configs_check.float32_steps(three_steps_off, run[0]) == 3.0
    assert not configs_check.first_step_equal([three_steps_off], run)
    assert not configs_check.first_step_equal([run[0] * (1 + 1e-5)], run)  # (~100 steps: a resume gone wrong)
    assert not configs_check.first_step_equal([], run) and not configs_check.first_step_equal(run, [])


def test_speed_only_runs_the_steps_without_a_save_and_never_passes(tmp_path, monkeypatch):
    """A speed row's runs take the tool's environment; a variable that steers them (here the fused loss's
    autotuning, which the CPU run does not use) is named in the row, which may be merged into another file."""
    monkeypatch.setenv("CCE_AUTOTUNE", "0")
    row = check_toy(tmp_path, "--speed-only", "--keep")
    assert row["speed_only"] and "passed" not in row and not row.get("error"), row
    assert row["env"]["CCE_AUTOTUNE"] == "0"
    assert len(row["tok_s_per_step"]) == 3 and row["tok_s"] > 0 and "save_every_n_steps=null" in row["command"]
    assert "device_memory_limit_gib" not in row["command"]  # (device=cpu: no card to emulate)
    run = tmp_path / "work" / "llama3_2_3B_full_24gb" / "run"
    assert not list(run.glob("step_*"))  # (the epoch's save may start before the stop, on a toy)


def run_check(tmp_path, configs: str, *flags: str) -> dict:
    """main() with --folders (toy folders made on the CPU) and ``flags``, speed only; the results file."""
    out = tmp_path / "check.json"
    argv = ["--configs", configs, "--folders", str(tmp_path / "folders"), "--toy-folders", "--speed-only"]
    argv += ["--data-dir", str(DATA_DIR), "--work-dir", str(tmp_path / "work"), "--steps", "2", "--skip-steps", "1"]
    argv += ["--out", str(out), "--allow-dirty", "--timeout", "600", *flags]
    argv += [a for o in [*TOY_CPU, "dataset.split=train[:200]"] for a in ("--set", o)]
    configs_check.main(argv)
    return json.loads(out.read_text())


def test_each_models_folder_is_made_once_and_the_last_models_alone_is_kept(tmp_path):
    """--folders: the configs run grouped by model, each model's random-valued folder written before its first config
    (bench/model_families.py's, one stand-in BPE for all) and the one before it removed (a 7-8B folder is 15 GB)."""
    mine = tmp_path / "folders" / "my_model"  # a folder of the user's there: never removed
    mine.mkdir(parents=True)
    (mine / "config.json").write_text("{}")
    doc = run_check(tmp_path, "qwen2_5/3B_full_24gb,llama3_2/3B_full_24gb,qwen2_5/3B_full_80gb")
    rows = doc["rows"]
    assert [r["config"] for r in rows] == ["qwen2_5/3B_full_24gb", "qwen2_5/3B_full_80gb", "llama3_2/3B_full_24gb"]
    assert all(r["tok_s"] and not r.get("error") for r in rows), rows
    folders = tmp_path / "folders"
    assert [r["command"].count(f"checkpoint_dir={folders / 'qwen2_5_3b'} ") for r in rows] == [1, 1, 0]
    assert f"checkpoint_dir={folders / 'llama3_2_3b'} " in rows[2]["command"]
    assert sorted(p.name for p in folders.iterdir() if p.is_dir()) == ["llama3_2_3b", "my_model"]
    assert json.loads((folders / "llama3_2_3b" / "config.json").read_text())["model_type"] == "llama"


def test_a_budget_too_short_for_a_row_runs_nothing_and_names_the_next_calls_configs(tmp_path, capsys):
    doc = run_check(tmp_path, "llama3_2/3B_full_24gb,llama3_2/3B_full_12gb", "--budget-s", "30")
    assert doc["rows"] == [] and doc["not_run"] == ["llama3_2/3B_full_24gb", "llama3_2/3B_full_12gb"]
    assert "--configs llama3_2/3B_full_24gb,llama3_2/3B_full_12gb" in capsys.readouterr().out
    assert not (tmp_path / "folders").exists()  # (nothing made for a row that does not run)


def test_a_row_whose_run_fails_keeps_its_log_and_leaves_no_run_folder(tmp_path):
    """The log of a failed run is what says why (the row's error is its last line); its folder, which may hold a 7B
    step save, goes as a passing row's does, so the next rows of the device call have the disk."""
    logs = tmp_path / "logs"
    doc = run_check(tmp_path, "llama3_2/3B_full_24gb", "--set", "optimizer.lr=-1", "--logs-dir", str(logs))
    (row,) = doc["rows"]
    assert row["error"].startswith("run: ") and "lr" in row["error"]
    log = logs / "llama3_2_3B_full_24gb_run.log"
    assert log.is_file() and "error:" in log.read_text()
    assert not (tmp_path / "work" / "llama3_2_3B_full_24gb").exists()


def test_the_budget_plans_a_7b_row_by_7b_rows_not_by_a_3b_row_of_its_class(tmp_path):
    """A 3B row takes about half a 7-8B row of the same class: one measured in this call does not make the next call's
    7B row look short enough to start (it would run past the device call's end)."""
    args = configs_check.parse_args(
        ["--configs", "llama3_2/3B_full_24gb,llama2/7B_full_24gb", "--folders", str(tmp_path), "--budget-s", "250"]
    )
    for model in ("llama3_2_3b", "llama2_7b"):  # (their folders made: no FOLDER_SECONDS in the need)
        (tmp_path / model).mkdir()
        (tmp_path / model / "config.json").write_text("{}")
    walls = {configs_check.row_kind("llama3_2/3B_full_24gb"): 100}  # a 3B 24 GB row took 100 s
    assert configs_check.budget_left("llama3_2/3B_full_24gb", args, time.monotonic() - 140, walls)
    assert not configs_check.budget_left("llama2/7B_full_24gb", args, time.monotonic() - 140, walls)  # 180 s planned
    walls[configs_check.row_kind("llama2/7B_full_24gb")] = 100
    assert configs_check.budget_left("llama2/7B_full_24gb", args, time.monotonic() - 140, walls)
    assert configs_check.row_kind("qwen3_moe/30B_A3B_full_80gb") == ("80gb", False)


def test_a_config_without_a_folder_or_a_way_to_make_one_is_refused_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        configs_check.parse_args(["--configs", "llama3_2/3B_full_24gb"])
    assert "--checkpoint llama3_2_3b=DIR, or --folders DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        configs_check.parse_args(["--configs", "qwen3_moe/30B_A3B_full_80gb", "--folders", str(tmp_path)])
    assert "no tool here makes qwen3_moe_30b's folder" in capsys.readouterr().err
    # a folder given by model or by configs/ folder needs no --folders
    given = configs_check.parse_args(["--configs", "qwen2_5/3B_full_24gb", "--checkpoint", "qwen2_5_3b=/x"])
    assert configs_check.given_folder("qwen2_5/3B_full_24gb", given) == "/x"
    given = configs_check.parse_args(["--configs", "qwen2_5/7B_full_80gb", "--checkpoint", "qwen2_5=/y"])
    assert configs_check.given_folder("qwen2_5/7B_full_80gb", given) == "/y"


def test_a_folder_there_that_this_tool_did_not_make_is_neither_used_half_made_nor_removed(tmp_path):
    args = configs_check.parse_args(["--configs", "llama3_2/3B_full_24gb", "--folders", str(tmp_path)])
    (tmp_path / "llama3_2_3b").mkdir()
    (tmp_path / "llama3_2_3b" / "notes.txt").write_text("mine")
    error = configs_check.ensure_folder("llama3_2/3B_full_24gb", args)
    assert "exists without a config.json and this tool did not make it" in error
    assert (tmp_path / "llama3_2_3b" / "notes.txt").read_text() == "mine"


def test_a_row_whose_checkpoints_would_not_fit_the_disk_is_refused_before_it_runs(tmp_path, monkeypatch):
    """Each checkpoint is the folder's weights in the config's dtype plus its optimizer's state: twice the weights
    for torch's AdamW (Llama2-7B's 80 GB config: 40 GB a save), our variants' registered bytes; the first run's two
    saves and the resume's one must fit where they go, or the row is refused in one line that names the fix, before
    anything of it runs (on the GPU machine it would fail at its epoch save, minutes into the call)."""
    from safetensors.torch import save_file

    folder = tmp_path / "llama2"
    folder.mkdir()
    save_file({"a": torch.zeros(1000, 600), "b": torch.zeros(400, 1000)}, str(folder / "model.safetensors"))  # 1e6
    argv = ["--configs", "llama2/7B_full", "--checkpoint", f"llama2={folder}", "--work-dir", str(tmp_path / "work")]
    argv += ["--out", str(tmp_path / "check.json"), "--allow-dirty", "--set", "device=cpu"]
    args = configs_check.parse_args(argv)
    args.resolved["llama2/7B_full"] = args.resolved["llama2/7B_full_24gb"] = str(folder)
    assert configs_check.checkpoint_gb("llama2/7B_full", args) == pytest.approx(1e6 * (2 + 4) / 1e9)  # (bf16)
    assert configs_check.checkpoint_gb("llama2/7B_full_24gb", args) == pytest.approx(1e6 * (2 + 1.0625) / 1e9)
    args.set.append("optimizer=optimizers.AdamW8bit")
    assert configs_check.checkpoint_gb("llama2/7B_full", args) == pytest.approx(1e6 * (2 + 2.03125) / 1e9)
    args.set[-1] = "dtype=fp32"  # (torch's AdamW keeps its moments in the weights' dtype)
    assert configs_check.checkpoint_gb("llama2/7B_full", args) == pytest.approx(1e6 * (4 + 8) / 1e9)
    args.set.pop()

    def free(gb):
        monkeypatch.setattr(configs_check.shutil, "disk_usage", lambda _: SimpleNamespace(free=gb * 1e9))

    need = 3 * 6e-3 * configs_check.DISK_MARGIN  # the three saves and the margin
    free(need * 0.99)
    short = configs_check.disk_shortfall("llama2/7B_full", args)
    assert "the run's step and epoch saves and the resume's epoch save take about" in short
    assert "--work-dir or --resume-dir" in short and str(tmp_path) in short
    free(need * 1.01)
    assert configs_check.disk_shortfall("llama2/7B_full", args) is None
    free(need * 0.99)
    configs_check.main(argv)
    (row,) = json.loads((tmp_path / "check.json").read_text())["rows"]
    assert row["error"].startswith("disk: ") and "command" not in row and not row["checks"]
    assert not (tmp_path / "work").exists()


def test_a_rows_files_include_a_module_importlib_loaded_which_the_import_time_lines_leave_out(tmp_path, monkeypatch):
    """finetune.streaming loads its modules on first use through importlib.import_module, which Python's import-time
    lines do not report: a streamed run executes finetune/streaming/room.py (the host-room check) without a line for
    it. The module record on the run's path (bench/module_record/sitecustomize.py) names it from the process's
    modules at exit; an environment's own sitecustomize, which the record's shadows, still runs."""
    own = tmp_path / "own_site"
    own.mkdir()
    (own / "sitecustomize.py").write_text(f"open({str(tmp_path / 'own_ran')!r}, 'w').close()\n")
    monkeypatch.setenv("PYTHONPATH", str(own))
    log = tmp_path / "run.log"
    code = "from finetune import streaming; streaming.check_host_room"
    run = configs_check.harness.run([sys.executable, "-c", code], log, timeout=300, env=configs_check.run_env(log))
    assert run.returncode == 0, log.read_text()[-2000:]
    assert "finetune.streaming.room" not in configs_check.IMPORT_LINE.findall(log.read_text())  # (why the record)
    imported = configs_check.imported_files([log])
    assert "finetune/streaming/room.py" in imported and "finetune/streaming/states.py" in imported
    assert all(
        (REPO_ROOT / f).is_file() and f.split("/")[0] in ("finetune", "recipes", "optimizers", "eval") for f in imported
    )
    assert (tmp_path / "own_ran").is_file()
