"""finetune/toy_folder.py: a toy Hugging Face folder per family, made from the model's config.json at toy sizes.

Per family: the folder transformers loads, with toy sizes that keep the model's query to key/value head ratio and
every other field of its config.json (RoPE base and scaling, norm eps, tying), a tokenizer whose ids config.json
names, and a model the family's shipped 80 GB config builds (its builder accepts the folder). The command line:
what it prints is the docs' command for the folder; a field the family cannot compute is one ``error:`` line with
nothing written. That the printed command trains every family's folder: tests/recipes/test_any_folder.py.
"""

import json
import shlex
import weakref

import pytest
import torch
import transformers
from omegaconf import OmegaConf
from safetensors.torch import load_file

from conftest import DATA_DIR, REPO_ROOT
from finetune import toy_folder
from finetune.base import BadInput
from finetune.checkpoint import hf_format
from finetune.data import HFTokenizer
from finetune.model import from_hf_config

ARCHITECTURE = ("rms_norm_eps", "tie_word_embeddings", "max_position_embeddings", "model_type")


@pytest.mark.parametrize("key", list(toy_folder.MODELS))
def test_a_toy_folder_of_each_family(key, tmp_path):
    made = toy_folder.make_toy_folder(tmp_path / key, family=key, data_dir=DATA_DIR)
    model = toy_folder.MODELS[key]
    real = {"model_type": model["model_type"], **model["hf"]}
    hf = json.loads((tmp_path / key / "config.json").read_text())
    assert hf == made["config_json"]
    # toy sizes, the model's head ratio, every other field the model's (as transformers reads both)
    toy, source = from_hf_config.read_config(hf), from_hf_config.read_config(real)
    assert toy.num_hidden_layers == 2 and 64 <= toy.hidden_size <= 128 and toy.num_attention_heads >= 4
    assert toy.hidden_size == toy.num_attention_heads * 16
    # (a head_dim of its own where the model's is not its width's share: Qwen3-30B-A3B's 128 on 2048 / 32)
    own = getattr(source, "head_dim", None) not in (None, source.hidden_size // source.num_attention_heads)
    assert getattr(toy, "head_dim", 16) == (32 if own else 16)
    ratio = source.num_attention_heads // source.num_key_value_heads
    assert toy.num_attention_heads // toy.num_key_value_heads == ratio
    assert toy.intermediate_size / toy.hidden_size == pytest.approx(
        source.intermediate_size / source.hidden_size, rel=0.1
    )
    assert {k: getattr(toy, k) for k in ARCHITECTURE} == {k: getattr(source, k) for k in ARCHITECTURE}
    if key == "qwen3_moe":  # 8 experts, 2 a token, their width's ratio to the model's kept, the rest the model's
        assert (toy.num_experts, toy.num_experts_per_tok) == (8, 2)
        assert toy.moe_intermediate_size / toy.hidden_size == source.moe_intermediate_size / source.hidden_size
        moe_fields = ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef")
        assert {k: getattr(toy, k) for k in moe_fields} == {k: getattr(source, k) for k in moe_fields}
    assert from_hf_config.rope_of(toy) == from_hf_config.rope_of(source)
    # the family's shipped config builds it from the folder: its builder takes the folder
    config = OmegaConf.load(REPO_ROOT / made["config"])
    family, built = hf_format.resolve_model(hf, OmegaConf.to_container(config.model))
    assert made["config"] == f"configs/{model['config']}.yaml" and family.name == made["family"]
    assert built["num_layers"] == 2 and built["rope_base"] == from_hf_config.rope_of(source)["rope_theta"]
    # transformers loads it; the tokenizer's ids are config.json's
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / key, dtype=torch.float32)
    assert type(loaded).__name__ == hf["architectures"][0]
    if key == "llama2":
        assert (tmp_path / key / "tokenizer.model").read_bytes() == (
            DATA_DIR / "llama2_tokenizer" / "tokenizer.model"
        ).read_bytes()
        assert (hf["vocab_size"], hf["bos_token_id"], hf["eos_token_id"]) == (32000, 1, 2)
        return
    tok = HFTokenizer(str(tmp_path / key / "tokenizer.json"), chat_template=True)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (hf["vocab_size"], hf["bos_token_id"], hf["eos_token_id"])
    assert (tmp_path / key / "chat_template.jinja").is_file()
    from torchtune.data import Message

    tokens, mask = tok.tokenize_messages(
        [Message("user", "Name a colour.", masked=True), Message("assistant", "Blue.")]
    )
    trained = tok.decode([t for t, m in zip(tokens, mask) if not m], skip_special_tokens=False)
    assert trained.strip().startswith("Blue.") and len(tokens) > len(tok.encode("Blue.", add_bos=False, add_eos=False))


