# The entry points: the two fine-tune recipes, the eval and the launcher; the library is finetune/. torchtune's wheel
# also installs a top-level package named `recipes`; finetune/tune_run.py (loaded at interpreter start by the
# install's finetune_tune_run.pth) resolves the name to this folder, so `tune run recipes/<file>.py` runs ours.
