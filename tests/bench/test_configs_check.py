"""bench/configs_check.py's anchor: the stock low-memory row of a results file from the same device call gives each
config of its family a ratio, and a file without that family's measured row is refused before anything runs."""

import json
import sys

import pytest

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "bench"))
import configs_check


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
