"""`tune run recipes/<file>.py` runs this checkout's recipes: an import hook, loaded at interpreter start.

Why it is needed. `tune run recipes/full_finetune_single_device.py` turns the path into the module name
`recipes.full_finetune_single_device`, appends the current folder to the END of sys.path and runs the module.
torchtune's wheel installs a top-level package of that name into site-packages (its __init__ raises
ModuleNotFoundError on purpose), which comes first, so without this hook every `tune run recipes/...` fails. Naming
the library `finetune` does not change that: the entry points keep the path users type.

How. The install puts `finetune_tune_run.pth` (one `import` line) into site-packages; it imports this module when
`finetune` is importable. A meta-path finder at the front of sys.meta_path answers for exactly one name,
`recipes`, with the `recipes/` folder beside this package (an editable install's checkout); every other import,
torchtune's own included, goes through the normal finders. It also mends two things of `tune run` where a newcomer
meets them (``_mend_tune_run``). A moved checkout needs `pip install -e .` again, as any editable install does; a
standard wheel carries no recipes/, and the finder then steps aside. Keep this module's imports to the standard
library: it runs in every interpreter of the environment.
"""

import importlib.abc
import importlib.machinery
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
RECIPES_DIR = os.path.join(REPO_ROOT, "recipes")


def _mend_tune_run(Run):
    """`tune run` (torchtune._cli.run.Run), mended where a newcomer meets it:

    - A recipe given by path becomes a module named after that path, which fails with "Relative module names not
      supported" for a path that leaves the current folder (`tune run ../repo/recipes/x.py`, an absolute path).
      This repository's recipes run from any folder (their package resolves here); another file is one `error:`.
    - A bad input stops every torchrun rank with exit status 2, and each writes its `error: ...` line into its
      torchelastic error file (finetune/reporting/console.py, report_bad_input); torchrun then raises ChildFailedError,
      which `tune` prints as a 30-line report. That line is printed instead, once and last, with exit status 2.
      Any other failure keeps torchrun's report.
    - Ctrl-C reaches torchrun's agent as well as the ranks: it stops them (each prints the run's summary and the
      checkpoint to resume from) and raises SignalException, which `tune` printed as a traceback after those lines.
      The launch exits with the shell's 130 instead, the ranks' lines last.
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
                "after that path, so the path must lie below the current folder; cd "
                + os.path.dirname(full)
                + " and give its file name (this repository's recipes/*.py run from any folder)\n"
            )
            raise SystemExit(2)
        return dotted

    def distributed(self, args, is_builtin):
        import signal

        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        try:
            return run_distributed(self, args, is_builtin=is_builtin)
        except SignalException as e:
            if e.sigval != signal.SIGINT:
                raise
            raise SystemExit(130) from None  # (Ctrl-C: the ranks have said where the run stands, last)
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
            sys.stderr.write(lines[0] + "\n")
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


if os.path.isfile(os.path.join(RECIPES_DIR, "__init__.py")) and not any(
    getattr(f, "__name__", "") == "RecipesFinder" for f in sys.meta_path
):
    sys.meta_path.insert(0, RecipesFinder)

# Ctrl-C while `tune run` (or a recipe started by its path) still imports torch and torchtune, before the recipe's own
# handler is in place: one line instead of a traceback through the import machinery. Python still ends the process by
# SIGINT once the hook returns (the shell's status 130), as for any Ctrl-C it did not handle; what a recipe handles
# itself (its setup and training: docs/recipes.md, "Stopping a run") never reaches the hook.
STARTED_BY = os.path.realpath(sys.argv[0]) if sys.argv and sys.argv[0] else ""


def _ctrl_c_in_one_line(previous):
    def hook(kind, value, traceback):
        if issubclass(kind, KeyboardInterrupt):
            sys.stderr.write("Stopped by Ctrl-C while starting (before the recipe's setup): nothing was trained.\n")
            return
        previous(kind, value, traceback)

    return hook


if os.path.basename(STARTED_BY) == "tune" or os.path.dirname(STARTED_BY) == RECIPES_DIR:
    sys.excepthook = _ctrl_c_in_one_line(sys.excepthook)

# The `tune` command imports torchtune, and with it torchao, before any recipe code runs, so torchao's "Skipping import
# of cpp extensions" (its C++ kernels built for another torch; nothing here uses them) opened every `tune run`. In that
# one command, that one message is dropped, as the recipes drop it in their own processes (KNOWN_NOISE).
if sys.argv and os.path.basename(sys.argv[0]) == "tune":
    import logging

    class _DropMessage(logging.Filter):
        def filter(self, record):
            return "Skipping import of cpp extensions" not in record.getMessage()

    logging.getLogger("torchao").addFilter(_DropMessage())
