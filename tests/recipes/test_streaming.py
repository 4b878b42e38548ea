"""``stream_optimizer_states=True`` in the recipe, on the CPU (the stand-in link: the states leave their storages
between steps for host slots and come back for each step): the run trains the losses of the same run with resident
states, bit for bit; its checkpoint resumes exactly; what it moves is recorded per step; a config that cannot
stream is refused in one line."""

import pytest
import torch

from conftest import run_here

IN_BACKWARD = ["optimizer_in_bwd=True", "clip_grad_norm=null", "max_steps_per_epoch=4", "save_every_n_steps=2"]


@pytest.fixture
def runs(tmp_path):
    resident = run_here(tmp_path / "resident", *IN_BACKWARD)
    streamed = run_here(tmp_path / "streamed", *IN_BACKWARD, "stream_optimizer_states=True")
    assert resident.ok, resident.stderr[-3000:]
    assert streamed.ok, streamed.stderr[-3000:]
    return resident, streamed


def test_streamed_states_train_the_resident_losses_and_resume_exactly(runs, tmp_path):
    resident, streamed = runs
    assert len(streamed.losses) == 4 and streamed.losses == resident.losses
    assert all(m["host_copy_gb"] > 0 for m in streamed.metrics)  # (the first step writes out only)
    # The checkpoint holds the same optimizer state a resident run writes, tensor for tensor.
    load = lambda run: torch.load(run.output_dir / "step_2" / "recipe_state.pt", weights_only=True)["optimizer"]  # noqa: E731
    a, b = load(resident), load(streamed)
    assert a.keys() == b.keys()
    for name in a:
        for pid, entry in a[name]["state"].items():
            for key, value in entry.items():
                assert torch.equal(value, b[name]["state"][pid][key]), (name, key)
    resumed = run_here(
        tmp_path / "resumed",
        *IN_BACKWARD,
        "stream_optimizer_states=True",
        f"resume_from_checkpoint={streamed.output_dir / 'step_2'}",
    )
    assert resumed.ok, resumed.stderr[-3000:]
    assert resumed.losses == streamed.losses[2:]
    # Resumed with part of the states kept on the device (resident_states_gib): the same steps, less moved.
    kept = run_here(
        tmp_path / "kept",
        *IN_BACKWARD,
        "stream_optimizer_states=True",
        "resident_states_gib=0.0005",
        f"resume_from_checkpoint={streamed.output_dir / 'step_2'}",
    )
    assert kept.ok, kept.stderr[-3000:]
    assert kept.losses == streamed.losses[2:]
    assert all(0 < m["resident_state_gib"] <= 0.0005 for m in kept.metrics)
    assert all(0 < k["host_copy_gb"] < r["host_copy_gb"] for k, r in zip(kept.metrics, resumed.metrics))


