"""Launch the distributed recipe on N processes so that a stop signal saves and the launch exits 0.

    python -m recipes.launch --nproc_per_node 2 recipes/full_finetune_distributed.py --config configs/tiny.yaml [k=v ...]

The arguments are `tune run`'s; SIGTERM and SIGUSR1 are this launcher's, not torchrun's (finetune/launch.py says
why and how; docs/distributed.md, "Stopping a run", what each does).
"""

from finetune.launch import main

if __name__ == "__main__":
    main()
