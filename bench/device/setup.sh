# Sourced at the start of a device call (nvidia-h200): the carried site folder (bench/make_device_site.sh), the data
# under /tmp/data, and an HF-format Llama2-7B with random values under /tmp/llama2-7b-random.
export PYTHONPATH=$PWD:$PWD/.devsite/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p /tmp/data/alpaca /tmp/data/llama2_tokenizer
xz -dc .devsite/data/alpaca_data.json.xz > /tmp/data/alpaca/alpaca_data.json
cp .devsite/data/tokenizer.model /tmp/data/llama2_tokenizer/
CKPT=/tmp/llama2-7b-random
if [ ! -f $CKPT/config.json ]; then
  t=$(date +%s); python bench/e2e.py --make-checkpoint $CKPT --tokenizer /tmp/data/llama2_tokenizer/tokenizer.model
  echo "checkpoint made in $(( $(date +%s) - t )) s: $(du -sh $CKPT | cut -f1)"
fi
E2E=(python bench/e2e.py --checkpoint-dir $CKPT --data-dir /tmp/data --stock-dir .devsite/site/recipes)
