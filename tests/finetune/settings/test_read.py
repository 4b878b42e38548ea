"""Each section reader of finetune/settings/read.py as a unit: the tiny config's values read into its section, and
every refusal one ``BadInput`` of one line that names the value and the fix.

The recipes call ``read_settings`` first, before anything is built or written, and print its BadInput as
``error: ...`` with exit status 2: tests/recipes/test_bad_input.py shows that path end to end through `tune run` for
one refusal of the readers (a missing data file), and for the refusals that need the recipe (bad records, the
command line, a used output_dir); a refusal of a reader needs no recipe start of its own.
"""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from conftest import DATA_DIR, REPO_ROOT, TINY_CONFIG
from finetune.base import BadInput
from finetune.data import packing
from finetune.sections import (
    CheckpointSettings,
    DataSettings,
    MemorySettings,
    ModelSettings,
    Settings,
    TrainingSettings,
    ValidationSettings,
)
from finetune.settings import read

CPU = torch.device("cpu")
ALPACA = DATA_DIR / "alpaca" / "alpaca_data.json"
TOKENIZER = DATA_DIR / "llama2_tokenizer" / "tokenizer.model"


def tiny(*overrides: str):
    """The tiny config (on the CPU, with this machine's data) and ``overrides`` (``~a.b`` removes a key, as on the
    command line)."""
    cfg = OmegaConf.merge(OmegaConf.load(REPO_ROOT / TINY_CONFIG), OmegaConf.from_dotlist([f"data_dir={DATA_DIR}"]))
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([o for o in overrides if not o.startswith("~")]))
    for removed in (o[1:] for o in overrides if o.startswith("~")):
        parent, _, key = removed.rpartition(".")
        del (OmegaConf.select(cfg, parent) if parent else cfg)[key]
    return cfg


def refusal(reader, *overrides: str, **kwargs) -> str:
    """The one line ``reader(tiny(*overrides), **kwargs)`` refuses with."""
    with pytest.raises(BadInput) as e:
        reader(tiny(*overrides), **kwargs)
    message = str(e.value)
    assert "\n" not in message, message
    return message


def refuses(reader, overrides, words, **kwargs):
    message = refusal(reader, *overrides, **kwargs)
    for w in [words] if isinstance(words, str) else words:
        assert w in message, message


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def gpu_of(monkeypatch):
    """A CUDA device that the memory and FP8 checks see as a card of ``gib`` GiB: torch.device("cuda") is only a
    name until something allocates on it, so the checks run without a GPU."""

    def make(gib: float) -> torch.device:
        props = SimpleNamespace(total_memory=int(gib * 2**30))
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
        return torch.device("cuda")

    return make


# ------------------------------------------------------------------------------------------------
# read_device: the run-wide device and dtype
# ------------------------------------------------------------------------------------------------


def test_read_device_reads_the_device_and_the_dtype():
    assert read.read_device(tiny()) == (CPU, "fp32")
    assert read.read_device(tiny("dtype=bf16")) == (CPU, "bf16")


@pytest.mark.parametrize(
    "override, words",
    [
        ("dtype=fp16", "dtype='fp16' is not supported; use dtype=bf16 or dtype=fp32"),
        ("device=tpu", "device=tpu is not supported by these recipes; use device=cuda (a GPU) or device=cpu"),
        ("device=cuda", "device=cuda but no CUDA GPU is visible here; use device=cpu"),
        ("device=cuda:1", "device=cuda:1 but no CUDA GPU is visible here"),
    ],
)
def test_read_device_refuses(no_gpu, override, words):
    refuses(read.read_device, [override], words)


# ------------------------------------------------------------------------------------------------
# read_training: steps, data order, optimizer, schedule
# ------------------------------------------------------------------------------------------------


