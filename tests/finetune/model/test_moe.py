"""finetune/model/moe.py: the sparse MoE block of Qwen3-MoE and its load-balancing loss.

The two expert paths (torch's grouped GEMM, a loop over the experts) compute the same outputs and gradients; an
expert that receives no token gets a zero gradient slice on both; the block's placement (``mlp_only_layers``,
``decoder_sparse_step``) is transformers'; the training loss (cross-entropy plus ``router_aux_loss_coef`` times the
load-balancing loss) is transformers' ``Qwen3MoeForCausalLM`` loss with ``output_router_logits``, and activation
checkpointing's recomputation does not count a layer's routing twice. On the CPU, torch's grouped GEMM runs its own
fallback; the GPU-marked test runs the CUDA kernel against the loop. A few seconds.
"""

import pytest
import torch
import torch.nn.functional as F
import transformers
from omegaconf import OmegaConf
from torchtune import config

import support
from finetune import toy_folder
from finetune.checkpoint import hf_format
from finetune.model import moe
from finetune.model.loss import training_loss
from finetune.model.prepare import apply_activation_checkpointing


def block(seed=0, dim=32, hidden=16, experts=6, top_k=2, norm=True, device="cpu", dtype=torch.float32):
    torch.manual_seed(seed)
    with torch.device(device):
        return moe.SparseMoe(dim, hidden, experts, top_k, norm).to(dtype)


def run(b, x, path):
    """The block's output and the gradients of x and of every weight, on one expert path."""
    b.experts.path = path
    b.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = b(x)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out))
    return out.detach(), x.grad, {name: p.grad.clone() for name, p in b.named_parameters()}