def test_streaming_without_optimizer_in_backward_is_one_error_line(tmp_path):
    run = run_here(tmp_path / "bad", "stream_optimizer_states=True")
    assert run.returncode == 2
    errors = [line for line in (run.stderr + run.stdout).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "stream_optimizer_states=True" in errors[0] and "optimizer_in_bwd=True" in errors[0]
    assert "Traceback" not in run.stderr


LAYERS = [*IN_BACKWARD, "stream_optimizer_states=True", "enable_activation_checkpointing=True", "model.num_layers=4"]


def test_streamed_weights_train_the_resident_losses_save_the_same_model_and_resume_exactly(tmp_path):
    from safetensors.torch import load_file

    resident = run_here(tmp_path / "resident", *LAYERS)
    streamed = run_here(tmp_path / "streamed", *LAYERS, "stream_layers=2")
    assert resident.ok, resident.stderr[-3000:]
    assert streamed.ok, streamed.stderr[-3000:]
    assert len(streamed.losses) == 4 and streamed.losses == resident.losses
    assert all(m["weights_copy_gb"] > 0 and m["host_copy_gb"] > m["weights_copy_gb"] for m in streamed.metrics[1:])
    a, b = (load_file(run.output_dir / "step_2" / "model.safetensors") for run in (resident, streamed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # A resume builds the model on the meta device and takes the checkpoint's tensors as its weights.
    resumed = run_here(
        tmp_path / "resumed", *LAYERS, "stream_layers=2", f"resume_from_checkpoint={streamed.output_dir / 'step_2'}"
    )
    assert resumed.ok, resumed.stderr[-3000:]
    assert resumed.losses == streamed.losses[2:]


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["stream_layers=2", *IN_BACKWARD, "enable_activation_checkpointing=True"], "stream_optimizer_states=True"),
        (["stream_layers=2", *IN_BACKWARD, "stream_optimizer_states=True"], "enable_activation_checkpointing=True"),
        ([*LAYERS, "stream_layers=5"], "stream_layers<=4"),
    ],
    ids=["without-streamed-states", "without-checkpointing", "more-than-the-layers"],
)
def test_stream_layers_that_cannot_work_is_one_error_line(overrides, named, tmp_path):
    run = run_here(tmp_path / "bad", *overrides)
    assert run.returncode == 2
    errors = [line for line in (run.stderr + run.stdout).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and named in errors[0], errors
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize(
    "family, config, fields",
    # (wide enough that some of the layers' weights reach the 64 KiB below which a weight stays resident; Qwen2.5's
    # folder loads as Llama 2's does, and tests/finetune/streaming/test_weights.py builds its model on the meta device)
    [
        ("llama3_1", "llama3_1/8B_full_16gb_fp8", dict(hidden_size=128, intermediate_size=512)),
        ("qwen3", "qwen3/8B_full_16gb_fp8", dict(hidden_size=128, intermediate_size=512)),  # (q/k norms)
        ("mistral", "mistral/7B_full_16gb_fp8", dict(hidden_size=128, intermediate_size=512)),
    ],
    ids=["llama3_1", "qwen3", "mistral"],
)
def test_a_16gb_config_streams_an_hf_folder_of_its_family_as_the_resident_run_trains_it(
    family, config, fields, tmp_path
):
    """The 16 GB config of a family whose weights stream, on its toy HF folder (the CPU stand-ins for what needs a GPU):
    the model is built on the meta device and takes the folder's tensors (Llama 3's q/k permutation, its scaled RoPE
    built on the device), and trains the losses of the same run with every weight resident."""
    from conftest import DATA_DIR
    from finetune import toy_folder

    folder = tmp_path / "folder"
    toy_folder.make_toy_folder(folder, family=family, fields=fields, data_dir=DATA_DIR)
    cpu = [*toy_folder.CPU_OVERRIDES, "fp8=null", "enable_activation_offloading=False", "device_memory_limit_gib=null"]
    # Both runs in this process: their losses are compared with each other, not with recorded ones, so the pinned
    # vector code of a subprocess is not needed.
    resident, streamed = [
        run_here(
            tmp_path / f"streamed_{n}",
            f"checkpoint_dir={folder}",
            *cpu,
            "max_steps_per_epoch=3",
            f"stream_layers={n}",
            config=f"configs/{config}.yaml",
            fast=False,
        )
        for n in (0, 1)
    ]
    assert resident.ok and streamed.ok, (resident.stderr + streamed.stderr)[-3000:]
    assert len(streamed.metrics) == 3 and streamed.losses == resident.losses
    assert all(m["weights_copy_gb"] > 0 for m in streamed.metrics)


@pytest.mark.parametrize(
    "family, config, fields",
    [
        ("llama3_2", "llama3_2/3B_full_12gb", {}),
        ("qwen2_5", "qwen2_5/3B_full_12gb", dict(tie_word_embeddings=True)),  # (tied, as Qwen2.5 3B is)
    ],
    ids=["llama3_2", "qwen2_5"],
)
def test_a_3b_12gb_config_trains_its_family_folder_with_the_states_in_host_memory(family, config, fields, tmp_path):
    """The 3B models' 12 GB config, on a toy folder of the family (activation offloading, a GPU's, off): it trains,
    and every step after the first brings its states up from host memory and writes them back."""
    from conftest import DATA_DIR
    from finetune import toy_folder

    folder = tmp_path / "folder"
    toy_folder.make_toy_folder(folder, family=family, fields=fields, data_dir=DATA_DIR)
    cpu = [*toy_folder.CPU_OVERRIDES, "enable_activation_offloading=False", "device_memory_limit_gib=null"]
    run = run_here(
        tmp_path / "run",
        f"checkpoint_dir={folder}",
        *cpu,
        "max_steps_per_epoch=3",
        config=f"configs/{config}.yaml",
        fast=False,
    )
    assert run.ok, run.stderr[-3000:]
    assert len(run.losses) == 3 and all(m["host_copy_gb"] > 0 for m in run.metrics)


def test_the_moe_config_streams_4bit_states_of_stacked_experts_and_resumes_exactly(tmp_path):
    """Qwen3-MoE's 80 GB config on its toy folder as it runs on the GPU but for the device: bf16 weights (the 4-bit
    AdamW rounds them stochastically), the update in backward, every state in host memory, every layer recomputed,
    plus one layer's weights streamed (its stacked experts are its big tensors). It trains the losses of the same run
    with everything resident, bit for bit, records the load-balancing loss beside the loss, and resumes exactly."""
    from conftest import DATA_DIR
    from finetune import toy_folder

    folder = tmp_path / "folder"
    toy_folder.make_toy_folder(folder, family="qwen3_moe", data_dir=DATA_DIR)
    cpu = [o for o in toy_folder.CPU_OVERRIDES if not o.startswith(("optimizer.", "dtype=", "dataset.split"))]
    common = [
        f"checkpoint_dir={folder}",
        *cpu,
        "dtype=bf16",
        "dataset.split=train[:60]",  # (3 steps of 2 rows of 128 tokens)
        "max_steps_per_epoch=3",
        "save_every_n_steps=2",
        f"pack_cache_dir={tmp_path / 'cache'}",
    ]

    def run(name, *extra):
        done = run_here(tmp_path / name, *common, *extra, config="configs/qwen3_moe/30B_A3B_full_80gb.yaml", fast=False)
        assert done.ok, done.stderr[-3000:]
        return done

    resident = run("resident", "stream_optimizer_states=False")
    streamed = run("streamed", "stream_layers=1")
    assert "Optimizer: optimizers.AdamW4bit (in backward, one per parameter), states in host memory" in streamed.stderr
    assert len(streamed.losses) == 3 and streamed.losses == resident.losses
    assert all(m["weights_copy_gb"] > 0 for m in streamed.metrics)
    assert [m["aux_loss"] for m in streamed.metrics] == [m["aux_loss"] for m in resident.metrics]
    assert all(1.5 < m["aux_loss"] < 3 for m in streamed.metrics)  # (2 experts a token: 2 for an even routing)
    resumed = run("resumed", "stream_layers=1", f"resume_from_checkpoint={streamed.output_dir / 'step_2'}")
    assert resumed.losses == streamed.losses[2:]


# The GPU half of a 16 GB config (bf16 weights, states and some layers' weights in pinned host memory, CudaLink's two
# copy streams, a background save's GPU and host staging), on a toy folder wide enough that its layers' bf16 weights
# stream (64 KiB and more), without compile and FP8 (their own tests cover them; here they would only add minutes).
# The loss is torch's: cut-cross-entropy (the configs' choice on a GPU) adds its vocabulary blocks' log-sum-exps
# under a lock in the order the blocks arrive, and at this size (two blocks of tokens, hundreds of vocabulary blocks
# on each lock) that order changes from run to run: the same forward gave 6.9018960 and 6.9018965 on an H100.
GPU_16GB = [
    "compile=False",
    "fp8=null",
    "loss.impl=torch",
    "metric_logger=null",
    "dataset.split=train[:500]",
    "tokenizer.max_seq_len=128",
    "batch_size=2",
    "max_steps_per_epoch=4",
    "save_every_n_steps=2",
    "lr_scheduler.num_warmup_steps=0",
    "optimizer.lr=1e-3",
]


@pytest.mark.gpu
@pytest.mark.parametrize("background", [True, False], ids=["background", "synchronous"])
def test_on_cuda_a_16gb_config_saves_resumes_and_its_folder_loads_in_transformers(background, tmp_path):
    """A streamed model on CUDA writes step_2/ and epoch_0/ (the weights half on the GPU, half in host memory), the
    same files as the run with every weight resident; a resume from step_2/ trains the uninterrupted run's losses
    and writes its epoch_0/ again, byte for byte; transformers loads the folder with the recipe's weights, bit for bit.
    (At 428f355 every save of a streamed model died in check_finite_weights: host and GPU tensors in one torch.cat.)"""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from conftest import DATA_DIR
    from finetune import toy_folder

    folder = tmp_path / "folder"
    toy_folder.make_toy_folder(
        folder, family="llama3_1", fields=dict(hidden_size=256, intermediate_size=1024), data_dir=DATA_DIR
    )
    config = "configs/llama3_1/8B_full_16gb_fp8.yaml"
    common = [f"checkpoint_dir={folder}", *GPU_16GB, f"async_checkpoint={background}"]
    resident, streamed = [
        run_here(tmp_path / f"layers_{n}", *common, f"stream_layers={n}", config=config, fast=False) for n in (0, 1)
    ]
    assert resident.ok and streamed.ok, (resident.stderr + streamed.stderr)[-3000:]
    assert all(m["weights_copy_gb"] > 0 for m in streamed.metrics)
    assert streamed.losses == resident.losses and len(streamed.losses) == 4
    for name in ("step_2", "epoch_0"):
        for f in ("model.safetensors", "config.json"):
            assert (streamed.output_dir / name / f).read_bytes() == (resident.output_dir / name / f).read_bytes()
    resumed = run_here(
        tmp_path / "resumed",
        *common,
        "stream_layers=1",
        f"resume_from_checkpoint={streamed.output_dir / 'step_2'}",
        config=config,
        fast=False,
    )
    assert resumed.ok, resumed.stderr[-3000:]
    assert resumed.losses == streamed.losses[2:]
    final = streamed.output_dir / "epoch_0" / "model.safetensors"
    assert (resumed.output_dir / "epoch_0" / "model.safetensors").read_bytes() == final.read_bytes()
    saved = load_file(final)
    model = AutoModelForCausalLM.from_pretrained(streamed.output_dir / "epoch_0", dtype=torch.bfloat16)
    loaded = model.state_dict()
    assert saved.keys() <= loaded.keys()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)


