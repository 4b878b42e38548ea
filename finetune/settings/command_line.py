"""The recipes' command line, ``tune run <recipe> --config FILE key=value ...``, read into the config as torchtune's
``config.parse`` reads it, with its mistakes said in one ``error:`` line and exit status 2 instead of a traceback:
a ``--config`` file that is missing or not YAML (its line and column), an override without ``=`` (``batch_size 4``),
with two, or that removes a key the config lacks, an unknown ``--flag``. ``~section`` removes a whole component
section (torchtune refuses to, and said the config lacked it); whether the run can do without it is the settings'
to say (``~model`` with checkpoint_dir can; without, the model section is required). Every recipe's
``recipe_main`` is decorated with ``parse`` in place of ``config.parse``; the values themselves are checked later,
by finetune/settings/.
"""

import argparse
import functools
import os
import sys
from pathlib import Path
from typing import Any, Callable, List, Optional

from omegaconf import DictConfig
from torchtune.config._parse import TuneRecipeArgumentParser
from torchtune.config._utils import _merge_yaml_and_cli_args

from finetune.base import BadInput, first_line
from finetune.reporting import console

FORMAT = "write each override as one key=value argument (no spaces around '='; quote a value with spaces)"


def parse(recipe_main: Callable[[DictConfig], Any]) -> Callable[..., Any]:
    """``recipe_main`` called with the config the command line names, then ``sys.exit`` with what it returns; a
    command line that cannot be read is one ``error:`` line (under torchrun, each rank's error file: see
    ``console.report_bad_input``) and exit status 2."""

    @functools.wraps(recipe_main)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            cfg = read_command_line(recipe_main.__doc__)
        except BadInput as e:
            console.report_bad_input(e, int(os.environ.get("RANK", "0")))
            sys.exit(2)
        sys.exit(recipe_main(cfg))

    return wrapper


def read_command_line(description: Optional[str] = None, argv: Optional[List[str]] = None) -> DictConfig:
    """The ``--config`` file merged with the ``key=value`` overrides (torchtune's rules: ``~key`` removes a key,
    ``model=path`` sets a section's ``_component_``), or a BadInput naming what could not be read and the fix.
    (argparse still answers a missing ``--config`` itself: its usage line and exit status 2.)"""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = TuneRecipeArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    try:
        yaml_args, overrides = parser.parse_known_args(argv)
    except Exception as e:  # (yaml's, omegaconf's, the OS's and torchtune's own errors: see _config_problem)
        raise BadInput(_config_problem(e, argv)) from None
    _check_overrides(overrides)
    overrides = _remove_sections(vars(yaml_args), overrides)
    try:
        return _merge_yaml_and_cli_args(yaml_args, overrides)
    except Exception as e:  # omegaconf's grammar errors, torchtune's ValueErrors: the text the user typed
        keys = [a[1:].split("=")[0] for a in overrides if a.startswith("~")]
        removed = next((k for k in keys if f"key {k} in" in str(e) or str(e).endswith(f"~{k}")), None)
        if removed and _holds(vars(yaml_args), removed):  # (torchtune refuses ~section._component_ alone)
            section = removed.rpartition(".")[0]
            raise BadInput(
                f"~{removed} would leave {section} without its _component_; remove the whole section "
                f"(~{section}) or name another one ({section}._component_=...)"
            ) from None
        if removed:
            raise BadInput(f"~{removed} removes a key the config does not have; check its spelling") from None
        raise BadInput(f"the command-line overrides could not be read ({first_line(e)}); {FORMAT}") from None


def _remove_sections(config: dict, overrides: List[str]) -> List[str]:
    """The overrides left once each ``~section`` (a top-level section of the config) is removed from ``config``
    here: torchtune's merge removes no section that has a ``_component_``."""
    kept = []
    for arg in overrides:
        key = arg[1:].split("=")[0] if arg.startswith("~") else ""
        if key and "." not in key and isinstance(config.get(key), dict):
            del config[key]
        else:
            kept.append(arg)
    return kept


def _holds(config: dict, dotpath: str) -> bool:
    """Whether ``config`` has the key ``dotpath`` names."""
    node: Any = config
    for part in dotpath.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _config_path(argv: List[str]) -> str:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return "?"


def _config_problem(e: Exception, argv: List[str]) -> str:
    """The error line for a --config file that cannot be read (or an unknown --flag), from what reading it raised."""
    import yaml

    path = _config_path(argv)
    if isinstance(e, yaml.YAMLError):
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or first_line(e)
        return f"--config {path} is not valid YAML: {problem}{where}; fix the file (or start from configs/tiny.yaml)"
    if "Additional flag arguments" in str(e):
        flags = [a.split("=")[0] for a in argv if a.startswith("--") and a.split("=")[0] != "--config"]
        return (
            f"{', '.join(flags) or 'that flag'} is not a flag of the recipe; it takes --config FILE and key=value "
            "overrides (--help lists the keys)"
        )
    if isinstance(e, OSError) or not Path(path).is_file():
        return (
            f"--config {path} cannot be read ({getattr(e, 'strerror', None) or first_line(e)}); give the path of a "
            "YAML config, such as configs/tiny.yaml"
        )
    why = "" if isinstance(e, TypeError) else f" ({first_line(e)})"  # (TypeError: the YAML is a list or a value)
    return f"--config {path} is not a config of key: value lines{why}; start from one such as configs/tiny.yaml"


def _check_overrides(overrides: List[str]) -> None:
    """An override torchtune cannot split into one key and one value, named with the argument it most likely meant
    (``batch_size 4`` -> ``batch_size=4``)."""
    for i, arg in enumerate(overrides):
        if arg.startswith("~"):
            continue
        count = arg.count("=")
        if count == 1:
            continue
        if count > 1:
            raise BadInput(
                f"the override {arg!r} holds more than one '='; torchtune splits key=value at the only '=', so a value "
                "with '=' in it goes in the --config file"
            )
        value = "VALUE"
        for following in overrides[i + 1 : i + 3]:  # (`batch_size 4`, or `batch_size = 4`)
            bare = following.strip("=")
            if "=" in bare:
                break  # the next override
            if bare:
                value = bare
                break
        raise BadInput(f"the override {arg!r} has no '='; {FORMAT}: {arg}={value}")
