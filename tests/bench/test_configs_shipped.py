"""bench/configs_shipped.py: a config is shipped by a passing row from the code of the working tree; a change to what a
run reads since the row's commit makes it stale, a change elsewhere (bench/, docs) does not; a config without a passing
row is missing, one whose row from the current code failed is failing; the distributed config is listed apart. Run on
a small git repository of its own."""

import json
import sys

import pytest

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "bench"))

import configs_shipped
from support import git


@pytest.fixture
def repo(tmp_path):
    for name in ("a/1B_full_80gb", "a/1B_full_12gb", "a/1B_full_24gb", "b/2B_full_distributed", "eval/score"):
        path = tmp_path / "configs" / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"name: {name}\n")
    for name in ("finetune/train.py", "bench/tool.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-qm", "first")
    return tmp_path


def results(repo, *rows):
    path = repo / "results.json"
    path.write_text(json.dumps({"rows": list(rows)}))
    return path


def test_a_row_is_current_until_what_the_run_reads_changes(repo):
    first = git(repo, "rev-parse", "HEAD")
    path = results(
        repo,
        {"config": "a/1B_full_80gb", "passed": True, "code": first, "tok_s": 100},
        {"config": "a/1B_full_12gb", "passed": False, "code": first},
    )
    states = {c: e["state"] for c, e in configs_shipped.status(repo, [path]).items()}
    assert states == {
        "a/1B_full_12gb": "failing",  # (its row from this code failed)
        "a/1B_full_24gb": "missing",
        "a/1B_full_80gb": "shipped",
        "b/2B_full_distributed": "several_gpus",
    }
    (repo / "bench" / "tool.py").write_text("x = 2\n")  # a benchmark's change keeps the row
    (repo / "configs" / "a" / "1B_full_24gb.yaml").write_text("name: changed\n")  # (another config's too)
    assert configs_shipped.status(repo, [path])["a/1B_full_80gb"]["state"] == "shipped"
    (repo / "finetune" / "train.py").write_text("x = 2\n")  # uncommitted: the working tree is what runs
    entry = configs_shipped.status(repo, [path])["a/1B_full_80gb"]
    assert entry["state"] == "stale" and entry["changed"] == ["finetune/train.py"]


def test_a_row_that_names_its_imports_stays_current_across_python_files_its_runs_never_loaded(repo):
    """A row of bench/configs_check.py names the files its runs imported: a changed Python file outside them (the
    MoE blocks, for a dense config) keeps it; one of them, or a file under the run's folders that is not Python (a
    template a run may read), makes it stale. A row without the list: any change under those folders."""
    (repo / "finetune" / "moe.py").write_text("x = 1\n")
    (repo / "finetune" / "template.jinja").write_text("{{ x }}\n")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "more")
    first = git(repo, "rev-parse", "HEAD")
    row = {"config": "a/1B_full_80gb", "passed": True, "code": first, "tok_s": 100}
    named = results(repo, {**row, "imported": ["finetune/train.py"]})
    plain = repo / "plain.json"
    plain.write_text(json.dumps({"rows": [row]}))
    (repo / "finetune" / "moe.py").write_text("x = 2\n")
    assert configs_shipped.status(repo, [named])["a/1B_full_80gb"]["state"] == "shipped"
    assert configs_shipped.status(repo, [plain])["a/1B_full_80gb"]["changed"] == ["finetune/moe.py"]
    (repo / "finetune" / "template.jinja").write_text("{{ y }}\n")
    assert configs_shipped.status(repo, [named])["a/1B_full_80gb"]["changed"] == ["finetune/template.jinja"]
    git(repo, "checkout", "-q", "finetune/template.jinja")
    (repo / "configs" / "eval" / "score.yaml").write_text("name: changed\n")  # (the eval's settings: every row's)
    assert configs_shipped.status(repo, [named])["a/1B_full_80gb"]["changed"] == ["configs/eval/score.yaml"]
    git(repo, "checkout", "-q", "configs/eval/score.yaml")
    (repo / "finetune" / "train.py").write_text("x = 2\n")
    entry = configs_shipped.status(repo, [named])["a/1B_full_80gb"]
    assert entry["state"] == "stale" and entry["changed"] == ["finetune/train.py"]


