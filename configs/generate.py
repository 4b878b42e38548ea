"""Writes each FP8 twin, ``configs/<family>/<size>_full_<class>_fp8.yaml``, from its bf16 config and its row in
``TWINS`` below.

    python configs/generate.py           # write the twins
    python configs/generate.py --check   # exit 1, naming each committed twin that differs from what would be written

A twin is its bf16 config line for line (the same keys, values and comments) with FP8 matmuls (``fp8: tensorwise``),
FlashAttention's varlen kernel for the packed rows (``packed_attention: varlen``), an output folder of its own
(``output_dir`` + ``-fp8``) and the settings of its row, under a header that says what FP8 changes and how to launch
it. So a setting fixed in a bf16 config reaches its twin when this script runs, and tests/configs/test_configs.py fails
while a committed twin differs from what this script writes: edit the bf16 config or the row, never the twin.

The FP8 configs with no bf16 config of their class (Llama 2's 12 GB, the 7-8B models' 16 GB) are written by hand; a
class config without a twin stands in ``NO_TWIN`` with its reason.
"""

import argparse
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent
WIDTH = 118  # the comment text's width: "# " + 118 = the code's 120
VALUE_COLUMN = 34  # where a setting's inline comment starts, as in the configs


@dataclass(frozen=True)
class Twin:
    """What one twin adds to its bf16 config."""

    kept_bf16: str  # which layers stay bf16 under fp8=tensorwise, and why (it depends on the model's shapes)
    converted: str = "The query, output and MLP projections"  # which run in FP8
    settings: dict[str, tuple[str, str]] = field(default_factory=dict)  # key: (YAML value, inline comment)
    after: str = "compile"  # the top-level key the twin's settings follow
    note: str = ""  # the twin's own trade-off, in words


KV_STAY = "the key and value projections ({wide} wide: grouped-query attention) stay bf16, where the casts would cost more than the faster matmul saves"
EMBEDDING = "the embedding and the output layer stay bf16"
TIED = "the embedding (tied to the output layer) and the output layer stay bf16"
LLAMA2 = Twin(
    "the output layer (the vocabulary logits, whose loss is the most precision-sensitive step) and the embedding stay "
    "bf16",
    converted="All the projections (query, key, value, output, MLP)",
)
LLAMA3_8B = Twin(f"{KV_STAY.format(wide='1,024')}; {EMBEDDING}")
LLAMA3_3B = Twin(f"{KV_STAY.format(wide='1,024')}; {TIED}")
QWEN2_BIAS = "the query projection's bias is added in bf16 after its FP8 matmul"
QWEN2_7B = Twin(f"{KV_STAY.format(wide='512')}; {EMBEDDING}; {QWEN2_BIAS}")
QWEN2_3B = Twin(f"{KV_STAY.format(wide='256')}; {TIED}; {QWEN2_BIAS}")
QWEN3 = Twin(
    f"{KV_STAY.format(wide='1,024')}; {EMBEDDING}; the query and key RMSNorms act on the projections' bf16 outputs"
)
MISTRAL = LLAMA3_8B

# Every other layer recomputed: measured faster than every layer for the 3B twins at 24 GiB, and still within the
# class (bench/results/model_families_e2e_h200.json, runs l and m; docs/models.md).
EVERY_OTHER_LAYER = dict(
    settings={
        "ac_mode": ("selective", "every other layer recomputed (ac_option: 2): faster, and"),
        "ac_option": ("2", "within 24 GiB here (ac_mode: full recomputes every layer)"),
    },
    after="enable_activation_checkpointing",
    note="Every other layer is recomputed in backward (ac_mode=selective ac_option=2), where the bf16 config recomputes "
    "every layer: faster, and within the class, though with less headroom; ac_mode=full gives that memory back if a "
    "card runs out of it.",
)
CPU_BOUND = (
    "FP8's gain on this model moves between calls: its step issues far more operations than the bf16 step, so a "
    'slow or busy host CPU can take the gain back (docs/models.md, "FP8 twins", has the profile).'
)

# The bf16 config (relative to configs/) -> its twin's row.
TWINS = {
    "llama2/7B_full_80gb.yaml": LLAMA2,
    "llama2/7B_full_24gb.yaml": LLAMA2,
    "llama2/7B_full_16gb.yaml": LLAMA2,
    "llama3_1/8B_full_80gb.yaml": LLAMA3_8B,
    "llama3_1/8B_full_32gb.yaml": LLAMA3_8B,
    "llama3_2/3B_full_80gb.yaml": LLAMA3_3B,
    "llama3_2/3B_full_24gb.yaml": Twin(LLAMA3_3B.kept_bf16, **EVERY_OTHER_LAYER),
    "llama3_2/3B_full_12gb.yaml": LLAMA3_3B,
    "qwen2_5/7B_full_80gb.yaml": QWEN2_7B,
    "qwen2_5/7B_full_32gb.yaml": QWEN2_7B,
    "qwen2_5/3B_full_80gb.yaml": Twin(QWEN2_3B.kept_bf16, note=CPU_BOUND),
    "qwen2_5/3B_full_24gb.yaml": Twin(QWEN2_3B.kept_bf16, **EVERY_OTHER_LAYER),
    "qwen2_5/3B_full_12gb.yaml": QWEN2_3B,
    "qwen3/8B_full_80gb.yaml": QWEN3,
    "qwen3/8B_full_32gb.yaml": QWEN3,
    "mistral/7B_full_80gb.yaml": MISTRAL,
    "mistral/7B_full_32gb.yaml": MISTRAL,
}

