"""bench/model_families.py (and its rows, bench/_family_rows.py): its CPU toy mode end to end (checkpoint, our row, its FP8 twin, torchtune's stock row, the
JSON), the rows a command line picks, the stand-in tokenizer being one BPE in every format, and the parameter counts
its MFU uses."""

import json
import os
import statistics
import sys
from pathlib import Path

import pytest
import torch

from conftest import DATA_DIR, REPO_ROOT, recipe_env

sys.path.insert(0, str(REPO_ROOT / "bench"))
# torchtune's wheel ships its recipes (and their configs) beside the package: the stock rows run those.
import torchtune

import _family_rows as family_rows
import model_families as mf
import support

STOCK_DIR = Path(torchtune.__file__).resolve().parents[1] / "recipes"
KEYS = {
    "family",
    "name",
    "kind",
    "config",
    "memory_class",
    "device_memory_limit_gib",
    "variant",
    "tok_s",
    "peak_reserved_gib",
    "mfu",
    "vs_stock",
    "command",
    "losses",
}


@pytest.fixture
def rows_env(monkeypatch):
    """The benchmark's main() runs in the test: each row is still a fresh recipe process (stopped once its steps are
    logged, as in a real run); a process of the benchmark's own would only add its imports. Its rows get
    recipe_env's environment through this process's, one thread each."""
    env = recipe_env(OMP_NUM_THREADS="1")
    for key in set(os.environ) - set(env):
        monkeypatch.delenv(key)
    for key, value in env.items():
        if os.environ.get(key) != value:
            monkeypatch.setenv(key, value)


def test_toy_mode_runs_ours_and_the_stock_recipe_and_records_them(tmp_path, rows_env):
    out, work = tmp_path / "families.json", tmp_path / "work"
    argv = ["--toy", "--families", "llama3_2_3b", "--only", "ours_24gb,ours_24gb_fp8,stock", "--stock-dir"]
    argv += [str(STOCK_DIR), "--data-dir", str(DATA_DIR), "--work-dir", str(work), "--out", str(out), "--allow-dirty"]
    mf.main(argv)
    doc = json.loads(out.read_text())
    lead = support.command_lead(doc)
    assert doc["command"].startswith(lead + "python bench/model_families.py --toy") and doc["hardware"] and doc["date"]
    records = {r["name"]: r for r in doc["records"]}
    assert set(records) == {"ours_24gb", "ours_24gb_fp8", "stock"}, records
    for r in records.values():
        assert KEYS <= set(r) and not r.get("error"), r
        assert r["family"] == "llama3_2_3b" and r["tok_s"] > 0 and len(r["losses"]) == 3
        # Every step's speed is kept beside the median, the skipped steps too.
        steady = r["tok_s_per_step"][doc["skip_steps"] :]
        assert len(r["tok_s_per_step"]) == 3 and statistics.median(steady) == pytest.approx(r["tok_s"], rel=1e-3)
    ours, stock = records["ours_24gb"], records["stock"]
    assert (
        ours["kind"] == "ours" and ours["config"] == "llama3_2/3B_full_24gb" and ours["device_memory_limit_gib"] == 22.7
    )
    assert ours["variant"] == "optimizers.AdamW4bit + LinearCrossEntropyLoss(auto)"
    assert stock["kind"] == "stock" and stock["config"] == "llama3_2/3B_full_single_device" and stock["vs_stock"] == 1.0
    assert "full_finetune_single_device.py" in stock["command"] and "optimizer_in_bwd=True" in stock["command"]
    assert ours["vs_stock"] == pytest.approx(ours["tok_s"] / stock["tok_s"], rel=1e-2)
    # The FP8 twin: its own config at the same cap, named in the variant, and its speed over the bf16 row beside it
    # (on the CPU, flex attention instead of varlen, the command's last word).
    fp8 = records["ours_24gb_fp8"]
    assert fp8["config"] == "llama3_2/3B_full_24gb_fp8" and fp8["device_memory_limit_gib"] == 22.7
    assert fp8["variant"] == "optimizers.AdamW4bit + LinearCrossEntropyLoss(auto) + fp8=tensorwise"
    assert fp8["vs_bf16"] == pytest.approx(fp8["tok_s"] / ours["tok_s"], rel=1e-2) and "vs_bf16" not in ours
    assert not (work / "checkpoints" / "llama3_2_3b").exists()  # deleted before the next family