def test_a_python_files_comments_and_layout_keep_the_row_its_code_and_docstrings_do_not(repo):
    """A comment reworded, a line broken differently, quotes swapped: the syntax tree is the commit's and the row stays
    current (with or without its list of imports). A changed value, name or docstring makes it stale; so does a file
    that no longer parses."""
    train = repo / "finetune" / "train.py"
    train.write_text('def f(a):\n    """Doubles."""\n    return a * 2  # why\n')
    git(repo, "commit", "-qam", "code")
    first = git(repo, "rev-parse", "HEAD")
    row = {"config": "a/1B_full_80gb", "passed": True, "code": first, "tok_s": 100}
    path = results(repo, row, {**row, "config": "a/1B_full_24gb", "imported": ["finetune/train.py"]})

    def states():
        table = configs_shipped.status(repo, [path])
        return [table[c]["state"] for c in ("a/1B_full_80gb", "a/1B_full_24gb")]

    train.write_text("# the module\n\ndef f(\n    a,\n):\n    'Doubles.'\n    return a * 2  # the reason, reworded\n")
    assert states() == ["shipped", "shipped"]
    for code in (
        'def f(a):\n    """Doubles."""\n    return a * 3\n',  # a value
        'def f(b):\n    """Doubles."""\n    return b * 2\n',  # a name
        'def f(a):\n    """Twice a."""\n    return a * 2\n',  # a docstring (a manual may print it)
        "def f(a):\n    return a *\n",  # no longer parses
    ):
        train.write_text(code)
        assert states() == ["stale", "stale"], code
        assert configs_shipped.status(repo, [path])["a/1B_full_80gb"]["changed"] == ["finetune/train.py"]


def test_a_row_recorded_from_import_lines_alone_counts_a_lazily_loading_package_whole(repo):
    """Python's import-time lines leave out a module importlib.import_module loads: a row recorded from them alone (no
    ``imported_from``) that loaded any module of such a package (its __init__.py calls import_module) counts the
    whole package, so a change to the module it loaded unreported makes it stale. A row of the module record, or one
    that loaded only the package's __init__.py (a run that streams nothing), keeps its list."""
    lazy = repo / "finetune" / "lazy"
    lazy.mkdir()
    (lazy / "__init__.py").write_text(
        "import importlib\n\ndef __getattr__(n):\n    return importlib.import_module(n)\n"
    )
    (lazy / "used.py").write_text("x = 1\n")
    (lazy / "unreported.py").write_text("x = 1\n")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "lazy")
    first = git(repo, "rev-parse", "HEAD")
    row = {"passed": True, "code": first, "tok_s": 100}
    path = results(
        repo,
        {**row, "config": "a/1B_full_80gb", "imported": ["finetune/lazy/__init__.py", "finetune/lazy/used.py"]},
        {**row, "config": "a/1B_full_12gb", "imported": ["finetune/lazy/__init__.py"]},
        {
            **row,
            "config": "a/1B_full_24gb",
            "imported": ["finetune/lazy/__init__.py", "finetune/lazy/used.py"],
            "imported_from": "import-time lines and each process's modules at exit",
        },
    )
    (lazy / "unreported.py").write_text("x = 2\n")
    table = configs_shipped.status(repo, [path])
    assert table["a/1B_full_80gb"]["state"] == "stale"
    assert table["a/1B_full_80gb"]["changed"] == ["finetune/lazy/unreported.py"]
    assert table["a/1B_full_12gb"]["state"] == "shipped" and table["a/1B_full_24gb"]["state"] == "shipped"
    assert configs_shipped.lazy_packages(repo) == ["finetune/lazy"]


def test_a_change_to_the_configs_settings_makes_its_row_stale_its_comments_do_not(repo):
    first = git(repo, "rev-parse", "HEAD")
    (repo / "configs" / "a" / "1B_full_80gb.yaml").write_text("# measured: 100 tok/s\nname: a/1B_full_80gb  # (why)\n")
    git(repo, "commit", "-qam", "figures")
    path = results(repo, {"config": "a/1B_full_80gb", "passed": True, "code": first})
    assert configs_shipped.status(repo, [path])["a/1B_full_80gb"]["state"] == "shipped"
    (repo / "configs" / "a" / "1B_full_80gb.yaml").write_text("name: tuned\n")
    git(repo, "commit", "-qam", "tune")
    entry = configs_shipped.status(repo, [path])["a/1B_full_80gb"]
    assert entry["state"] == "stale" and entry["changed"] == ["configs/a/1B_full_80gb.yaml"]