@pytest.mark.parametrize("norm", [True, False])
def test_both_expert_paths_compute_the_same(norm):
    b = block(norm=norm)
    x = torch.randn(3, 11, 32, generator=torch.Generator().manual_seed(2))
    loop, grouped = run(b, x, "loop"), run(b, x, "grouped_mm")
    torch.testing.assert_close(grouped[0], loop[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grouped[1], loop[1], rtol=1e-5, atol=1e-6)
    for name in loop[2]:
        torch.testing.assert_close(grouped[2][name], loop[2][name], rtol=1e-5, atol=1e-6, msg=name)
    assert set(loop[2]) == {"router.weight", "experts.gate_up_proj", "experts.down_proj"}


def check_reorderings(device, dtype, tokens, top_k, dim, experts, tol):
    gen = torch.Generator().manual_seed(3)
    chosen = torch.randint(0, experts, (tokens * top_k,), generator=gen).to(device)
    order = chosen.argsort(stable=True)
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=device)
    assert torch.equal(position, order.argsort())
    x = torch.randn(tokens, dim, generator=gen).to(device, dtype).requires_grad_()
    grad = torch.randn(tokens * top_k, dim, generator=gen).to(device, dtype)
    ours = moe._Dispatch.apply(x, order, position, top_k)
    (ours_grad,) = torch.autograd.grad(ours, x, grad)
    assert torch.equal(ours, x[order // top_k])
    # the gradient against indexing's computed in float64: within the dtype's rounding of the exact sum
    exact = x.detach().double().requires_grad_()
    (exact_grad,) = torch.autograd.grad(exact[order // top_k], exact, grad.double())
    torch.testing.assert_close(ours_grad.double(), exact_grad, rtol=tol, atol=1e-6)
    y = torch.randn(tokens * top_k, dim, generator=gen).to(device, dtype).requires_grad_()
    (ours_grad,) = torch.autograd.grad(moe._Permute.apply(y, position, order), y, grad)
    (plain_grad,) = torch.autograd.grad(y[position], y, grad)
    assert torch.equal(moe._Permute.apply(y, position, order), y[position]) and torch.equal(ours_grad, plain_grad)


def test_dispatch_and_combine_have_indexings_gradients_without_its_sort():
    """The block's two reorderings, the routed copies in expert order and back to token-major order, compute what
    indexing computes, forward and backward: the combine (a permutation) exactly, the dispatch (each token read
    top_k times: its copies' gradients summed) within fp32 rounding of the exact sum."""
    check_reorderings("cpu", torch.float32, tokens=13, top_k=3, dim=8, experts=5, tol=1e-6)


@pytest.mark.gpu
def test_gpu_dispatch_and_combine_have_indexings_gradients():
    """The same on CUDA in bf16 at Qwen3-30B-A3B's routing (8 of 128 experts a token, a residual of 2048): the dispatch's
    gradient sums a token's 8 copies in fp32 and rounds once, so it is the exact sum rounded to bf16 (half a step)."""
    check_reorderings("cuda", torch.bfloat16, tokens=512, top_k=8, dim=2048, experts=128, tol=2**-8)


@pytest.mark.parametrize("path", ["loop", "grouped_mm"])
def test_an_expert_without_tokens_gets_a_zero_gradient_slice(path):
    """Expert 3's router row points away from every (positive) input: it is never chosen, and its slices of the
    stacked weights get exactly zero gradient, not None: the optimizer sees a zero gradient for them."""
    b = block()
    with torch.no_grad():
        b.router.weight[3] = -10.0
    x = torch.rand(2, 9, 32, generator=torch.Generator().manual_seed(3))
    _, _, grads = run(b, x, path)
    for name in ("experts.gate_up_proj", "experts.down_proj"):
        assert torch.count_nonzero(grads[name][3]) == 0, name
        assert all(torch.count_nonzero(grads[name][e]) > 0 for e in range(6) if e != 3), name


def test_sparse_layers_are_where_transformers_puts_them():
    """``mlp_only_layers`` and ``decoder_sparse_step``: layer i is sparse unless listed, and only where (i + 1) is a
    multiple of the step; transformers' model of the same config.json has its sparse blocks at the same layers."""
    hf = {**support.TOYS["qwen3_moe_30b"].hf, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    family, built = hf_format.resolve_model(hf, None)
    with torch.device("meta"):
        ours = config.instantiate(OmegaConf.create(built))
        theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf))
    sparse = [i for i, layer in enumerate(ours.layers) if isinstance(layer.mlp, moe.SparseMoe)]
    assert sparse == [1, 5]
    assert sparse == [i for i, layer in enumerate(theirs.model.layers) if hasattr(layer.mlp, "experts")]
    assert ours.moe_fields["mlp_only_layers"] == [3] and ours.moe_fields["decoder_sparse_step"] == 2


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A toy Qwen3-MoE folder saved by transformers, our model of it, and transformers' (fp32)."""
    folder = tmp_path_factory.mktemp("moe")
    hf, _ = toy_folder.save_model(folder, support.TOYS["qwen3_moe_30b"].hf, scale=toy_folder.TINY_SCALE)
    family, built = hf_format.resolve_model(hf, None)

    def ours():
        model = config.instantiate(OmegaConf.create(built))
        hf_format.load_weights(model, folder, hf, family)
        return model

    return ours, transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), hf


def test_the_training_loss_is_transformers_with_router_logits(pair):
    """Cross-entropy plus router_aux_loss_coef x the load-balancing loss: transformers' loss and aux_loss with
    output_router_logits=True, on the same tokens; the recorded aux_loss is the unscaled one."""
    make, theirs, hf = pair
    ours = make()
    tokens = torch.randint(0, hf["vocab_size"], (2, 37), generator=torch.Generator().manual_seed(4))
    labels = torch.randint(0, hf["vocab_size"], (2, 37), generator=torch.Generator().manual_seed(5))
    ref = theirs(tokens, labels=labels, output_router_logits=True)
    logits = ours(tokens)
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, hf["vocab_size"]), labels[:, 1:].reshape(-1))
    loss, aux = training_loss(ours, ce)
    assert hf["router_aux_loss_coef"] == 0.001 and 1.5 < aux.item() < 3  # (2 per token: about 2 when even)
    assert aux.item() == pytest.approx(ref.aux_loss.item(), rel=1e-5)
    assert loss.item() == pytest.approx(ref.loss.item(), rel=1e-5)
    assert loss.item() == pytest.approx(ce.item() + 0.001 * aux.item(), rel=1e-6)
    assert training_loss(support.tiny_decoder(), ce) == (ce, None)  # a dense model: the loss as it was