def test_read_training_reads_the_tiny_config():
    t = read.read_training(tiny(), CPU)
    assert isinstance(t, TrainingSettings)
    assert (t.epochs, t.max_steps_per_epoch, t.accum, t.clip, t.max_skips) == (1, 25, 1, 1.0, 10)
    assert (t.seed, t.shuffle, t.optimizer_in_bwd) == (42, True, False)
    assert t.optimizer.path == "torch.optim.AdamW" and t.optimizer.lr == 1e-3
    assert t.lr_scheduler.num_warmup_steps == 3
    # null turns a limit or the schedule off; in backward without accumulation or clipping
    t = read.read_training(
        tiny("max_steps_per_epoch=null", "lr_scheduler=null", "optimizer_in_bwd=True", "clip_grad_norm=null"), CPU
    )
    assert (t.max_steps_per_epoch, t.lr_scheduler, t.optimizer_in_bwd, t.clip) == (None, None, True, None)
    with pytest.raises(Exception):  # frozen: a section is built by its reader, not edited
        t.epochs = 2


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["epochs=0"], "epochs=0 must be a positive integer; set e.g. epochs=1"),
        (["max_steps_per_epoch=0"], "max_steps_per_epoch=0 must be a positive integer or null"),
        (
            ["gradient_accumulation_steps=2.0"],
            "must be an integer, not a float: write it as gradient_accumulation_steps=2",
        ),
        (["clip_grad_norm=.inf"], "clip_grad_norm=inf must be a positive number"),
        (["max_consecutive_skipped_steps=0"], "max_consecutive_skipped_steps=0 must be a positive integer"),
        (["optimizer.lr=0"], "optimizer.lr=0 must be a positive number"),
        (["optimizer.lr=-1e-4"], "optimizer.lr=-0.0001 must be a positive number"),
        (["optimizer.lr=.nan"], "optimizer.lr=nan must be a positive number"),  # (YAML spells NaN and inf with a dot)
        (["optimizer.lr=.inf"], "optimizer.lr=inf must be a positive number"),
        (["optimizer.lr=1e30"], "optimizer.lr=1e+30 must be at most 1"),
        (["optimizer.weight_decay=-0.1"], "optimizer.weight_decay=-0.1 must be a finite number >= 0"),
        (["optimizer.eps=0"], "optimizer.eps=0 must be a positive number"),
        (["lr_scheduler.num_warmup_steps=-1"], "lr_scheduler.num_warmup_steps=-1 must be a finite number >= 0"),
        (["seed=-1"], "seed=-1 must be a non-negative integer"),
        (["seed=1.5"], "seed=1.5 must be a non-negative integer"),
        (
            ["optimizer_in_bwd=True", "clip_grad_norm=null", "gradient_accumulation_steps=2"],
            ["optimizer_in_bwd=True cannot accumulate gradients", "gradient_accumulation_steps=1"],
        ),
        (["optimizer_in_bwd=True"], ["optimizer_in_bwd=True cannot clip gradients", "clip_grad_norm=null"]),
        (
            ["optimizer._component_=torch.optim.NoSuchAdam"],
            ["optimizer=torch.optim.NoSuchAdam cannot be imported", "torch.optim.AdamW"],
        ),
        # A misspelled class: the close name it most likely meant, in our registry, torch.optim or the module named
        (
            ["optimizer._component_=optimizers.AdamW8bti"],
            "optimizer=optimizers.AdamW8bti cannot be imported; did you mean optimizer=optimizers.AdamW8bit?",
        ),
        (
            ["optimizer._component_=torch.optim.AdamWW"],
            "optimizer=torch.optim.AdamWW cannot be imported; did you mean optimizer=torch.optim.AdamW?",
        ),
        (["optimizer._component_=nosuchpackage.AdamW"], "optimizer=nosuchpackage.AdamW cannot be imported"),
        # torch's AdamW takes maximize=, bitsandbytes' does not: not a backend flag, so it is an error.
        (
            ["optimizer._component_=bitsandbytes.optim.AdamW8bit", "optimizer.maximize=True"],
            ["optimizer.maximize=True is not accepted by bitsandbytes.optim.AdamW8bit", "~optimizer.maximize"],
        ),
        (
            [
                "optimizer._component_=torchao.optim.CPUOffloadOptimizer",
                "clip_grad_norm=null",
                "optimizer.optimizer_class=torch.optim.NoSuchAdam",
            ],
            ["optimizer.optimizer_class=torch.optim.NoSuchAdam cannot be imported", "torch.optim.AdamW"],
        ),
        (
            ["optimizer._component_=torchao.optim.CPUOffloadOptimizer"],
            ["CPUOffloadOptimizer copies gradients to the CPU during backward", "clip_grad_norm=null"],
        ),
        (
            ["optimizer._component_=torchao.optim.CPUOffloadOptimizer", "clip_grad_norm=null"],
            ["CPUOffloadOptimizer moves the optimizer state", "needs device=cuda (device=cpu)"],
        ),
    ],
)
def test_read_training_refuses(overrides, words):
    refuses(read.read_training, overrides, words, device=CPU)


