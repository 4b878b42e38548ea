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

FINDER_SOURCE = '''"""Resolve the top-level name `recipes` to {where}/recipes.

Installed by hatch_build.py of that repo (read its docstring for why): torchtune ships a
`recipes` package that shadows ours and `tune run` appends the cwd after site-packages.
"""
import importlib.machinery
import os
import sys

REPO_ROOT = {root}


class RecipesFinder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "recipes":
            return None
        return importlib.machinery.PathFinder.find_spec(name, [REPO_ROOT])

    @classmethod
    def invalidate_caches(cls):
        pass


if not any(getattr(f, "__name__", "") == "RecipesFinder" for f in sys.meta_path):
    sys.meta_path.insert(0, RecipesFinder)
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
            module.write_text(FINDER_SOURCE.format(where=repo, root=repr(repo)))
            key = "force_include_editable"
        else:
            # pyproject excludes recipes/ from this wheel's top level; it goes in here instead.
            module.write_text(FINDER_SOURCE.format(
                where="site-packages/_finetune_recipes",
                root='os.path.join(os.path.dirname(os.path.abspath(__file__)), "_finetune_recipes")'))
            key = "force_include"
            build_data[key][str(Path(self.root) / "recipes")] = "_finetune_recipes/recipes"
        build_data[key][str(module)] = f"{FINDER_MODULE}.py"
        build_data[key][str(pth)] = f"{FINDER_MODULE}.pth"

    def finalize(self, version, build_data, artifact_path):
        if getattr(self, "_tmp", None) is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
