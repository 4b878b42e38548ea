"""bench/merge_rows.py: a device call's rows go into the results file of their GPU with the call's provenance, a
passing row in its config's place (the old one superseded), a failing one apart; a dirty call, another GPU's file and
a second merge of the same call are refused in one line, the file untouched."""

import json
import sys

import pytest

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "bench"))

import merge_rows
from support import git

H100 = "1x NVIDIA H100 80GB HBM3 (80 GiB), 16 CPU cores"


def row(config, passed=True, **extra):
    return {"config": config, "checks": {"saved": passed, "evaluates": True}, "passed": passed, **extra}


def call_file(tmp_path, *rows, code="a" * 40, hardware=H100, date="2026-12-07 19:06 UTC"):
    path = tmp_path / "cc.json"
    doc = {"command": "python bench/configs_check.py --configs X", "hardware": hardware, "date": date, "code": code}
    path.write_text(json.dumps({**doc, "versions": {"torch": "2.11"}, "rows": list(rows)}))
    return path


@pytest.fixture
def committed(tmp_path):
    path = tmp_path / "configs_check_h100.json"
    doc = {"command": "c", "hardware": H100, "date": "2026-12-06 06:59 UTC", "code": "old", "code_note": "earlier."}
    rows = [row("m/3B_full_12gb", code="old", tok_s=1), row("m/3B_full_24gb", code="old"), row("n/7B_full_16gb")]
    path.write_text(json.dumps({**doc, "rows": rows, "superseded": [], "failed": []}))
    return path


def test_a_passing_row_takes_its_configs_place_and_a_failing_one_goes_apart(tmp_path, committed, capsys):
    new = call_file(tmp_path, row("m/3B_full_24gb", tok_s=2), row("n/7B_full_16gb", passed=False, error="run: oom"))
    merge_rows.main([str(new), "--call", "AW", "--note", "AW ran 105e08d.", "--into", str(committed)])
    doc = json.loads(committed.read_text())
    assert [r["config"] for r in doc["rows"]] == ["m/3B_full_12gb", "m/3B_full_24gb", "n/7B_full_16gb"]
    fresh = doc["rows"][1]
    assert fresh["tok_s"] == 2 and fresh["code"] == "a" * 40 and fresh["device_call"] == "AW"
    assert fresh["measured_at"] == "2026-12-07 19:06 UTC" and fresh["hardware"] == H100
    assert fresh["results_command"] == "python bench/configs_check.py --configs X"
    assert [r["code"] for r in doc["superseded"]] == ["old"]  # the 24 GB row it replaced
    assert doc["rows"][2].get("device_call") is None  # a failing row replaces nothing...
    assert [r["config"] for r in doc["failed"]] == ["n/7B_full_16gb"] and doc["failed"][0]["device_call"] == "AW"
    assert doc["date"] == "2026-12-06 06:59 UTC; 2026-12-07 19:06 UTC (call AW)"
    assert doc["code_note"] == "earlier. AW ran 105e08d."
    out = capsys.readouterr().out
    assert "m/3B_full_24gb: pass" in out and "n/7B_full_16gb: FAIL (run: oom)" in out


def test_a_config_without_a_row_gets_one_and_a_speed_row_proves_nothing(tmp_path, committed):
    new = call_file(tmp_path, row("q/8B_full_32gb"), {"config": "q/8B_full_80gb", "speed_only": True, "checks": {}})
    merge_rows.main([str(new), "--call", "AX", "--into", str(committed)])
    doc = json.loads(committed.read_text())
    assert [r["config"] for r in doc["rows"]][-1] == "q/8B_full_32gb" and not doc["superseded"]
    assert [r["config"] for r in doc["speed_only"]] == ["q/8B_full_80gb"]


