#!/usr/bin/env bash
# Device call 12 (nvidia-h200), session 3: all GPU-marked optimizer tests with the final code, then a check of our
# step times with the final launch defaults (torch fused as the yardstick). Output came back in the call's reply.
export PYTHONPATH=$PWD:$PWD/.devsite/site
timeout 200 python -m pytest -q -m gpu tests/test_optimizers.py -p no:cacheprovider 2>&1 | tail -3
timeout 60 python bench/optimizer_step.py --steps 10 --variants "torch.optim.AdamW(fused=True)" optimizers.AdamW8bit \
  optimizers.AdamW4bit optimizers.AdamWFp8 optimizers.AdamW 2>&1 | grep "^|"