def test_profile_records_the_last_steps_and_leaves_them_out_of_the_median(tmp_path, rows_env):
    out, work = tmp_path / "families.json", tmp_path / "work"
    argv = ["--toy", "--profile", "--families", "llama3_2_3b", "--rows", "ours", "--only", "ours_24gb"]
    argv += ["--data-dir", str(DATA_DIR), "--work-dir", str(work), "--out", str(out), "--allow-dirty"]
    mf.main([*argv, "--keep-checkpoints"])
    (r,) = json.loads(out.read_text())["records"]
    assert (work / "checkpoints" / "llama3_2_3b" / "config.json").is_file()  # (kept for bench/configs_check.py)
    assert not r.get("error") and "profiler.enabled=True" in r["command"], r
    # Toy mode: 6 steps, the first skipped, the last 3 profiled (one warming the profiler up, two recorded).
    assert len(r["tok_s_per_step"]) == 6 and r["profiled_steps"] == [4, 5, 6] and r["profile"]["steps"] == [5, 6]
    assert r["tok_s"] == pytest.approx(statistics.median(r["tok_s_per_step"][1:3]), rel=1e-3)
    ms = r["profile"]["ms_per_step"]
    assert set(ms) == {"matmuls", "attention", "elementwise", "optimizer", "copies", "communication", "idle"}
    assert ms["matmuls"] > 0 and ms["optimizer"] > 0 and r["profile"]["wall_ms_per_step"] >= sum(ms.values()) * 0.99


def test_profile_needs_steps_left_for_the_median(capsys):
    with pytest.raises(SystemExit) as e:
        mf.parse_args(["--profile", "--steps", "7", "--skip-steps", "4", "--rows", "ours"])
    assert e.value.code == 2 and "--profile records the last 3 steps" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, rows",
    [
        (  # the default: per class the bf16 config and its FP8 twin, then the stock rows; the streamed 16 GB class
            "--families llama3_1_8b",
            "ours_80gb ours_80gb_fp8 ours_32gb ours_32gb_fp8 stock stock_8bit ours_16gb_fp8 stock_low_memory",
        ),
        ("--families qwen2_5_7b --classes 16gb --rows fp8 --candidates", "ours_16gb_fp8 ours_16gb_fp8_fewer_streamed"),
        ("--families qwen3_8b --classes 32gb", "ours_32gb ours_32gb_fp8"),  # (no stock recipe for Qwen3)
        ("--families qwen3_8b --classes 16gb --rows fp8,stock", "ours_16gb_fp8"),  # (nor a low-memory one)
        ("--families qwen2_5_3b --classes 80gb --rows fp8,stock --only ours_80gb_fp8,stock", "ours_80gb_fp8 stock"),
        (  # the 3B models' 12 GB class: bf16 and FP8, each with its activations kept on the GPU, and stock's low memory
            "--families qwen2_5_3b --classes 12gb --candidates --only "
            "ours_12gb,ours_12gb_fp8,ours_12gb_no_offload,ours_12gb_fp8_no_offload,stock_low_memory",
            "ours_12gb ours_12gb_fp8 ours_12gb_no_offload ours_12gb_fp8_no_offload stock_low_memory",
        ),
        (  # at 24 GiB the 3B bf16 configs' candidates: half the batch kept, every other layer recomputed
            "--families qwen2_5_3b --classes 24gb --rows ours --candidates",
            "ours_24gb ours_24gb_bs8_no_ac ours_24gb_ac2",
        ),
        (  # at 24 GiB the 3B twins' candidates recompute every other layer (the twins' own setting) and every layer
            "--families llama3_2_3b --classes 24gb --rows fp8 --candidates",
            "ours_24gb_fp8 ours_24gb_fp8_flex ours_24gb_fp8_ac2 ours_24gb_fp8_every_layer",
        ),
        (
            "--families mistral_7b --rows fp8 --candidates",
            "ours_80gb_fp8 ours_32gb_fp8 ours_80gb_fp8_flex ours_80gb_fp8_fused_loss ours_80gb_fp8_bs32 ours_32gb_fp8_flex "
            "ours_16gb_fp8 ours_16gb_fp8_fewer_streamed",
        ),
    ],
)
def test_the_command_line_picks_the_rows(argv, rows):
    args = mf.parse_args([*argv.split(), "--stock-dir", str(STOCK_DIR)])
    (job,) = mf.jobs_of(args)
    assert [r.name for r in job.rows] == rows.split()
    for r in job.rows:
        if r.kind == "ours" and r.memory_class == "16gb":  # (an FP8 config only, its weights streamed)
            assert r.config == family_rows.STREAMED_16GB[job.spec.key][0] and r.cap == family_rows.CLASS_GIB["16gb"]
        elif r.kind == "ours":
            assert r.config == job.spec.configs[r.memory_class] + ("_fp8" if "_fp8" in r.name else "")
            assert r.cap == family_rows.CLASS_GIB[r.memory_class]
        if r.kind == "ours":
            assert (REPO_ROOT / "configs" / f"{r.config}.yaml").is_file()


