"""Put on PYTHONPATH by bench/configs_check.py for a row's runs: at exit, each process writes the file of every module
it loaded to ``$FINETUNE_MODULES_DIR/<pid>.txt``, one a line.

Why: the row names the repository files its runs imported, so that a change to a file no run loaded keeps the row
current (bench/configs_shipped.py). Python's import-time lines (``PYTHONPROFILEIMPORTTIME``) leave out a module that
``importlib.import_module`` loads (a package's lazy attribute, as ``finetune.streaming.check_host_room``, or a
config's ``_component_``), and a list that misses a file the run executed would keep the row current across a change
to it. ``sys.modules`` at exit holds every module the process loaded. A process killed before its exit writes nothing;
the import-time lines still count.

Python imports the first ``sitecustomize`` on its path: the environment's own, where it has one, is run after this
one's hook is set, as it would have been without this folder.
"""

import atexit
import os
import sys


def _record() -> None:
    folder = os.environ.get("FINETUNE_MODULES_DIR")
    if not folder:
        return
    files = sorted({f for m in list(sys.modules.values()) if isinstance(f := getattr(m, "__file__", None), str)})
    try:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{os.getpid()}.txt"), "w") as out:
            out.write("\n".join(files) + "\n")
    except OSError:  # (the row falls back on the import-time lines)
        pass


def _run_the_environments_own() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


atexit.register(_record)
_run_the_environments_own()