# ------------------------------------------------------------------------------------------------
# read_memory: AC, offloading, streaming, the cap, compile, FP8, resharding
# ------------------------------------------------------------------------------------------------


def test_read_memory_reads_the_tiny_config_and_each_ac_mode():
    m = read.read_memory(tiny(), CPU, optimizer_in_bwd=False)
    assert m == MemorySettings(
        ac_every=None,
        offload_activations=False,
        stream_states=False,
        stream_layers=0,
        resident_state_bytes=0,
        memory_limit_gib=None,
        compile=False,
        fp8=None,
        reshard_after_forward=True,
    )
    on = ["enable_activation_checkpointing=True"]
    assert read.read_memory(tiny(*on), CPU, optimizer_in_bwd=False).ac_every == 1
    selective = [*on, "ac_mode=selective", "ac_option=3"]
    assert read.read_memory(tiny(*selective), CPU, optimizer_in_bwd=False).ac_every == 3
    streamed = [*on, "stream_optimizer_states=True", "stream_layers=2", "compile=True", "fp8=rowwise"]
    m = read.read_memory(tiny(*streamed), CPU, optimizer_in_bwd=True)
    assert (m.stream_states, m.stream_layers, m.compile, m.fp8) == (True, 2, True, "rowwise")
    m = read.read_memory(tiny(*streamed, "resident_states_gib=1.5"), CPU, optimizer_in_bwd=True)
    assert m.resident_state_bytes == 1.5 * 2**30


def test_read_memory_caps_a_gpu_below_its_size(gpu_of):
    m = read.read_memory(tiny("device_memory_limit_gib=24"), gpu_of(80), optimizer_in_bwd=False)
    assert m.memory_limit_gib == 24.0


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["stream_optimizer_states=True"], ["stream_optimizer_states=True brings", "needs optimizer_in_bwd=True"]),
        (["stream_optimizer_states=maybe"], "stream_optimizer_states='maybe' must be True or False"),
        (["enable_activation_checkpointing=True", "ac_mode=most"], "ac_mode='most' is not an activation checkpointing"),
        (["ac_mode=selective", "ac_option=0"], "ac_mode=selective needs ac_option=N, a positive integer"),
        (["stream_layers=-1"], "stream_layers=-1 must be a non-negative integer"),
        (["resident_states_gib=-1"], "resident_states_gib=-1 must be a finite number >= 0"),
        (["resident_states_gib=2"], ["resident_states_gib=2 keeps", "without stream_optimizer_states=True"]),
        (["stream_layers=2"], ["stream_layers=2 brings those layers' weights", "stream_optimizer_states=True"]),
        (
            ["enable_activation_offloading=True"],
            ["enable_activation_offloading=True moves activations", "needs a GPU (device=cpu)"],
        ),
        (["device_memory_limit_gib=0"], "device_memory_limit_gib=0 must be a positive number or null"),
        (["device_memory_limit_gib=8"], "device_memory_limit_gib=8.0 caps GPU memory and needs device=cuda"),
        (["fp8=int4"], "fp8='int4' is not an FP8 recipe"),
    ],
)
def test_read_memory_refuses(overrides, words):
    refuses(read.read_memory, overrides, words, device=CPU, optimizer_in_bwd=False)


def test_read_memory_refuses_resident_states_that_fill_the_cap(gpu_of):
    refuses(
        read.read_memory,
        ["stream_optimizer_states=True", "device_memory_limit_gib=16", "resident_states_gib=16"],
        ["resident_states_gib=16 is not less than device_memory_limit_gib=16.0", "set a smaller resident_states_gib"],
        device=gpu_of(80),
        optimizer_in_bwd=True,
    )


