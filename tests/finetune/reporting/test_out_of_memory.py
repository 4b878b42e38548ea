"""Out of GPU memory is one ``error:`` line (finetune/reporting/out_of_memory.py): where, the peak against what the
run had, the config of the class that fits or the keys to try, and the last checkpoint, left intact; exit 2."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torchtune.modules import TransformerDecoder

from conftest import REPO_ROOT, run_here
from finetune.reporting import out_of_memory
from finetune.reporting.out_of_memory import smaller_class_config
from finetune.services import report_out_of_memory

CONFIGS = REPO_ROOT / "configs"
CUDA_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.99 GiB"


def settings(**changes):
    """A run's settings as the OOM line reads them: its memory and training sections and a few run-wide values."""
    base = dict(
        device=torch.device("cuda"),
        memory_limit_gib=16.0,
        batch_size=16,
        accum=1,
        optimizer_in_bwd=False,
        stream_states=False,
        ac_every=None,
        offload_activations=False,
        optimizer=SimpleNamespace(path="torch.optim.AdamW", cpu_offload=False),
        output_dir=Path("/nonexistent/run"),
    )
    v = SimpleNamespace(**{**base, **changes})
    return SimpleNamespace(
        device=v.device,
        output_dir=v.output_dir,
        data=SimpleNamespace(batch_size=v.batch_size),
        memory=SimpleNamespace(
            memory_limit_gib=v.memory_limit_gib,
            stream_states=v.stream_states,
            ac_every=v.ac_every,
            offload_activations=v.offload_activations,
        ),
        training=SimpleNamespace(accum=v.accum, optimizer_in_bwd=v.optimizer_in_bwd, optimizer=v.optimizer),
    )


def keys_for(s, *, distributed):
    return out_of_memory.keys_to_try(
        s.memory, s.training, batch_size=s.data.batch_size, device=s.device, distributed=distributed
    )


def line_for(s, error, *, where, argv):
    return report_out_of_memory(s, error, where=where, argv=argv)


@pytest.mark.parametrize(
    "config, budget, expected",
    [
        ("llama2/7B_full_80gb.yaml", 24, "llama2/7B_full_24gb.yaml"),
        ("llama2/7B_full_80gb_fp8.yaml", 24, "llama2/7B_full_24gb_fp8.yaml"),  # the same variant first
        ("llama2/7B_full_80gb.yaml", 16, "llama2/7B_full_16gb.yaml"),  # (states streamed from host memory)
        ("llama2/7B_full_80gb.yaml", 12, "llama2/7B_full_12gb_fp8.yaml"),  # (another variant where it is the only one)
        ("llama2/7B_full_80gb.yaml", 11, None),  # nothing shipped below 12 GB
        ("qwen2_5/7B_full_80gb.yaml", 40, "qwen2_5/7B_full_32gb.yaml"),  # the same model, not the 3B beside it
        ("qwen2_5/7B_full_32gb.yaml", 30, "qwen2_5/7B_full_16gb_fp8.yaml"),
        ("qwen2_5/7B_full_32gb.yaml", 15, None),
        ("qwen3/8B_full_32gb_fp8.yaml", 16, "qwen3/8B_full_16gb_fp8.yaml"),
        ("mistral/7B_full_80gb.yaml", 16, "mistral/7B_full_16gb_fp8.yaml"),
        ("tiny.yaml", 8, None),  # not a memory-class config
        # A card's own capacity, as CUDA reports it, a little under what it is sold as: its class is offered.
        ("llama2/7B_full_80gb.yaml", 23.64, "llama2/7B_full_24gb.yaml"),  # an RTX 4090
        ("mistral/7B_full_80gb_fp8.yaml", 15.7, "mistral/7B_full_16gb_fp8.yaml"),  # a 16 GB card
        ("llama2/7B_full_24gb_fp8.yaml", 11.76, "llama2/7B_full_12gb_fp8.yaml"),  # a 12 GB card
        ("qwen2_5/3B_full_24gb.yaml", 11.76, "qwen2_5/3B_full_12gb.yaml"),  # a 3B model's 12 GB config
    ],
)
def test_the_class_that_fits_is_the_same_model_in_a_smaller_class(config, budget, expected):
    found = smaller_class_config(str(CONFIGS / config), budget)
    assert found == (CONFIGS / expected if expected else None)


