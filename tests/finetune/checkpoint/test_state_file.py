"""finetune/checkpoint/state_file.py: a state file's CRC-32, computed while torch.save writes it and checked before a
resume reads it; a file without one falls back on its zip records' own CRCs.

The damaged checkpoints a resume refuses are run through the recipes in tests/recipes/test_damaged_state.py.
"""

import json
import zlib

import pytest
import torch

from finetune.base import BadInput
from finetune.checkpoint import state_file

FIX = "resume from another checkpoint"


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"global_step": 4, "optimizer": {"state": {0: {"exp_avg": torch.randn(4096, generator=g)}}}}


def test_the_checksum_written_while_saving_is_the_files_and_verifies(tmp_path):
    path = tmp_path / "recipe_state.pt"
    state_file.save(state(), path)
    kept = json.loads((tmp_path / "recipe_state.pt.crc32").read_text())
    data = path.read_bytes()
    assert kept == {"crc32": f"{zlib.crc32(data):08x}", "bytes": len(data)}  # (the same bytes, counted on the way)
    assert state_file.verify(path, FIX) is True
    for mmap in (False, True):
        loaded = torch.load(path, weights_only=True, mmap=mmap)
        assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], state()["optimizer"]["state"][0]["exp_avg"])


def test_a_changed_byte_or_an_edit_saved_again_does_not_match(tmp_path):
    path = tmp_path / "recipe_state.pt"
    state_file.save(state(), path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(BadInput, match=r"recipe_state\.pt does not match the checksum saved with it in recipe_state"):
        state_file.verify(path, FIX)

    edited = state()
    edited["global_step"] = 5
    torch.save(edited, path)  # (a consistent zip file of its own)
    with pytest.raises(BadInput) as refused:
        state_file.verify(path, FIX)
    assert str(refused.value).endswith(f"{FIX} (to resume from an edited file on purpose, delete recipe_state.pt.crc32: "
                                       "it is then read unverified)")  # fmt: skip

    (tmp_path / "recipe_state.pt.crc32").write_text("{not json")
    with pytest.raises(
        BadInput, match=r"recipe_state\.pt\.crc32 is not a checksum this recipe wrote \(JSONDecodeError"
    ):
        state_file.verify(path, FIX)


def test_without_a_checksum_the_zip_records_crcs_are_checked(tmp_path):
    path = tmp_path / "recipe_state.pt"
    torch.save(state(), path)  # (as a checkpoint written before checksums)
    assert state_file.verify(path, FIX) is False
    data = bytearray(path.read_bytes())
    start = data.index(torch.load(path, weights_only=True)["optimizer"]["state"][0]["exp_avg"][:4].numpy().tobytes())
    data[start + 100 : start + 356] = bytes(b ^ 0xFF for b in data[start + 100 : start + 356])  # 256 bytes flipped
    path.write_bytes(bytes(data))
    with pytest.raises(BadInput, match=r"recipe_state\.pt is damaged: its record \S+/data/0 fails its CRC check"):
        state_file.verify(path, FIX)
    path.write_bytes(b"garbage" * 100)
    assert state_file.verify(path, FIX) is False  # (not a zip: torch.load says what it is)