def test_read_memory_refuses_a_cap_above_the_card(gpu_of):
    refuses(
        read.read_memory,
        ["device_memory_limit_gib=100"],
        "device_memory_limit_gib=100.0 is more than this GPU's 80.0 GiB",
        device=gpu_of(80),
        optimizer_in_bwd=False,
    )


# ------------------------------------------------------------------------------------------------
# read_data and read_validation: the datasets, built the same way
# ------------------------------------------------------------------------------------------------


def test_read_data_reads_the_training_set_and_what_datasets_share(tmp_path):
    cfg = tiny()
    d = read.read_data(cfg, CPU)
    assert d.section is cfg.dataset and d.packed is False and d.files == (str(ALPACA),)
    assert (d.batch_size, d.tokenizer_path, d.packed_attention) == (4, TOKENIZER, "flex")
    assert d.tokenizer_cfg == {**OmegaConf.to_container(cfg.tokenizer, resolve=True), "path": str(TOKENIZER)}
    assert d.pack_cache_dir == packing.default_cache_dir()
    assert read.read_data(tiny("pack_cache_dir=off"), CPU).pack_cache_dir is None
    assert read.read_data(tiny(f"pack_cache_dir={tmp_path}"), CPU).pack_cache_dir == tmp_path
    assert read.read_data(tiny("dataset.packed=True"), CPU).packed is True
    # A hub dataset reads no local file
    assert read.read_data(tiny("dataset.source=tatsu-lab/alpaca", "~dataset.data_files"), CPU).files == ()


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["batch_size=0"], "batch_size=0 must be a positive integer"),
        (["batch_size=-2"], "batch_size=-2 must be a positive integer"),
        (["dataset.packed=maybe"], "dataset.packed='maybe' must be True or False"),
        (["tokenizer.max_seq_len=0"], "tokenizer.max_seq_len=0 must be a positive integer or null"),
        (["tokenizer.max_seq_len=-1"], "tokenizer.max_seq_len=-1 must be a positive integer or null"),
        (["packed_attention=sdpa"], "packed_attention='sdpa' is not an attention of packed rows"),
        (["packed_attention=varlen"], "packed_attention=varlen computes the attention of packed rows and needs"),
        (
            ["data_dir={t}/nowhere"],
            ["tokenizer.path={t}/nowhere/llama2_tokenizer/tokenizer.model does not exist", "set data_dir=DIR"],
        ),
        (["tokenizer.path={t}/tokenizer.model"], ["does not exist; set tokenizer.path=FILE"]),
        (
            ["tokenizer.path={t}/garbage.model"],
            ["tokenizer.path={t}/garbage.model is not a SentencePiece model", "could not parse ModelProto"],
        ),
        (
            ["dataset.data_files={t}/nope.json"],
            ["dataset.data_files={t}/nope.json does not exist", "dataset.source=tatsu-lab/alpaca"],
        ),
        (["~dataset.data_files"], "dataset.source=json needs dataset.data_files=FILE"),
    ],
)
def test_read_data_refuses(tmp_path, overrides, words):
    (tmp_path / "garbage.model").write_bytes(b"<html>Not Found</html>\n" * 40)
    words = [w.format(t=tmp_path) for w in ([words] if isinstance(words, str) else words)]
    refuses(read.read_data, [o.format(t=tmp_path) for o in overrides], words, device=CPU)


def test_read_validation_builds_a_data_section_of_its_own(tmp_path):
    val = tmp_path / "val.json"
    val.write_text("[]")
    cfg = tiny(f"dataset_val.data_files={val}", "batch_size_val=2", "run_val_every_n_steps=5")
    data = read.read_data(cfg, CPU)
    v = read.read_validation(cfg, data)
    assert isinstance(v, ValidationSettings) and v.every == 5
    # dataset's keys under its own; its own files, batch and packing; the training set's tokenizer and cache
    assert v.data.section.train_on_input is True and v.data.section.data_files == str(val)
    assert (v.data.files, v.data.batch_size, v.data.packed) == ((str(val),), 2, False)
    assert (v.data.tokenizer_path, v.data.pack_cache_dir) == (data.tokenizer_path, data.pack_cache_dir)
    assert data.files == (str(ALPACA),)  # (the training set's is untouched)
    assert read.read_validation(tiny(f"dataset_val.data_files={val}"), data).data.batch_size == 4
    assert read.read_validation(tiny(), data) is None
    # A section that names its own component stands alone
    own = ["dataset_val._component_=torchtune.datasets.alpaca_dataset", "dataset_val.source=json"]
    alone = read.read_validation(tiny(*own, f"dataset_val.data_files={val}"), data)
    assert "train_on_input" not in alone.data.section