def test_activation_checkpointing_counts_each_layer_once(pair):
    """With every layer recomputed in backward, the loss, its aux term and every gradient are those of the model
    without recomputation (the recomputed routing is not recorded a second time)."""
    make, _, hf = pair
    tokens = torch.randint(0, hf["vocab_size"], (2, 29), generator=torch.Generator().manual_seed(6))
    results = []
    for checkpointed in (False, True):
        model = make()
        if checkpointed:
            assert apply_activation_checkpointing(model) == 2
        loss, aux = training_loss(model, model(tokens).float().logsumexp(-1).mean())
        loss.backward()
        # (the same parameters in the same order, the wrapper's name aside)
        results.append(
            (
                loss.detach(),
                aux,
                [(n.replace("_checkpoint_wrapped_module.", ""), p.grad) for n, p in model.named_parameters()],
            )
        )
        assert torch.equal(model.aux_loss.detach(), aux)
    (loss, aux, grads), (loss_ac, aux_ac, grads_ac) = results
    assert torch.equal(loss, loss_ac) and torch.equal(aux, aux_ac)
    assert [n for n, _ in grads] == [n for n, _ in grads_ac]
    for (name, grad), (_, grad_ac) in zip(grads, grads_ac):
        torch.testing.assert_close(grad_ac, grad, rtol=1e-6, atol=1e-7, msg=name)


def test_compiled_sparse_layers_take_two_graphs_at_any_depth(monkeypatch):
    """Compiled as the recipe compiles (every layer checkpointed, then torch.compile per layer), a model of 10 sparse
    layers makes two graphs for all of them (the forward, which records the routing, and the recomputation, which
    does not), and trains the eager model's loss, aux term and gradients. Past compile's limit of 8 recompilations
    the layers would run uncompiled: when the layers appended to one shared list, its length (the layer's index) was
    part of each graph's guards, and this model made 8 graphs and ran its last layers eagerly."""
    from torch._dynamo.utils import counters
    from torchtune import training

    from finetune.model import qwen3_moe

    monkeypatch.setenv("TORCH_COMPILE_BACKEND", "eager")  # (dynamo's graphs and guards without inductor's minutes)

    def model():
        torch.manual_seed(0)
        m = qwen3_moe(
            vocab_size=96, num_layers=10, num_heads=2, num_kv_heads=1, embed_dim=32, intermediate_dim=64,
            moe_intermediate_dim=16, num_experts=6, num_experts_per_tok=2, max_seq_len=64, head_dim=16,
        ).to(torch.bfloat16)  # fmt: skip
        for b in m._sparse:
            b.experts.path = "grouped_mm"  # (the GPU's path, traceable: the loop's counts leave the graph)
        assert apply_activation_checkpointing(m) == 10
        return m

    eager, compiled = model(), model()
    torch._dynamo.reset()
    counters.clear()
    training.compile_model(compiled, verbose=False)
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(7))
    for _ in range(2):
        results = []
        for m in (eager, compiled):
            loss, aux = training_loss(m, m(tokens).float().logsumexp(-1).mean())
            loss.backward()
            results.append((loss.detach(), aux, [p.grad.clone() for p in m.parameters()]))
            m.zero_grad(set_to_none=True)
        (loss, aux, grads), (loss_c, aux_c, grads_c) = results
        assert torch.equal(loss_c, loss) and torch.equal(aux_c, aux)
        assert all(torch.equal(g_c, g) for g_c, g in zip(grads_c, grads))
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.gpu
def test_gpu_grouped_mm_kernel_matches_the_loop():
    """On a CUDA GPU of compute capability 9.0+, bf16: ``auto`` takes torch's grouped GEMM kernel, whose outputs and
    gradients match the loop's within bf16 rounding; an expert without tokens gets an exactly zero gradient slice (no
    stale memory from an empty group), at widths of Qwen3-30B-A3B's kind (multiples of 8, 16+ experts)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch's grouped GEMM kernel needs compute capability 9.0")
    b = block(dim=256, hidden=96, experts=16, top_k=4, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        b.router.weight[5] = -10.0
    x = torch.rand(4, 128, 256, device="cuda", dtype=torch.bfloat16)
    assert moe.grouped_mm_suits(x, b.experts.gate_up_proj, b.experts.down_proj)
    loop, grouped = run(b, x, "loop"), run(b, x, "auto")
    torch.testing.assert_close(grouped[0], loop[0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grouped[1], loop[1], rtol=2e-2, atol=2e-2)
    for name in loop[2]:
        torch.testing.assert_close(grouped[2][name], loop[2][name], rtol=2e-2, atol=2e-2, msg=name)
        assert torch.isfinite(grouped[2][name]).all(), name
    for name in ("experts.gate_up_proj", "experts.down_proj"):
        assert torch.count_nonzero(grouped[2][name][5]) == 0, name
