"""The library under the recipes: what is not the training story, grouped by concern.

- ``settings``: the config, read and checked once into the frozen sections of one ``Settings`` (each component takes
  its section); ``optimizer``: the optimizer it names.
- ``data/``: datasets and their loader, packing, the HF tokenizer.
- ``model/``: the model builders torchtune lacks, packed attention, the fused loss, device and model preparation.
- ``checkpoint/``: the Hugging Face folder format, the run folder and its lock, background saves, resume.
- ``reporting/``: metrics, the summary, wandb, the profiler, what the terminal shows.
- ``stops``, ``launch``: why a run stops early, and the launcher that makes a stop signal save under torchrun.
- ``base``, ``run_files``, ``host_memory``: the bottom layer that ``eval/`` and the concerns share (the bad-input
  error, HF weight files, the files that tie a run to its checkpoints, host memory as a save and streaming see it).
  The packages' order is ``PACKAGE_ORDER`` in tests/test_layout.py.

This file imports nothing: ``tune_run`` (the import hook that makes ``tune run recipes/<file>.py`` find this
checkout's recipes) is loaded through it in every interpreter of the environment.
"""
