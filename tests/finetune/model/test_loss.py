"""finetune/model/loss.py's LinearCrossEntropyLoss against torchtune's CEWithChunkedOutputLoss: the same loss and the same
gradients (untied and tied output layers), the same recorded losses in the recipe, and its bad settings. On the CPU
it takes its torch path (chunks recomputed in backward); the GPU kernels (cce, liger) are measured by
bench/model_families.py --loss-rows."""

import pytest
import torch
from torchtune.models.llama3_2 import llama3_2
from torchtune.modules.loss import CEWithChunkedOutputLoss

from conftest import TORCH_ADAMW_LOSSES
from finetune.base import BadInput
from finetune.model.loss import LinearCrossEntropyLoss

RTOL = 1e-4  # as the recipe's recorded losses (tests/recipes/test_recipe.py)


def model(tied: bool):
    torch.manual_seed(0)
    return llama3_2(
        vocab_size=500,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=64,
        max_seq_len=64,
        intermediate_dim=128,
        tie_word_embeddings=tied,
    )


def loss_and_grads(m, loss_fn, tokens, labels):
    m.zero_grad()
    out = m(tokens)
    if not isinstance(out, list):
        out, labels = out.reshape(-1, out.size(-1)), labels.reshape(-1)
    loss = loss_fn(out, labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_same_loss_and_gradients_as_the_chunked_loss(tied):
    tokens = torch.randint(0, 500, (3, 40), generator=torch.Generator().manual_seed(1))
    labels = tokens.roll(-1, dims=1)
    labels[:, -5:] = -100  # ignored positions count in neither
    chunked, ours = model(tied), model(tied)
    ours.load_state_dict(chunked.state_dict())
    reference = CEWithChunkedOutputLoss(num_output_chunks=4)
    chunked.set_num_output_chunks(4)
    fused = LinearCrossEntropyLoss(num_chunks=3)
    assert fused.set_model_output(ours) == "torch"
    assert set(ours.state_dict()) == set(chunked.state_dict())  # (the model's weights are untouched)
    loss_ref, grads_ref = loss_and_grads(chunked, reference, tokens, labels)
    loss, grads = loss_and_grads(ours, fused, tokens, labels)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=1e-6)
    for name, grad in grads_ref.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_bad_settings_are_one_error_each():
    with pytest.raises(BadInput, match="loss.impl='fast' is not one of auto, cce, liger, torch"):
        LinearCrossEntropyLoss(impl="fast")
    with pytest.raises(BadInput, match="loss.num_chunks=0 must be a positive integer"):
        LinearCrossEntropyLoss(num_chunks=0)
    with pytest.raises(
        BadInput, match="loss.impl=cce runs Triton kernels on a CUDA GPU; on the CPU use loss.impl=torch"
    ):
        LinearCrossEntropyLoss(impl="cce").set_model_output(model(False))


def test_the_recipe_trains_the_same_with_it(recipe_runner):
    """The FAST tiny run with this loss instead of the config's chunked one: the recorded losses."""
    run = recipe_runner("loss._component_=finetune.model.LinearCrossEntropyLoss")
    assert run.ok, run.stderr[-3000:]
    assert "linear cross-entropy in one step (torch)" in run.stdout + run.stderr
    assert run.losses == pytest.approx(TORCH_ADAMW_LOSSES, rel=RTOL)
