# Sourced at the start of a device call (nvidia-h200): the carried site folder (bench/make_device_site.sh, with
# lm-eval unpacked into it), the data under /tmp/data, and an HF-format Llama2-7B with random values under /tmp/llama2-7b-random.
export PYTHONPATH=$PWD:$PWD/.devsite/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# (the tests read the data beside the checkout, which the device copy has not: they take /tmp/data, made below)
export TEST_DATA_DIR=/tmp/data
mkdir -p /tmp/data/alpaca /tmp/data/llama2_tokenizer /tmp/data/truthfulqa
[ -s /tmp/data/alpaca/alpaca_data.json ] || xz -dc .devsite/data/alpaca_data.json.xz > /tmp/data/alpaca/alpaca_data.json
cp .devsite/data/tokenizer.model /tmp/data/llama2_tokenizer/
[ -f .devsite/data/mc_task.json.xz ] && xz -dc .devsite/data/mc_task.json.xz > /tmp/data/truthfulqa/mc_task.json
[ -f .devsite/eval_site.tar.xz ] && [ ! -d .devsite/site/lm_eval ] && tar -xJf .devsite/eval_site.tar.xz -C .devsite/site
[ -f .devsite/fused_ce.tar.xz ] && [ ! -d .devsite/site/liger_kernel ] && tar -xJf .devsite/fused_ce.tar.xz -C .devsite/site
CKPT=${CKPT:-/tmp/llama2-7b-random}  # CKPT=/dev/shm/... keeps the disk for the run's own checkpoints
if [ -z "${SKIP_CKPT:-}" ] && [ ! -f $CKPT/config.json ]; then  # (SKIP_CKPT=1: a benchmark that makes its own)
  t=$(date +%s); python bench/e2e.py --make-checkpoint $CKPT --tokenizer /tmp/data/llama2_tokenizer/tokenizer.model
  echo "checkpoint made in $(( $(date +%s) - t )) s: $(du -sh $CKPT | cut -f1)"
fi
E2E=(python bench/e2e.py --checkpoint-dir $CKPT --data-dir /tmp/data --stock-dir .devsite/site/recipes)
