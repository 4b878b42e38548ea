"""bench/configs_check.py's anchor: the stock low-memory row of a results file from the same device call gives each
config of its family a ratio, and a file without that family's measured row is refused before anything runs; its
transformers check holds a mixture of experts' per-expert tensors to the slices transformers stacks them into."""

import json
import re
import sys

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