# The class configs with no twin, and why (each class config is in TWINS or here: tests/configs/test_configs.py).
NO_TWIN = {
    "qwen3_moe/30B_A3B_full_80gb.yaml": "fp8 converts nn.Linear layers only: the experts, most of the FLOPs, would "
    "stay bf16; a twin waits for torchao's float8 grouped GEMM to measure faster on them",
}

# What every twin sets, after its own settings.
FP8 = {
    "packed_attention": ("varlen", "FlashAttention's varlen kernel for packed rows (CUDA, sm80+); flex = torchtune's"),
    "fp8": ("tensorwise", "FP8 matmuls in the transformer layers (torchao float8 training)"),
}
LAUNCH = re.compile(r"^#   tune run (?P<recipe>\S+) --config \S+ \\\n#     (?P<args>.*)$", re.M)


def twin_path(source: Path) -> Path:
    return source.with_name(f"{source.stem}_fp8.yaml")


def comment(*paragraphs: str) -> list[str]:
    lines = []
    for text in paragraphs:
        lines += textwrap.wrap(text, WIDTH, break_long_words=False, break_on_hyphens=False)
    return [f"# {line}" for line in lines]


def setting(key: str, value: str, note: str) -> str:
    return f"{key}: {value}".ljust(VALUE_COLUMN - 1) + f" # {note}"


def top_level(line: str) -> str | None:
    match = re.match(r"(\w+):", line)
    return match.group(1) if match else None


def own_output_dir(line: str) -> str:
    """``output_dir: X`` -> ``output_dir: X-fp8``, its inline comment (if any) where it was."""
    value, spaces, rest = re.match(r"output_dir: (\S+)( *)(.*)$", line).groups()
    return f"output_dir: {value}-fp8" + (" " * max(1, len(spaces) - 4) + rest if rest else "")


def body(source_body: list[str], twin: Twin) -> list[str]:
    """The bf16 config's keys with the twin's output folder and settings: a key the bf16 config has is set in its
    place; new keys go after ``twin.after`` (the twin's own) or after ``compile`` (FP8's), in the table's order."""
    lines = [own_output_dir(line) if top_level(line) == "output_dir" else line for line in source_body]
    for settings, after in ((twin.settings, twin.after), (FP8, "compile")):
        keys = [top_level(line) for line in lines]
        anchor = max(keys.index(key) for key in [after, *settings] if key in keys)
        for key, (value, note) in settings.items():
            if key in keys:
                i = keys.index(key)
                if not re.match(rf"{key}: {re.escape(value)}(\s|$)", lines[i]):
                    lines[i] = setting(key, value, note)
            else:
                anchor += 1
                lines.insert(anchor, setting(key, value, note))
                keys.insert(anchor, key)
    return lines


def generate(name: str, twin: Twin) -> str:
    source = CONFIGS / name
    text = source.read_text()
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    launch = LAUNCH.search(text)
    assert launch, f"{source}: no launch command in the header"
    source_name, twin_name = f"configs/{name}", f"configs/{twin_path(Path(name))}"
    output_dir = re.search(r"^output_dir: (\S+)", text, re.M).group(1)
    args = launch["args"].replace(f"output_dir={output_dir}", f"output_dir={output_dir}-fp8")
    has_varlen = re.search(r"^packed_attention: varlen", text, re.M)
    what = "FP8 matmuls (fp8=tensorwise)" + (
        "" if has_varlen else " and FlashAttention's varlen kernel for the packed rows (packed_attention=varlen)"
    )
    header = [
        f"# Generated by `python configs/generate.py` from {source_name} and its row in configs/generate.py:",
        "# edit those, not this file (tests/configs/test_configs.py fails while the two disagree).",
        "#",
        *comment(
            f"{source_name} with {what}, for GPUs with FP8 tensor cores (compute capability 8.9+: H100/H200, L4, "
            "RTX 4090 and later; an A100 or RTX 3090 refuses it before training: the bf16 config is for those). "
            f"{twin.converted} of the transformer layers cast their inputs, weights and output gradients to FP8 with "
            f"dynamic per-tensor scales; {twin.kept_bf16}. Weights, gradients, our 4-bit states and their stochastic "
            'rounding are as in the bf16 config, and so are checkpoints (docs/recipes.md, "FP8 matmuls").',
            *([twin.note] if twin.note else []),
            "Measured tokens/s and memory, beside the bf16 config and torchtune's recipe: docs/models.md, \"Configs "
            'by card".',
        ),
        "#",
        f"#   tune run {launch['recipe']} --config {twin_name} \\",
        f"#     {args}",
        "#",
        *comment(
            f"Overrides as in {source_name}; fp8=rowwise for per-row scales; packed_attention=flex for torchtune's "
            "flex-attention block mask."
        ),
        "",
    ]
    return "\n".join(header + body(lines[start:], twin)) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a committed twin differs")
    args = parser.parse_args(argv)
    stale = []
    for name, twin in TWINS.items():
        path, text = CONFIGS / twin_path(Path(name)), generate(name, twin)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path.relative_to(CONFIGS.parent)))
        elif not path.is_file() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(CONFIGS.parent)}")
    if stale:
        print("error: these twins differ from their bf16 config; run python configs/generate.py:", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