def test_keys_to_try_are_the_ones_not_on_yet():
    assert keys_for(settings(), distributed=False) == [
        "batch_size=8 gradient_accumulation_steps=2",
        "enable_activation_checkpointing=True",
        "optimizer=optimizers.AdamW4bit",
    ]
    on = settings(
        batch_size=1,
        ac_every=1,
        offload_activations=True,
        optimizer=SimpleNamespace(path="optimizers.AdamW4bit", cpu_offload=False),
    )
    assert keys_for(on, distributed=False) == []
    # In backward, the optimizer cannot accumulate: half the batch alone. Activation offloading is one GPU's.
    assert keys_for(settings(optimizer_in_bwd=True, ac_every=1), distributed=True) == [
        "batch_size=8",
        "optimizer=optimizers.AdamW4bit",
    ]
    # On one GPU, in backward, the states can wait in host memory: the cheapest in speed, so first.
    assert keys_for(settings(optimizer_in_bwd=True, ac_every=1), distributed=False) == [
        "stream_optimizer_states=True",
        "batch_size=8",
        "optimizer=optimizers.AdamW4bit",
    ]
    assert "stream_optimizer_states=True" not in keys_for(
        settings(optimizer_in_bwd=True, ac_every=1, stream_states=True), distributed=False
    )


def test_the_line_names_the_peak_the_cap_and_the_class_that_fits(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=140 * 2**30))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: int(15.9 * 2**30))
    argv = ["recipes/full_finetune_single_device.py", "--config", str(CONFIGS / "llama2/7B_full_80gb_fp8.yaml")]
    line = line_for(settings(memory_limit_gib=24.0), RuntimeError(CUDA_OOM), where="at step 3", argv=argv)
    assert line.startswith("out of memory at step 3: the GPU reached 15.9 GiB reserved of 24.0 GiB")
    assert "(device_memory_limit_gib=24; the card has 140.0 GiB)" in line
    assert f"use --config {CONFIGS / 'llama2/7B_full_24gb_fp8.yaml'}, the class that fits" in line
    assert "or try batch_size=8 gradient_accumulation_steps=2" in line
    assert line.endswith("no checkpoint was written")
    assert "\n" not in line
    # Without a cap, the card's capacity is the budget; at 10 GB no shipped class fits: the keys alone.
    line = line_for(settings(memory_limit_gib=None), RuntimeError(CUDA_OOM), where="during setup", argv=[])
    assert "reserved of 140.0 GiB;" in line
    line = line_for(settings(memory_limit_gib=10.0), RuntimeError(CUDA_OOM), where="during setup", argv=argv)
    assert "; try batch_size=8 gradient_accumulation_steps=2; enable_activation_checkpointing=True" in line


def test_a_run_out_of_memory_mid_training_ends_in_one_line_and_keeps_its_checkpoint(tmp_path, monkeypatch):
    """The model's third forward raises torch's OutOfMemoryError (what a GPU raises; the CPU cannot be made to):
    the run ends with exit 2 and one error line naming the step and the step_2 checkpoint, which is complete."""
    forward, calls = TransformerDecoder.forward, []

    def forward_until_out_of_memory(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError(CUDA_OOM)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(TransformerDecoder, "forward", forward_until_out_of_memory)
    out = tmp_path / "out"
    run = run_here(out, "save_every_n_steps=2")
    assert run.returncode == 2, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    assert run.error.startswith("error: out of memory at step 3: the process reached ")
    assert f"the last checkpoint, {out / 'step_2'}, is intact (resume_from_checkpoint={out / 'step_2'}" in run.error
    assert [m["step"] for m in run.metrics] == [1, 2]
    assert {"model.safetensors", "recipe_state.pt", "config.json"} <= {p.name for p in (out / "step_2").iterdir()}


def test_out_of_memory_during_setup_says_so(tmp_path, monkeypatch):
    """Building the optimizer's states (setup's last large allocation) runs out: no step is named, none was
    trained, no checkpoint exists."""
    from finetune.optimizer import OptimizerSpec

    def no_memory(self, params):
        raise torch.OutOfMemoryError(CUDA_OOM)

    monkeypatch.setattr(OptimizerSpec, "build", no_memory)
    run = run_here(tmp_path / "out")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.error.startswith("error: out of memory during setup: the process reached ")
    assert run.error.endswith("no checkpoint was written") and run.metrics == []
