"""finetune/checkpoint/hf_format.py: a folder read and loaded a transformer layer at a time.

Loading takes one layer's tensors (from every shard that holds them) before the next, so a model built on the GPU
never has the folder whole in host memory (a 30B mixture of experts' 57 GiB); the model gets the same tensors as
from the folder read whole. A second or two.
"""

import json
import re

import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torchtune import config

import support
from finetune import toy_folder
from finetune.checkpoint import hf_format


def _layer(key: str):
    found = re.match(r"^model\.layers\.(\d+)\.", key)
    return int(found.group(1)) if found else None


def test_a_sharded_folder_is_read_a_layer_at_a_time_and_loads_as_read_whole(tmp_path):
    source, sharded = tmp_path / "whole", tmp_path / "sharded"
    hf, _ = toy_folder.save_model(source, support.TOYS["qwen3_moe_30b"].hf, scale=toy_folder.TINY_SCALE)
    support.make_sharded(source, sharded, "20KB")
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    shards_of = {}
    for key, shard in weight_map.items():
        shards_of.setdefault(_layer(key), set()).add(shard)
    assert any(len(shards) > 1 for layer, shards in shards_of.items() if layer is not None)  # (a layer split)

    groups = list(hf_format.read_weight_groups(sharded))
    layers = [{_layer(key) for key in group} for group in groups]
    assert layers == [{n} for n in range(hf["num_hidden_layers"])] + [
        {None}
    ]  # each layer whole, in order, then the rest
    whole = load_file(str(source / "model.safetensors"))
    read = {key: tensor for group in groups for key, tensor in group.items()}
    assert read.keys() == whole.keys() and all(torch.equal(read[k], whole[k]) for k in whole)

    family, built = hf_format.resolve_model(hf, None)
    model = config.instantiate(OmegaConf.create(built))
    hf_format.load_weights(model, sharded, hf, family)
    expected = hf_format.to_tune(dict(whole), hf, family)  # (the folder converted whole, as loading once did)
    loaded = model.state_dict()
    assert expected.keys() == loaded.keys()
    assert all(torch.equal(loaded[k], expected[k].to(loaded[k].dtype)) for k in expected)