def test_a_class_or_row_kind_that_does_not_exist_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        mf.parse_args(["--classes", "40gb", "--rows", "ours"])
    assert e.value.code == 2 and "unknown --classes / --rows value(s) 40gb" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["llama3_1_8b", "qwen2_5_7b"])
def test_the_stock_rows_tokenize_as_ours(key, tmp_path):
    """The stand-in BPE written as torchtune's own format for the family (Llama 3's tiktoken file, Qwen's vocab.json
    and merges.txt) encodes Alpaca exactly as our tokenizer.json does: both recipes train on the same tokens."""
    from torchtune.models.llama3 import llama3_tokenizer
    from torchtune.models.qwen2_5 import qwen2_5_tokenizer

    from finetune.data.tokenizer import HFTokenizer
    from finetune.model import toy_tokenizer

    spec = family_rows.SPECS[key]
    texts = toy_tokenizer.alpaca_texts(DATA_DIR, 400)
    bpe = toy_tokenizer.train_bpe(texts[:300], 2000)
    toy_tokenizer.write_tokenizer(tmp_path, bpe, spec.stand_in, template_file=False)  # (as the checkpoint's)
    args = dict(a.split("=", 1) for a in mf.write_stock_tokenizer(tmp_path, spec, bpe, DATA_DIR))
    special = str(tmp_path / "tokenizer.json")
    if spec.family == "llama3":
        stock = llama3_tokenizer(args["tokenizer.path"], special_tokens_path=special)
    else:
        stock = qwen2_5_tokenizer(args["tokenizer.path"], args["tokenizer.merges_file"], special_tokens_path=special)
    ours = HFTokenizer(special)
    for text in texts[300:] + ["numbers 12345 and  two spaces\n\nnew lines"]:
        assert stock.encode(text, add_bos=False, add_eos=False) == ours.encode(text, add_bos=False, add_eos=False)


@pytest.mark.parametrize("key", list(family_rows.SPECS))
def test_parameter_counts_are_the_models(key):
    """MFU counts 6 x parameters x tokens/s: the count from config.json is that of the builder our config names."""
    from omegaconf import OmegaConf
    from torchtune import config

    spec = family_rows.SPECS[key]
    with torch.device("meta"):
        model = config.instantiate(OmegaConf.create({"_component_": spec.builder}))
    assert family_rows.n_params(spec) == sum(p.numel() for p in model.parameters())
    for memory_class, name in spec.configs.items():
        cfg = OmegaConf.load(REPO_ROOT / "configs" / f"{name}.yaml")
        assert cfg.model._component_ == spec.builder and name.endswith(f"_full_{memory_class}")


def test_a_small_class_is_compared_with_the_stock_row_of_its_own_class():
    """A 12 GB row against torchtune's low-memory row beside it, not against the faster 80 GB stock recipe, which
    does not fit that card; a class without a stock row of its own takes the fastest stock row."""

    def rec(name, kind, memory_class, tok_s):
        return {"family": "llama3_2_3b", "name": name, "kind": kind, "memory_class": memory_class, "tok_s": tok_s}

    records = [
        rec("stock", "stock", "80gb", 18000.0),
        rec("stock_low_memory", "stock", "12gb", 12000.0),
        rec("ours_24gb_fp8", "ours", "24gb", 27000.0),
        rec("ours_12gb", "ours", "12gb", 18000.0),
        rec("ours_12gb_fp8", "ours", "12gb", 24000.0),
    ]
    mf.finish(records)
    by = {r["name"]: r for r in records}
    assert (by["ours_12gb_fp8"]["anchor"], by["ours_12gb_fp8"]["vs_stock"]) == ("stock_low_memory", 2.0)
    assert (by["ours_24gb_fp8"]["anchor"], by["ours_24gb_fp8"]["vs_stock"]) == ("stock", 1.5)
    assert by["ours_12gb_fp8"]["vs_bf16"] == pytest.approx(24 / 18, rel=1e-3)
