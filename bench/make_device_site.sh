#!/usr/bin/env bash
# Builds .devsite/: a trimmed, unpacked site folder for the H200 device machine, whose image has torch,
# triton, transformers, safetensors and sentencepiece but not torchtune, torchao, bitsandbytes, datasets,
# omegaconf or torchdata. A device call carries at most 64 MiB, so we copy the pure-Python packages and
# only bitsandbytes' CUDA 13.0 library, lm-eval as a tarball, and xz-compress the data files. Run from the repo
# root with the project's venv active; then `run` with carry=[".devsite"] and `source bench/device/setup.sh` first.
set -euo pipefail
SITE=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
OUT=.devsite
rm -rf "$OUT"; mkdir -p "$OUT/site" "$OUT/data"
for pkg in torchtune torchao omegaconf datasets torchdata dill multiprocess recipes; do
  cp -r "$SITE/$pkg" "$OUT/site/"
done
# The fused linear cross-entropy kernels (pip install -e '.[fused-ce]'), where installed: pure Python and Triton, as
# one xz tarball (liger-kernel is 8 MB unpacked, 0.5 MB packed); bench/device/setup.sh unpacks it into $OUT/site.
FUSED=$(cd "$SITE" && ls -d cut_cross_entropy liger_kernel cut_cross_entropy-*.dist-info liger_kernel-*.dist-info 2>/dev/null || true)
[ -n "$FUSED" ] && (cd "$SITE" && tar --exclude=__pycache__ -cJf "$OLDPWD/$OUT/fused_ce.tar.xz" $FUSED)
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
# lm-eval and what it imports that the image lacks, as one xz tarball (lm-eval's task YAMLs alone are ~70 MB
# unpacked); bench/device/setup.sh unpacks it into $OUT/site.
EVAL_PKGS="lm_eval nltk rouge_score chardet defusedxml pytz sniffio sqlitedict.py word2number more_itertools
  pytablewriter dataproperty mbstrdecoder pathvalidate tabledata tcolorpy typepy evaluate"
(cd "$SITE" && tar --exclude=__pycache__ -cJf "$OLDPWD/$OUT/eval_site.tar.xz" $EVAL_PKGS \
  $(for p in $EVAL_PKGS; do n=${p%.py}; ls -d ${n}-*.dist-info 2>/dev/null || true; done))
DATA=${DATA_DIR:-../shared/data}
xz -T2 -6 -c "$DATA/alpaca/alpaca_data.json" > "$OUT/data/alpaca_data.json.xz"
cp "$DATA/llama2_tokenizer/tokenizer.model" "$OUT/data/"
xz -T2 -6 -c "$DATA/truthfulqa/mc_task.json" > "$OUT/data/mc_task.json.xz"
du -sh "$OUT"