def test_fields_and_a_config_json_of_your_own(tmp_path):
    """``--set`` fields win over the toy's; ``--config`` shrinks a config.json (transformers 4's spelling) and copies
    the tokenizer files beside it, keeping its vocabulary size."""
    made = toy_folder.make_toy_folder(
        tmp_path / "a", family="mistral", fields={"rope_theta": 30000.0, "num_hidden_layers": 3}, data_dir=DATA_DIR
    )
    hf = made["config_json"]
    assert from_hf_config.rope_of(from_hf_config.read_config(hf))["rope_theta"] == 30000.0
    assert hf["num_hidden_layers"] == 3

    own = tmp_path / "own"
    own.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (own / name).write_bytes((tmp_path / "a" / name).read_bytes())
    qwen = {**toy_folder.MODELS["qwen2_5"]["hf"], "vocab_size": 2048, "rms_norm_eps": 3e-6, "rope_theta": 20000.0}
    (own / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **qwen}))
    made = toy_folder.make_toy_folder(tmp_path / "b", config=str(own), data_dir=tmp_path / "no-data")
    hf = made["config_json"]
    assert (hf["vocab_size"], hf["rms_norm_eps"], hf["num_attention_heads"], hf["num_key_value_heads"]) == (
        2048,
        3e-6,
        7,
        1,
    )
    assert from_hf_config.rope_of(from_hf_config.read_config(hf))["rope_theta"] == 20000.0
    assert made["config"] == "configs/qwen2_5/7B_full_80gb.yaml" and "the model's own" in made["tokenizer"]
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "b" / name).read_bytes() == (own / name).read_bytes()