def test_a_setting_the_rows_command_gave_is_not_read_from_the_file_so_its_change_keeps_the_row(repo):
    """The row's run took output_dir (and a dotted logger setting) from its command line: the file's values may
    change; a value the command did not give still makes the row stale."""
    (repo / "configs" / "a" / "1B_full_80gb.yaml").write_text(
        "output_dir: outputs/x\nlogger:\n  project: p\n  dir: ${output_dir}\nbatch_size: 4\n"
    )
    git(repo, "commit", "-qam", "settings")
    first = git(repo, "rev-parse", "HEAD")
    command = "python recipes/r.py --config configs/a/1B_full_80gb.yaml output_dir=/tmp/run logger.project=q"
    path = results(repo, {"config": "a/1B_full_80gb", "passed": True, "code": first, "command": command})
    (repo / "configs" / "a" / "1B_full_80gb.yaml").write_text(
        "output_dir: outputs/y\nlogger:\n  project: other\n  dir: ${output_dir}\nbatch_size: 4\n"
    )
    git(repo, "commit", "-qam", "its own output folder")
    assert configs_shipped.status(repo, [path])["a/1B_full_80gb"]["state"] == "shipped"
    (repo / "configs" / "a" / "1B_full_80gb.yaml").write_text(
        "output_dir: outputs/y\nlogger:\n  project: other\n  dir: ${output_dir}\nbatch_size: 8\n"
    )
    entry = configs_shipped.status(repo, [path])["a/1B_full_80gb"]
    assert entry["state"] == "stale" and entry["changed"] == ["configs/a/1B_full_80gb.yaml"]
    assert configs_shipped.command_settings(command) == {"output_dir": "/tmp/run", "logger.project": "q"}


def test_of_several_files_a_current_row_ships_the_config(repo):
    """An H200's file beside the H100's: a stale row in one and a current row in the other ship the config."""
    old = git(repo, "rev-parse", "HEAD")
    (repo / "finetune" / "train.py").write_text("x = 2\n")
    git(repo, "commit", "-qam", "fix")
    new = git(repo, "rev-parse", "HEAD")
    h100 = repo / "configs_check_h100.json"
    h100.write_text(json.dumps({"rows": [{"config": "a/1B_full_80gb", "passed": True, "code": old}]}))
    h200 = repo / "configs_check_h200.json"
    h200.write_text(json.dumps({"rows": [{"config": "a/1B_full_80gb", "passed": True, "code": new, "tok_s": 7}]}))
    entry = configs_shipped.status(repo, [h100, h200])["a/1B_full_80gb"]
    assert (entry["state"], entry["file"], entry["tok_s"]) == ("shipped", "configs_check_h200.json", 7)
    assert configs_shipped.status(repo, [h100])["a/1B_full_80gb"]["state"] == "stale"


def test_a_failure_from_the_current_code_outweighs_an_older_pass_and_an_older_failure_does_not(repo):
    """The results file keeps a config's older passing row in ``rows`` and the current code's failures in ``failed``:
    the config is failing, its failed check named, until the code changes (the failure may be fixed: the older pass
    is then as stale as any)."""
    old = git(repo, "rev-parse", "HEAD")
    (repo / "finetune" / "train.py").write_text("x = 2\n")
    git(repo, "commit", "-qam", "change")
    new = git(repo, "rev-parse", "HEAD")
    path = repo / "results.json"
    checks = {"saved": True, "resumed_first_step_exact": False}
    path.write_text(
        json.dumps(
            {
                "rows": [{"config": "a/1B_full_80gb", "passed": True, "code": old, "tok_s": 100}],
                "failed": [{"config": "a/1B_full_80gb", "passed": False, "code": new, "checks": checks}],
            }
        )
    )
    entry = configs_shipped.status(repo, [path])["a/1B_full_80gb"]
    assert (entry["state"], entry["code"], entry["failed"]) == ("failing", new, ["resumed_first_step_exact"])
    (repo / "finetune" / "train.py").write_text("x = 3\n")
    assert configs_shipped.status(repo, [path])["a/1B_full_80gb"]["state"] == "stale"


def test_a_commit_the_checkout_lacks_is_said_not_taken_for_current(repo):
    path = results(repo, {"config": "a/1B_full_80gb", "passed": True, "code": "0123abc"})
    assert configs_shipped.status(repo, [path])["a/1B_full_80gb"]["state"] == "unknown_code"


def test_the_report_names_the_next_calls_configs_and_strict_fails_while_any_is_needed(repo, monkeypatch, capsys):
    first = git(repo, "rev-parse", "HEAD")
    monkeypatch.setattr(configs_shipped, "REPO_ROOT", repo)
    path = results(repo, {"config": "a/1B_full_80gb", "passed": True, "code": first, "tok_s": 100})
    assert configs_shipped.main(["--results", str(path)]) == 0
    assert configs_shipped.main(["--results", str(path), "--strict"]) == 1
    out = capsys.readouterr().out
    assert "need a row: --configs a/1B_full_12gb,a/1B_full_24gb\n" in out
    assert "1 shipped" in out and "2 missing" in out and "1 several_gpus" in out
    assert configs_shipped.main(["--results", str(repo / "none.json")]) == 2
    assert capsys.readouterr().out.startswith("error: --results")