@pytest.mark.parametrize(
    "code, hardware, named",
    [
        ("a" * 40 + "+dirty", H100, "the call's code is 'aaaa"),
        (None, H100, "the call's code is None"),
        ("a" * 40, "1x NVIDIA H200 (139 GiB), 16 CPU cores", "holds rows of '1x NVIDIA H100"),
    ],
    ids=["dirty", "unknown", "another-gpu"],
)
def test_a_call_that_proves_no_commit_or_ran_elsewhere_is_refused(tmp_path, committed, capsys, code, hardware, named):
    before = committed.read_text()
    new = call_file(tmp_path, row("m/3B_full_24gb"), code=code, hardware=hardware)
    with pytest.raises(SystemExit) as exit_:
        merge_rows.main([str(new), "--call", "AW", "--into", str(committed)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and named in err, err
    assert committed.read_text() == before


def test_a_call_whose_git_copy_lagged_its_files_records_the_commit_that_holds_them(tmp_path, committed, capsys):
    """The GPU machine's copy of git records an old commit "+dirty"; the call's fingerprint of its code files
    (harness.code_tree) finds the commit they are. Files no commit holds are refused."""
    import _harness as harness

    repo = tmp_path / "repo"
    (repo / "finetune").mkdir(parents=True)
    (repo / "finetune" / "a.py").write_text("x = 1\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "first")
    first = git(repo, "rev-parse", "HEAD")
    (repo / "finetune" / "a.py").write_text("x = 2\n")
    git(repo, "commit", "-qam", "second")
    second = git(repo, "rev-parse", "HEAD")
    tree = harness.code_tree(repo)
    doc = json.loads(committed.read_text())
    new = json.loads(call_file(tmp_path, row("m/3B_full_24gb"), code=first + "+dirty").read_text())
    lines = merge_rows.merge({**new, "code_tree": tree}, doc, "BC", "why.", root=repo)
    assert doc["rows"][1]["code"] == second and doc["rows"][1]["config"] == "m/3B_full_24gb"
    assert any(second[:7] in line for line in lines) and f"its rows record {second[:7]}" in doc["code_note"]
    (repo / "finetune" / "a.py").write_text("x = 3\n")
    with pytest.raises(SystemExit):
        merge_rows.merge({**new, "code_tree": harness.code_tree(repo)}, doc, "BD", None, root=repo)
    assert "no commit here holds its files" in capsys.readouterr().err


def test_the_same_call_merged_twice_is_refused(tmp_path, committed, capsys):
    new = call_file(tmp_path, row("m/3B_full_24gb"))
    merge_rows.main([str(new), "--call", "AW", "--into", str(committed)])
    once = committed.read_text()
    with pytest.raises(SystemExit):
        merge_rows.main([str(new), "--call", "AW", "--into", str(committed)])
    assert "is in the file already" in capsys.readouterr().err and committed.read_text() == once


def test_a_gpus_first_rows_start_its_file_with_the_calls_provenance(tmp_path):
    into = tmp_path / "configs_check_h200.json"
    h200 = "1x NVIDIA H200 (139 GiB), 16 CPU cores"
    new = call_file(tmp_path, row("m/3B_full_24gb"), hardware=h200)
    merge_rows.main([str(new), "--call", "B", "--into", str(into)])
    doc = json.loads(into.read_text())
    assert doc["hardware"] == h200 and doc["code"] == "a" * 40 and doc["versions"] == {"torch": "2.11"}
    assert doc["date"] == "2026-12-07 19:06 UTC (call B)" and [r["config"] for r in doc["rows"]] == ["m/3B_full_24gb"]
    assert merge_rows.gpu_of(h200) == "h200" and merge_rows.gpu_of(H100) == "h100" and merge_rows.gpu_of("cpu") is None


def test_a_file_that_is_not_a_calls_results_is_one_error_line(tmp_path, capsys):
    bad = tmp_path / "cc.json"
    bad.write_text('{"records": []}')
    with pytest.raises(SystemExit) as exit_:
        merge_rows.main([str(bad), "--call", "AW", "--into", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "has no 'rows' list" in err
    assert not (tmp_path / "x.json").exists()
