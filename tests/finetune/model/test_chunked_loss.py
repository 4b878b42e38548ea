"""The chunked output loss of the 24 GiB configuration (configs/llama2/7B_full_24gb.yaml) against the plain one.

torchtune's CEWithChunkedOutputLoss with the model's ``set_num_output_chunks`` (what the recipe wires up when the
config's loss is chunked) must give the loss and every parameter gradient of the full-logits cross-entropy: the
logits are only never materialised in fp32 at once.
"""

import pytest
import torch
import torch.nn.functional as F
from torchtune.models.llama2 import llama2
from torchtune.modules.loss import CEWithChunkedOutputLoss

IGNORE = -100


def _model(seed):
    torch.manual_seed(seed)
    return llama2(vocab_size=300, num_layers=2, num_heads=2, num_kv_heads=2, embed_dim=32, max_seq_len=64)


@pytest.mark.parametrize("chunks", [1, 3, 8])
def test_chunked_loss_equals_plain_loss_and_gradient(chunks):
    torch.manual_seed(0)
    tokens = torch.randint(0, 300, (3, 24))
    labels = torch.randint(0, 300, (3, 24))
    labels[0, :5] = IGNORE  # masked prompt tokens, as the Alpaca collator produces
    labels[2, -7:] = IGNORE  # padding

    plain = _model(1)
    logits = plain(tokens)
    ref = F.cross_entropy(logits.reshape(-1, 300).float(), labels.reshape(-1), ignore_index=IGNORE)
    ref.backward()

    chunked = _model(1)
    chunked.set_num_output_chunks(chunks)
    out = chunked(tokens)
    assert isinstance(out, list) and len(out) == chunks
    loss = CEWithChunkedOutputLoss(num_output_chunks=chunks, ignore_index=IGNORE)(out, labels)
    loss.backward()

    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(plain.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
