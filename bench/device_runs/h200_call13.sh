#!/usr/bin/env bash
# Device call 13 (nvidia-h200), session 3: the kernel's walk in chunks of 8 tiles (programs interleaved) instead of
# one contiguous run per program: the GPU tests of kernel vs torch path and our
# step times, torch fused as the yardstick.
export PYTHONPATH=$PWD:$PWD/.devsite/site
timeout 70 python -m pytest -q -m gpu tests/test_optimizers.py -p no:cacheprovider -k "matches_torch" 2>&1 | tail -2
timeout 50 python bench/optimizer_step.py --steps 10 --variants "torch.optim.AdamW(fused=True)" optimizers.AdamW8bit \
  optimizers.AdamWFp8 optimizers.AdamW4bit optimizers.AdamW 2>&1 | grep "^|"