@pytest.mark.gpu
def test_on_cuda_the_moe_config_trains_saves_resumes_and_its_folder_loads_in_transformers(tmp_path):
    """Qwen3-MoE's 80 GB config on CUDA, at toy size (bf16, the experts' grouped GEMM on compute capability 9.0+):
    it trains with its load-balancing loss recorded, streams a layer's stacked experts as the resident run trains,
    resumes from step_2/ with the uninterrupted losses, and transformers loads epoch_0/ with the recipe's weights bit
    for bit (written per expert)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from conftest import DATA_DIR
    from finetune import toy_folder

    folder = tmp_path / "folder"
    toy_folder.make_toy_folder(folder, family="qwen3_moe", data_dir=DATA_DIR)
    config = "configs/qwen3_moe/30B_A3B_full_80gb.yaml"
    common = [f"checkpoint_dir={folder}", *(o for o in GPU_16GB if o != "fp8=null")]
    resident, streamed = [
        run_here(tmp_path / f"layers_{n}", *common, f"stream_layers={n}", config=config, fast=False) for n in (0, 1)
    ]
    assert resident.ok and streamed.ok, (resident.stderr + streamed.stderr)[-3000:]
    assert streamed.losses == resident.losses and len(streamed.losses) == 4
    assert all(1.5 < m["aux_loss"] < 3 for m in streamed.metrics)  # (2 experts a token: 2 for an even routing)
    resumed = run_here(
        tmp_path / "resumed", *common, "stream_layers=1", f"resume_from_checkpoint={streamed.output_dir / 'step_2'}",
        config=config, fast=False,
    )  # fmt: skip
    assert resumed.ok, resumed.stderr[-3000:]
    assert resumed.losses == streamed.losses[2:]
    saved = load_file(streamed.output_dir / "epoch_0" / "model.safetensors")
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in saved
    model = AutoModelForCausalLM.from_pretrained(streamed.output_dir / "epoch_0", dtype=torch.bfloat16)
    gate_up = model.model.layers[0].mlp.experts.gate_up_proj  # (transformers 5 stacks them in memory)
    up = saved["model.layers.0.mlp.experts.3.up_proj.weight"]
    assert torch.equal(gate_up[3, up.shape[0] :], up)
    assert torch.equal(model.model.embed_tokens.weight, saved["model.embed_tokens.weight"])


def test_a_machine_without_the_host_memory_is_refused_before_the_weights_load(tmp_path, monkeypatch):
    """The states and streamed weights a run will pin are counted on the model built on the meta device, before the
    checkpoint's weights are read: one line with what they take, what the machine has, and the fix."""
    from conftest import DATA_DIR
    from finetune import toy_folder
    from finetune.checkpoint import hf_format
    from finetune.streaming import room

    folder = tmp_path / "folder"
    toy_folder.make_toy_folder(
        folder, family="llama3_1", fields=dict(hidden_size=128, intermediate_size=512), data_dir=DATA_DIR
    )
    loaded = []
    monkeypatch.setattr(hf_format, "load_weights", lambda *a, **k: loaded.append(a))
    monkeypatch.setattr(room, "available_host_bytes", lambda: 300 * 2**10)  # (the toy pins ~0.4 MiB)
    cpu = [*toy_folder.CPU_OVERRIDES, "fp8=null", "enable_activation_offloading=False", "device_memory_limit_gib=null"]
    run = run_here(
        tmp_path / "out",
        f"checkpoint_dir={folder}",
        *cpu,
        "stream_layers=2",
        config="configs/llama3_1/8B_full_16gb_fp8.yaml",
        fast=False,
    )
    assert run.returncode == 2 and not loaded
    assert "this config keeps" in run.error and "optimizer states" in run.error and "2 layers' weights" in run.error
    assert "larger GPU class" in run.error