def test_read_validation_refuses_unpacked_rows_for_varlen(tmp_path):
    val = tmp_path / "val.json"
    val.write_text("[]")
    data = DataSettings(
        section=tiny().dataset,
        key="dataset",
        packed=True,
        files=(),
        batch_size=4,
        tokenizer_path=TOKENIZER,
        tokenizer_cfg={},
        pack_cache_dir=None,
        packed_attention="varlen",
    )
    with pytest.raises(BadInput, match="^packed_attention=varlen points the attention at packed rows only"):
        read.read_validation(tiny(f"dataset_val.data_files={val}"), data)
    assert read.read_validation(tiny(f"dataset_val.data_files={val}", "dataset_val.packed=True"), data).data.packed


# (the other refusals of dataset_val, run_val_every_n_steps and batch_size_val: tests/recipes/test_validation.py)


# ------------------------------------------------------------------------------------------------
# read_checkpoint
# ------------------------------------------------------------------------------------------------


def test_read_checkpoint_reads_the_tiny_config():
    assert read.read_checkpoint(tiny()) == CheckpointSettings(
        checkpoint_dir=None, resume_dir=None, overwrite=False, save_every=None, background=True, host_limit_gib=None
    )
    c = read.read_checkpoint(tiny("save_every_n_steps=2", "overwrite=True", "async_checkpoint=False"))
    assert (c.save_every, c.overwrite, c.background) == (2, True, False)
    assert read.read_checkpoint(tiny("host_memory_limit_gib=20.5")).host_limit_gib == 20.5


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["save_every_n_steps=0"], "save_every_n_steps=0 must be a positive integer or null"),
        (["overwrite=yes please"], "overwrite='yes please' must be True or False"),
        (["async_checkpoint=sometimes"], "async_checkpoint='sometimes' must be True or False"),
        (["host_memory_limit_gib=0"], "host_memory_limit_gib=0"),
        (["host_memory_limit_gib=lots"], "host_memory_limit_gib='lots'"),
        (["checkpoint_dir={t}/Llama-2-7b-hf"], ["is not a folder with HF weights", "checkpoint_dir=null"]),
        (
            ["resume_from_checkpoint={t}/step_9"],
            "resume_from_checkpoint={t}/step_9 lacks model.safetensors, recipe_state.pt",
        ),
    ],
)
def test_read_checkpoint_refuses(tmp_path, overrides, words):
    words = [w.format(t=tmp_path) for w in ([words] if isinstance(words, str) else words)]
    refuses(read.read_checkpoint, [o.format(t=tmp_path) for o in overrides], words)


# ------------------------------------------------------------------------------------------------
# read_model (the model of a folder: tests/recipes/test_any_folder.py, tests/finetune/model/)
# ------------------------------------------------------------------------------------------------


def test_read_model_reads_the_config_s_model():
    m = read.read_model(tiny(), None)
    assert isinstance(m, ModelSettings)
    assert (m.family, m.note, m.source_config) == ("llama2", None, None)
    assert m.section._component_ == "torchtune.models.llama2.llama2" and m.section.num_layers == 2


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["model.num_layers=0"], "model.num_layers=0 must be a positive integer"),
        (["model.embed_dim=0"], "model.embed_dim=0 must be a positive integer"),
        (["model.embed_dim=65"], "model.embed_dim=65 must be a multiple of model.num_heads=4; set e.g."),
        (["model.num_kv_heads=3"], "model.num_heads=4 must be a multiple of model.num_kv_heads=3"),
        (
            ["model.max_seq_len=1e12"],
            ["model.max_seq_len=1000000000000.0 must be at most 16777216", "set e.g. model.max_seq_len=512"],
        ),
        (
            ["model.max_seq_len=512.0"],
            "model.max_seq_len=512.0 must be an integer, not a float: write it as model.max_seq_len=512",
        ),
        (
            ["model._component_=null"],
            "model._component_ is not set, and without checkpoint_dir the model section is required",
        ),
        (["~model"], "model._component_ is not set, and without checkpoint_dir the model section is required"),
    ],
)
def test_read_model_refuses(overrides, words):
    refuses(read.read_model, overrides, words, checkpoint_dir=None)


