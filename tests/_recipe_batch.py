"""Run several fine-tunes one after another in one process: ``python tests/_recipe_batch.py RUNS.json``.

RUNS.json is a list of argument lists, each what follows ``tune run recipes/full_finetune_single_device.py`` (``--config
FILE key=value ...``). Each run goes through the recipe's entry point as ``tune run`` calls it; the process pays for
importing torch, torchtune and transformers once instead of once per run. Its exit status per run is printed last,
as one JSON list. Tests start it with conftest's ``recipe_env()`` (the pinned vector code their recorded losses need).
"""

import json
import sys

from recipes.full_finetune_single_device import RECIPE_PATH, recipe_main


def main(path: str) -> None:
    codes = []
    for args in json.loads(open(path).read()):
        sys.argv = [RECIPE_PATH, *args]
        try:
            recipe_main()
            codes.append(0)
        except SystemExit as e:
            codes.append(0 if e.code is None else e.code if isinstance(e.code, int) else 1)  # (config.parse exits)
    print(json.dumps(codes))


if __name__ == "__main__":
    main(sys.argv[1])
