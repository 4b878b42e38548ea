#!/usr/bin/env bash
# Builds .devsite/: a trimmed, unpacked site folder for the H200 device machine, whose image has torch,
# triton, transformers, safetensors and sentencepiece but not torchtune, torchao, bitsandbytes, datasets,
# omegaconf or torchdata. A device call carries at most 64 MiB, so we copy the pure-Python packages and
# only bitsandbytes' CUDA 13.0 library, and xz-compress the Alpaca file. Run from the repo root with the
# project's venv active; then `run` with carry=[".devsite"] and PYTHONPATH=.devsite/site.
set -euo pipefail
SITE=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
OUT=.devsite
rm -rf "$OUT"; mkdir -p "$OUT/site" "$OUT/data"
for pkg in torchtune torchao omegaconf datasets torchdata dill multiprocess recipes; do
  cp -r "$SITE/$pkg" "$OUT/site/"
done
# torchao's C++ extensions are built for another torch; it skips them with a warning, so leave them out.
find "$OUT/site/torchao" -name '*.so' -delete
mkdir -p "$OUT/site/bitsandbytes"
(cd "$SITE/bitsandbytes" && find . -type f ! -name '*.so' -exec cp --parents {} "$OLDPWD/$OUT/site/bitsandbytes/" \;)
cp "$SITE/bitsandbytes/libbitsandbytes_cuda130.so" "$OUT/site/bitsandbytes/"
# datasets reads the installed versions of its dependencies at import, so their dist-info must travel too
for pkg in torchtune torchao bitsandbytes datasets dill multiprocess omegaconf torchdata; do
  cp -r "$SITE"/${pkg}-*.dist-info "$OUT/site/"
done
find "$OUT" -name '__pycache__' -prune -exec rm -rf {} +
DATA=${DATA_DIR:-../shared/data}
xz -T2 -6 -c "$DATA/alpaca/alpaca_data.json" > "$OUT/data/alpaca_data.json.xz"
cp "$DATA/llama2_tokenizer/tokenizer.model" "$OUT/data/"
du -sh "$OUT"
