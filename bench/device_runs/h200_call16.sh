#!/usr/bin/env bash
# Device call 16 (nvidia-h200), session 4: the 4-bit first moment decoded from its 16 values (one cache line) instead
# of a 2 KB table of byte pairs (scratch runs of this session measured 15.8-16.0 vs 16.1 ms device): the GPU-marked
# 4-bit tests, then our step times with torch fused as the yardstick (later_runs of optimizer_step_h200.json).
export PYTHONPATH=$PWD:$PWD/.devsite/site PYTHONUNBUFFERED=1
timeout 100 python -m pytest -q -m gpu tests/test_optimizers.py -p no:cacheprovider -k "AdamW4bit" 2>&1 | tail -1
timeout 110 python bench/optimizer_step.py --steps 10 --variants "torch.optim.AdamW(fused=True)" optimizers.AdamW8bit \
  optimizers.AdamWFp8 optimizers.AdamW4bit optimizers.AdamW "torch.optim.AdamW(fused=True)" --out $OUT/later.json 2>&1 | grep "^|"
