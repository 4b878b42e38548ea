#!/usr/bin/env bash
# Device call 20 (nvidia-h200), session 5: every GPU-marked optimizer test once more, now with this session's GPU cases
# of the split launch (bit-exact against one launch, grads missing in either part) and of the direct relaunch after
# a grad turns up misaligned. The optimizer code is call 17's (commit 1393f0e); only tests changed since.
export PYTHONPATH=$PWD:$PWD/.devsite/site PYTHONUNBUFFERED=1
timeout 200 python -m pytest -q -m gpu tests/test_optimizers.py -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
tail -3 $OUT/gpu_tests.log
