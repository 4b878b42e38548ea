"""Hatch build hook: make the name `recipes` mean this repo's recipes/ folder.

Why: torchtune's wheel installs a top-level package `recipes` into site-packages whose
__init__ raises ModuleNotFoundError on purpose. `tune run recipes/full_finetune_single_device.py`
turns the path into the module name `recipes.full_finetune_single_device`, appends the cwd to
the END of sys.path and calls runpy.run_module, so the import finds torchtune's package first
and fails. Reordering sys.path would need an environment variable (PYTHONPATH) from every user,
and renaming our folder would break the `tune run recipes/...` command everyone expects.

How: the wheel carries a small module, `_finetune_recipes_finder.py`, and a `.pth` file whose
one `import` line loads it at interpreter start-up. The module puts a meta-path finder at the
front of sys.meta_path that answers for exactly one name, `recipes`, by looking it up in this
repo's root only (importlib.machinery.PathFinder.find_spec('recipes', [REPO_ROOT])). Every other
import, torchtune's own included, goes through the normal finders untouched. Submodules
(`recipes.full_finetune_single_device`) follow from the package's __path__.

The same finder mends two things of torchtune's `tune run` where a newcomer meets them (the module's
`_mend_tune_run` says how): a recipe path outside the current folder (`tune run /path/to/repo/recipes/x.py`, which
torchtune turns into the module name ".path.to...") runs our recipe instead of failing with "Relative module names
not supported", and a bad input under torchrun ends with the recipe's one `error:` line and exit status 2 instead of
torchrun's 30-line ChildFailedError report. It does so by wrapping the loader of `torchtune._cli.run` when that
module is imported; nothing else of torchtune is touched.

Trade-off: for an editable install the repo's absolute path is baked in, so a moved checkout
needs `pip install -e .` again (until then the finder finds nothing there and steps aside).
A standard (non-editable) wheel must not put recipes/ at the top of site-packages, where it
would overwrite torchtune's recipes/__init__.py: it carries our recipes as
`_finetune_recipes/recipes/` and the finder points there instead.
"""

import shutil
import tempfile
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

FINDER_MODULE = "_finetune_recipes_finder"

FINDER_SOURCE = '''"""Resolve the top-level name `recipes` to @WHERE@/recipes, and mend two things of `tune run`.

Installed by hatch_build.py of that repo (read its docstring for why): torchtune ships a
`recipes` package that shadows ours and `tune run` appends the cwd after site-packages.
"""
import importlib.abc
import importlib.machinery
import os
import sys

REPO_ROOT = @ROOT@
RECIPES_DIR = os.path.realpath(os.path.join(REPO_ROOT, "recipes"))


def _mend_tune_run(Run):
    """`tune run` (torchtune._cli.run.Run), mended where a newcomer meets it:

    - A recipe given by path becomes a module named after that path, which fails with "Relative module names not
      supported" for a path that leaves the current folder (`tune run ../repo/recipes/x.py`, an absolute path).
      This repository's recipes run from any folder (their package resolves here); another file is one `error:`.
    - A bad input stops every torchrun rank with exit status 2, and each writes its `error: ...` line into its
      torchelastic error file (recipes/_reporting.py, report_bad_input); torchrun then raises ChildFailedError,
      which `tune` prints as a 30-line report. That line is printed instead, once and last, with exit status 2.
      Any other failure keeps torchrun's report.
    """
    if not (hasattr(Run, "_convert_to_dotpath") and hasattr(Run, "_run_distributed")):
        return  # (another torchtune: leave its `tune run` as it is)
    to_dotpath, run_distributed = Run._convert_to_dotpath, Run._run_distributed

    def convert(self, recipe_path):
        full = os.path.realpath(recipe_path)
        if os.path.dirname(full) == RECIPES_DIR and full.endswith(".py"):
            return "recipes." + os.path.basename(full)[:-3]
        dotted = to_dotpath(self, recipe_path)
        if dotted.startswith("."):
            sys.stderr.write(
                "error: tune run " + recipe_path + ": tune imports a recipe given by its path as the module named "
                "after that path, so the path must lie below the current folder; cd " + os.path.dirname(full) +
                " and give its file name (this repository's recipes/*.py run from any folder)\\n")
            raise SystemExit(2)
        return dotted

    def distributed(self, args, is_builtin):
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        try:
            return run_distributed(self, args, is_builtin=is_builtin)
        except ChildFailedError as e:
            lines = []
            for failure in e.failures.values():
                text = failure.message.get("message") if isinstance(failure.message, dict) else failure.message
                if failure.exitcode == 2 and str(text).startswith("error: "):
                    lines.append(str(text))
                elif failure.exitcode > 0:  # a failure of another kind (ranks stopped by a signal are not)
                    raise
            if not lines:
                raise
            sys.stderr.write(lines[0] + "\\n")
            raise SystemExit(2)

    Run._convert_to_dotpath, Run._run_distributed = convert, distributed


class _MendAfterLoading(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        if hasattr(module, "Run"):
            _mend_tune_run(module.Run)


class RecipesFinder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "recipes":
            return importlib.machinery.PathFinder.find_spec(name, [REPO_ROOT])
        if name == "torchtune._cli.run":  # (the real module, found by the finders after this one)
            for finder in sys.meta_path:
                if finder is not cls and hasattr(finder, "find_spec"):
                    spec = finder.find_spec(name, path, target)
                    if spec is not None and spec.loader is not None:
                        spec.loader = _MendAfterLoading(spec.loader)
                        return spec
        return None

    @classmethod
    def invalidate_caches(cls):
        pass


if not any(getattr(f, "__name__", "") == "RecipesFinder" for f in sys.meta_path):
    sys.meta_path.insert(0, RecipesFinder)

# The `tune` command imports torchtune, and with it torchao, before any recipe code runs, so torchao's "Skipping import
# of cpp extensions" (its C++ kernels built for another torch; nothing here uses them) opened every `tune run`. In that
# one command, that one message is dropped, as the recipes drop it in their own processes (KNOWN_NOISE).
if sys.argv and os.path.basename(sys.argv[0]) == "tune":
    import logging

    class _DropMessage(logging.Filter):
        def filter(self, record):
            return "Skipping import of cpp extensions" not in record.getMessage()

    logging.getLogger("torchao").addFilter(_DropMessage())
'''


class RecipesFinderHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version, build_data):
        if self.target_name != "wheel":
            return
        self._tmp = Path(tempfile.mkdtemp(prefix="recipes-finder-"))
        module = self._tmp / f"{FINDER_MODULE}.py"
        pth = self._tmp / f"{FINDER_MODULE}.pth"
        pth.write_text(f"import {FINDER_MODULE}\n")
        if version == "editable":
            repo = str(Path(self.root).resolve())
            module.write_text(FINDER_SOURCE.replace("@WHERE@", repo).replace("@ROOT@", repr(repo)))
            key = "force_include_editable"
        else:
            # pyproject excludes recipes/ from this wheel's top level; it goes in here instead.
            module.write_text(FINDER_SOURCE.replace("@WHERE@", "site-packages/_finetune_recipes").replace(
                "@ROOT@", 'os.path.join(os.path.dirname(os.path.abspath(__file__)), "_finetune_recipes")'))
            key = "force_include"
            build_data[key][str(Path(self.root) / "recipes")] = "_finetune_recipes/recipes"
        build_data[key][str(module)] = f"{FINDER_MODULE}.py"
        build_data[key][str(pth)] = f"{FINDER_MODULE}.pth"

    def finalize(self, version, build_data, artifact_path):
        if getattr(self, "_tmp", None) is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