# ------------------------------------------------------------------------------------------------
# read_settings: the sections composed, and the rules that join them
# ------------------------------------------------------------------------------------------------


def test_read_settings_composes_the_sections():
    s = read.read_settings(tiny())
    assert isinstance(s, Settings)
    assert (s.device, s.dtype, s.dtype_name, s.log_every) == (CPU, torch.float32, "fp32", 1)
    assert s.output_dir == Path(tiny().output_dir) and s.validation is None
    assert s.training == read.read_training(tiny(), CPU)
    assert s.memory == read.read_memory(tiny(), CPU, optimizer_in_bwd=False)
    assert s.data.files == (str(ALPACA),) and s.model.family == "llama2" and not s.checkpoint.overwrite


@pytest.mark.parametrize(
    "overrides, distributed, words",
    [
        (["save_every_n_step=2"], False, ["save_every_n_step is not a config key", "did you mean save_every_n_steps"]),
        (["fsdp_reshard_after_forward=False"], False, "fsdp_reshard_after_forward is not a config key"),
        (["model.num_layer=2"], False, "model.num_layer is not a key of torchtune.models.llama2.llama2"),
        (["log_every_n_steps=0"], False, "log_every_n_steps=0 must be a positive integer"),
        # a section every run builds from, removed (~tokenizer) or left without its component: required, by name
        (
            ["~tokenizer"],
            False,
            ["tokenizer is required: the run builds the tokenizer", "the config has tokenizer=None"],
        ),
        (["~loss"], False, "loss is required: the run builds the loss from it"),
        (["optimizer._component_=null"], False, ["optimizer is required", "optimizer._component_ is not set"]),
        (["~tokenizer.path"], False, "tokenizer.path is not set: the tokenizer's file is required"),
        (["~data_dir"], False, ["tokenizer.path refers to a key the config does not have", "'data_dir' not found"]),
        (
            ["optimizer_in_bwd=True", "clip_grad_norm=null"],
            True,
            "optimizer_in_bwd=True is not supported by the distributed recipe",
        ),
    ],
)
def test_read_settings_refuses(overrides, distributed, words):
    refuses(read.read_settings, overrides, words, distributed=distributed)


def test_the_distributed_recipe_refuses_what_stands_in_for_sharding():
    training = read.read_training(tiny(), CPU)
    memory = read.read_memory(tiny(), CPU, optimizer_in_bwd=False)
    read.refuse_one_device_features(training, memory)  # (nothing to refuse)
    offloaded = MemorySettings(**{**vars(memory), "offload_activations": True})
    with pytest.raises(BadInput, match="^enable_activation_offloading=True is for one GPU"):
        read.refuse_one_device_features(training, offloaded)
    cpu_offload = TrainingSettings(
        **{**vars(training), "optimizer": SimpleNamespace(cpu_offload=True), "optimizer_in_bwd": False}
    )
    with pytest.raises(BadInput, match="^optimizer=torchao.optim.CPUOffloadOptimizer is for one GPU"):
        read.refuse_one_device_features(cpu_offload, memory)


def test_overwrite_never_deletes_what_the_run_reads(tmp_path):
    """overwrite=True with an output_dir that holds a data file this run reads (the training set's, or the
    validation set's) in a result overwrite deletes: refused, naming the key."""
    out = tmp_path / "out"
    (out / "step_2").mkdir(parents=True)
    val = out / "step_2" / "val.json"
    val.write_text("[]")
    refuses(
        read.read_settings,
        [f"output_dir={out}", "overwrite=True", f"dataset_val.data_files={val}"],
        ["overwrite=True would delete", f"dataset_val.data_files={val}", "keep overwrite=False"],
    )
    assert val.is_file()
    assert read.read_settings(tiny(f"output_dir={out}", "overwrite=True")).checkpoint.overwrite  # (nothing read there)