@pytest.mark.parametrize(
    "args, named",
    [
        (["--family", "qwen2_5", "--set", "use_sliding_window=true"], "use_sliding_window=True"),
        (["--family", "llama3_1", "--set", 'rope_scaling={"rope_type": "linear", "factor": 2.0}'], "rope_scaling="),
        (["--family", "qwen3", "--set", "rope_theta"], "--set 'rope_theta' is not key=value"),
        (["--config", "/nonexistent/config.json"], "--config /nonexistent/config.json: cannot read"),
        (["--family", "qwen3_moe", "--sizes", "full"], "--sizes full builds transformers' model whole"),
        (["--family", "qwen3_moe", "--sizes", "huge", "--stream-shards"], "--sizes 'huge' is not toy or full"),
    ],
)
def test_what_cannot_be_trained_is_one_error_line_and_nothing_written(args, named, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        toy_folder.main([*args, "--out", str(tmp_path / "toy"), "--data-dir", str(DATA_DIR)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and named in err, err
    assert not (tmp_path / "toy").exists()


def test_a_folder_is_not_written_over(tmp_path):
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "notes.txt").write_text("mine")
    with pytest.raises(BadInput, match="is not empty"):
        toy_folder.make_toy_folder(tmp_path / "toy", family="qwen3", data_dir=DATA_DIR)
    assert [p.name for p in (tmp_path / "toy").iterdir()] == ["notes.txt"]


def test_the_command_line_prints_the_docs_command(tmp_path, capsys):
    """``python -m finetune.toy_folder`` as the docs run it (its main(), in this process: a subprocess would
    spend most of its time importing transformers and torchtune again): the folder, then the command that trains it
    (the family's 80 GB config, checkpoint_dir, output_dir, CPU_OVERRIDES), quoted for the shell."""
    out = tmp_path / "toy-llama3_2"
    toy_folder.main(["--family", "llama3_2", "--out", str(out), "--data-dir", str(DATA_DIR)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"wrote {out}: LlamaForCausalLM (llama3), 2 layers of width 96, 6 heads (2 key/value)")
    assert "(llama3 scaling, factor 32)" in lines[0] and "tied embeddings True" in lines[0]
    command = shlex.split(lines[-1])
    assert command == toy_folder.train_command("configs/llama3_2/3B_full_80gb.yaml", out, DATA_DIR)
    assert command[-len(toy_folder.CPU_OVERRIDES) :] == toy_folder.CPU_OVERRIDES
    assert {p.name for p in out.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "chat_template.jinja",
    }


# -- a folder too large to build whole: written tensor by tensor --------------------------------------------------------

SHARD_GB = 0.0005  # (500 kB: the toy MoE's 1.4 MB of bf16 in three shards, so the index and the cuts are exercised)


def test_a_streamed_folder_loads_in_transformers_and_in_our_loader(tmp_path):
    """The streamed folder is the family's, as transformers saves it: Qwen3MoeForCausalLM loads it with no missing,
    unexpected or mismatched tensor and holds every tensor of the shards as written; our recipe's loader reads the
    same tensors (per-expert names stacked) into the model config.json describes."""
    out = tmp_path / "moe"
    made = toy_folder.make_toy_folder(out, family="qwen3_moe", data_dir=DATA_DIR, stream=True, shard_gb=SHARD_GB)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert (
        shards
        == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
        == sorted(set(index["weight_map"].values()))
    )
    written = {}
    for shard in shards:
        written.update(load_file(str(out / shard)))
    assert set(written) == set(index["weight_map"]) and {t.dtype for t in written.values()} == {torch.bfloat16}
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in written.values())
    hf = made["config_json"]
    assert hf["architectures"] == ["Qwen3MoeForCausalLM"] and hf["hidden_act"] == "silu" and not hf["attention_bias"]
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in written  # (per expert, as the hub's folders)
    assert torch.equal(written["model.norm.weight"], torch.ones(hf["hidden_size"], dtype=torch.bfloat16))
    assert written["lm_head.weight"].float().std().item() == pytest.approx(toy_folder.STREAM_STD, rel=0.05)

    model, info = transformers.Qwen3MoeForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    theirs = model.state_dict()
    experts = "model.layers.1.mlp.experts"  # (transformers 5 holds them stacked: gate and up in one, gate first)
    gate = theirs[f"{experts}.gate_up_proj"][7][: hf["moe_intermediate_size"]]
    assert torch.equal(gate, written[f"{experts}.7.gate_proj.weight"])
    assert torch.equal(theirs[f"{experts}.down_proj"][7], written[f"{experts}.7.down_proj.weight"])
    assert torch.equal(theirs["model.embed_tokens.weight"], written["model.embed_tokens.weight"])

    family, section = hf_format.resolve_model(hf, None)
    section.pop("_component_")
    ours = from_hf_config.decoder(**section).to(torch.bfloat16)
    hf_format.load_weights(ours, out, hf, family)  # (strict: a missing or extra tensor raises)
    back = hf_format.to_hf(ours.state_dict(), hf, family)
    assert set(back) == set(written) and all(torch.equal(back[k], written[k]) for k in written)


def test_the_streamed_writer_holds_one_tensor_at_a_time(tmp_path, monkeypatch):
    """Host memory stays near one tensor, not one shard or the model: when a tensor's values are drawn, at most the
    one written before it is still alive; the shards are cut at their size; and Qwen3-30B-A3B's own layout (from the
    meta device: no memory) is 30.5B parameters in thirteen 5 GB shards, no tensor larger than its embedding."""
    alive, most = [], []
    real_draw = toy_folder.draw

    # (No gc.collect() per tensor, which cost 15 s: a tensor dies with its last reference, so one counted alive is
    # held, and one only the cycle collector would free counts as alive too: a stricter check, not a looser one.)
    def watched(*args, **kwargs):
        most.append(sum(ref() is not None for ref in alive))
        tensor = real_draw(*args, **kwargs)
        alive.append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(toy_folder, "draw", watched)
    hf = {**toy_folder.shrink({"model_type": "qwen3_moe", **toy_folder.MODELS["qwen3_moe"]["hf"]}), "vocab_size": 1024}
    toy_folder.stream_model(tmp_path, hf, shard_gb=SHARD_GB)
    shapes = toy_folder.hf_layout(hf)
    assert len(most) == len(shapes) and max(most) <= 1
    for shard in tmp_path.glob("*.safetensors"):
        assert sum(t.numel() * 2 for t in load_file(str(shard)).values()) <= SHARD_GB * 1e9

    full = toy_folder.hf_layout({"model_type": "qwen3_moe", **toy_folder.MODELS["qwen3_moe"]["hf"]})
    assert sum(torch.Size(s).numel() for s in full.values()) == 30_532_122_624
    plan = toy_folder.shard_plan(full, int(toy_folder.SHARD_GB * 1e9))
    sizes = [sum(torch.Size(full[n]).numel() * 2 for n in names) for names in plan]
    assert len(plan) == 13 and max(sizes) <= 5e9 and sum(sizes) == 2 * 30_532_122_624
    assert max(torch.Size(s).numel() for s in full.values()) == 151936 * 2048
    assert list(full)[0] == "model.embed_tokens.weight" and list(full)[-2:] == ["model.norm.weight", "lm_head.weight"]


def test_a_streamed_folder_larger_than_the_free_disk_is_refused_before_writing(tmp_path, monkeypatch, capsys):
    free = toy_folder.shutil.disk_usage(tmp_path)._replace(free=10**9)
    monkeypatch.setattr(toy_folder.shutil, "disk_usage", lambda path: free)
    argv = ["--family", "qwen3_moe", "--sizes", "full", "--stream-shards", "--device", "cpu"]
    with pytest.raises(SystemExit) as exit_:
        toy_folder.main([*argv, "--out", str(tmp_path / "full"), "--data-dir", str(DATA_DIR)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: the folder needs 61.1 GB and ") and err.endswith("--set num_hidden_layers=N)\n")
    assert not (tmp_path / "full").exists()
