"""Model builders torchtune 0.6.1 lacks, made of its own modules: ``decoder`` (the Llama layout of any size and
feature set, what a folder's config.json is built with: finetune/model/from_hf_config.py), Qwen3 and Qwen3-MoE
through it (the MoE blocks: finetune/model/moe.py), and Mistral 7B v0.3.

Name one in a config as ``model._component_: finetune.model.builders.qwen3_8b`` (or ``finetune.model.builders.qwen3`` with explicit
sizes, as the tests do). The checkpoint component knows their Hugging Face format (``hf_format.FAMILIES``).

Qwen3 is Qwen2's decoder (SwiGLU MLP, RMSNorm, rotate-half RoPE with base 1e6) with three changes: no biases on the
q/k/v projections; an RMSNorm over each head's query and key (``q_norm``, ``k_norm``: one scale vector of
``head_dim`` shared by all heads) applied *before* RoPE; and ``head_dim`` set on its own (128 for every size, so
the 4B model's attention is 32 x 128 = 4096 wide on a 2560-wide residual). torchtune 0.6.1's MultiHeadAttention
takes q/k norms but applies them after RoPE, which is another function (the per-dimension scale does not commute
with the rotation), so ``QKNormAttention`` reorders that one step and reuses everything else.
"""

from typing import Any, Dict, Optional, Sequence

import torch
from torch import nn
from torchtune.models.llama3_1._position_embeddings import Llama3ScaledRoPE
from torchtune.models.mistral import mistral
from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
from torchtune.modules import (
    FeedForward,
    MultiHeadAttention,
    RMSNorm,
    RotaryPositionalEmbeddings,
    TiedLinear,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
)


class QKNormAttention(MultiHeadAttention):
    """torchtune's MultiHeadAttention with each head's query and key normalised before RoPE (Qwen3's order).

    Training and scoring only: the key-value cache for generation is not supported (generate with transformers
    from a saved checkpoint folder).
    """

    def forward(
        self, x: torch.Tensor, y: Optional[torch.Tensor] = None, *, mask=None, input_pos: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        if y is None or (self.kv_cache is not None and self.cache_enabled):
            raise ValueError(
                "QKNormAttention has no key-value cache: generate from a saved checkpoint with transformers"
            )
        b, s_x, _ = x.shape
        s_y = y.shape[1]
        # [b, s, n, h_d]: the norms act on the last dimension, one head at a time
        q = self.q_norm(self.q_proj(x).view(b, s_x, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(y).view(b, s_y, self.num_kv_heads, self.head_dim))
        v = self.v_proj(y).view(b, s_y, self.num_kv_heads, self.head_dim)
        q = self.pos_embeddings(q, input_pos=input_pos).transpose(1, 2)
        k = self.pos_embeddings(k, input_pos=input_pos).transpose(1, 2)
        v = v.transpose(1, 2)
        if self.num_heads != self.num_kv_heads:  # grouped-query attention: each k/v head serves q_per_kv queries
            expand = (b, self.num_kv_heads, self.num_heads // self.num_kv_heads, s_y, self.head_dim)
            k = k.unsqueeze(2).expand(expand).flatten(1, 2)
            v = v.unsqueeze(2).expand(expand).flatten(1, 2)
        output = self._attention_call(
            q,
            k,
            v,
            mask=mask,
            dropout_p=self.attn_dropout if self.training else 0.0,
            is_causal=mask is None and self.is_causal,
        )
        return self.output_proj(output.transpose(1, 2).contiguous().view(b, s_x, -1))


def decoder(
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    head_dim: int,
    norm_eps: float,
    rope_base: float,
    rope_scaling: Optional[Dict[str, float]] = None,
    rotate_half: bool = False,
    qkv_bias: bool = False,
    qk_norm: bool = False,
    tie_word_embeddings: bool = False,
    attn_dropout: float = 0.0,
    num_experts: int = 0,
    num_experts_per_tok: int = 0,
    moe_intermediate_dim: int = 0,
    norm_topk_prob: bool = False,
    decoder_sparse_step: int = 1,
    mlp_only_layers: Sequence[int] = (),
    router_aux_loss_coef: float = 0.0,
) -> TransformerDecoder:
    """A decoder of the Llama layout (RMSNorm, SwiGLU MLP, grouped-query attention with RoPE) of any size.

    ``rotate_half``: Qwen's RoPE (halves of each head rotated together: HF's layout, no permutation of q/k);
    otherwise torchtune's interleaved RoPE (the Llama and Mistral converters permute q/k for it).
    ``rope_scaling``: Llama 3.1's (``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``). ``qkv_bias``: Qwen2's biases on q, k and v. ``qk_norm``: Qwen3's RMSNorm
    over each head's query and key before RoPE. ``head_dim`` is its own size (Qwen3 4B: 32 x 128 on 2560).

    ``num_experts`` > 0: a mixture of experts (Qwen3-MoE, finetune/model/moe.py): layer ``i`` (from 0) is sparse,
    ``num_experts`` experts of width ``moe_intermediate_dim`` with ``num_experts_per_tok`` per token, unless ``i`` is in
    ``mlp_only_layers`` or ``i + 1`` is not a multiple of ``decoder_sparse_step`` (transformers' rule); the other
    layers keep the dense MLP of ``intermediate_dim``. The model adds ``router_aux_loss_coef`` times its
    load-balancing loss to the training loss.
    """
    dense_layers = set(mlp_only_layers)
    if num_experts > 0:
        # (imported here: a dense model's run never loads the MoE blocks, so the end-to-end rows of the dense configs,
        # which name the files their runs imported, stay current across changes to them)
        from finetune.model import moe
    if rotate_half:
        rope = Qwen2RotaryPositionalEmbeddings(dim=head_dim, max_seq_len=max_seq_len, base=rope_base)
    elif rope_scaling:
        rope = Llama3ScaledRoPE(
            dim=head_dim,
            max_seq_len=max_seq_len,
            base=rope_base,
            scale_factor=rope_scaling["factor"],
            low_freq_factor=rope_scaling["low_freq_factor"],
            high_freq_factor=rope_scaling["high_freq_factor"],
            old_context_len=rope_scaling["original_max_position_embeddings"],
        )
    else:
        rope = RotaryPositionalEmbeddings(dim=head_dim, max_seq_len=max_seq_len, base=rope_base)
    attention = QKNormAttention if qk_norm else MultiHeadAttention
    layers = nn.ModuleList()
    for i in range(num_layers):
        norms = (
            dict(q_norm=RMSNorm(dim=head_dim, eps=norm_eps), k_norm=RMSNorm(dim=head_dim, eps=norm_eps))
            if qk_norm
            else {}
        )
        attn = attention(
            embed_dim=embed_dim,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            q_proj=nn.Linear(embed_dim, num_heads * head_dim, bias=qkv_bias),
            k_proj=nn.Linear(embed_dim, num_kv_heads * head_dim, bias=qkv_bias),
            v_proj=nn.Linear(embed_dim, num_kv_heads * head_dim, bias=qkv_bias),
            output_proj=nn.Linear(num_heads * head_dim, embed_dim, bias=False),
            pos_embeddings=rope,
            max_seq_len=max_seq_len,
            attn_dropout=attn_dropout,
            **norms,
        )
        if num_experts > 0 and i not in dense_layers and (i + 1) % decoder_sparse_step == 0:
            mlp = moe.SparseMoe(embed_dim, moe_intermediate_dim, num_experts, num_experts_per_tok, norm_topk_prob)
        else:
            mlp = FeedForward(
                gate_proj=nn.Linear(embed_dim, intermediate_dim, bias=False),
                down_proj=nn.Linear(intermediate_dim, embed_dim, bias=False),
                up_proj=nn.Linear(embed_dim, intermediate_dim, bias=False),
            )
        layers.append(
            TransformerSelfAttentionLayer(
                attn=attn,
                mlp=mlp,
                sa_norm=RMSNorm(dim=embed_dim, eps=norm_eps),
                mlp_norm=RMSNorm(dim=embed_dim, eps=norm_eps),
            )
        )
    tok_embeddings = nn.Embedding(vocab_size, embed_dim)
    output = TiedLinear(tok_embeddings) if tie_word_embeddings else nn.Linear(embed_dim, vocab_size, bias=False)
    parts = dict(
        tok_embeddings=tok_embeddings,
        layers=layers,
        max_seq_len=max_seq_len,
        num_heads=num_heads,
        head_dim=head_dim,
        norm=RMSNorm(embed_dim, eps=norm_eps),
        output=output,
    )
    if num_experts == 0:
        return TransformerDecoder(**parts)
    moe_fields = dict(
        intermediate_size=intermediate_dim,
        moe_intermediate_size=moe_intermediate_dim,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        norm_topk_prob=bool(norm_topk_prob),
        decoder_sparse_step=decoder_sparse_step,
        mlp_only_layers=sorted(dense_layers),
        router_aux_loss_coef=float(router_aux_loss_coef),
    )
    return moe.MoeDecoder(moe_fields=moe_fields, **parts)


def qwen3(
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    head_dim: Optional[int] = None,
    attn_dropout: float = 0.0,
    norm_eps: float = 1e-6,
    rope_base: float = 1_000_000.0,
    tie_word_embeddings: bool = False,
) -> TransformerDecoder:
    """A Qwen3 decoder of any size (``head_dim`` defaults to embed_dim // num_heads): ``decoder`` with Qwen's
    rotate-half RoPE, no q/k/v biases and the q/k norms."""
    return _qwen3_decoder(
        vocab_size=vocab_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        embed_dim=embed_dim,
        intermediate_dim=intermediate_dim,
        max_seq_len=max_seq_len,
        head_dim=head_dim,
        norm_eps=norm_eps,
        rope_base=rope_base,
        tie_word_embeddings=tie_word_embeddings,
        attn_dropout=attn_dropout,
    )


def _qwen3_decoder(*, embed_dim: int, num_heads: int, head_dim: Optional[int], **fields: Any) -> TransformerDecoder:
    """What makes a decoder Qwen3's, dense or mixture of experts: Qwen's rotate-half RoPE, the q/k norms, no q/k/v
    biases, and head_dim embed_dim // num_heads unless config.json gives its own."""
    return decoder(
        embed_dim=embed_dim,
        num_heads=num_heads,
        head_dim=head_dim or embed_dim // num_heads,
        rotate_half=True,
        qk_norm=True,
        **fields,
    )


# The released dense sizes (Qwen/Qwen3-*/config.json): 151,936 tokens, head_dim 128, 40,960 positions.
def qwen3_0_6b() -> TransformerDecoder:
    return qwen3(
        vocab_size=151_936,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        embed_dim=1024,
        intermediate_dim=3072,
        max_seq_len=40_960,
        head_dim=128,
        tie_word_embeddings=True,
    )


def qwen3_1_7b() -> TransformerDecoder:
    return qwen3(
        vocab_size=151_936,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        embed_dim=2048,
        intermediate_dim=6144,
        max_seq_len=40_960,
        head_dim=128,
        tie_word_embeddings=True,
    )


def qwen3_4b() -> TransformerDecoder:
    return qwen3(
        vocab_size=151_936,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        embed_dim=2560,
        intermediate_dim=9728,
        max_seq_len=40_960,
        head_dim=128,
        tie_word_embeddings=True,
    )


def qwen3_8b() -> TransformerDecoder:
    return qwen3(
        vocab_size=151_936,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        embed_dim=4096,
        intermediate_dim=12288,
        max_seq_len=40_960,
        head_dim=128,
    )


def qwen3_moe(
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    moe_intermediate_dim: int,
    num_experts: int,
    num_experts_per_tok: int,
    max_seq_len: int,
    head_dim: Optional[int] = None,
    norm_topk_prob: bool = True,
    decoder_sparse_step: int = 1,
    mlp_only_layers: Sequence[int] = (),
    router_aux_loss_coef: float = 0.001,
    attn_dropout: float = 0.0,
    norm_eps: float = 1e-6,
    rope_base: float = 1_000_000.0,
    tie_word_embeddings: bool = False,
) -> TransformerDecoder:
    """A Qwen3-MoE decoder of any size: Qwen3's attention (``qwen3``) with sparse MoE blocks (finetune/model/moe.py);
    ``decoder`` documents the MoE keywords."""
    return _qwen3_decoder(
        vocab_size=vocab_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        embed_dim=embed_dim,
        intermediate_dim=intermediate_dim,
        max_seq_len=max_seq_len,
        head_dim=head_dim,
        norm_eps=norm_eps,
        rope_base=rope_base,
        tie_word_embeddings=tie_word_embeddings,
        attn_dropout=attn_dropout,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        moe_intermediate_dim=moe_intermediate_dim,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=decoder_sparse_step,
        mlp_only_layers=mlp_only_layers,
        router_aux_loss_coef=router_aux_loss_coef,
    )


def qwen3_moe_30b_a3b() -> TransformerDecoder:
    """Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B/config.json): 48 sparse layers of 128 experts of width 768, 8 per token,
    renormalised; 32 query heads of 128 in 4 key/value groups on a 2,048 residual; 30.5 B parameters, 3.3 B active."""
    return qwen3_moe(
        vocab_size=151_936,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        embed_dim=2048,
        intermediate_dim=6144,
        moe_intermediate_dim=768,
        num_experts=128,
        num_experts_per_tok=8,
        max_seq_len=40_960,
        head_dim=128,
    )


def mistral_7b_v0_3() -> TransformerDecoder:
    """Mistral-7B-v0.3: torchtune's ``mistral_7b`` is v0.1 (32,000 tokens, RoPE base 1e4); v0.3 has 32,768 tokens
    and RoPE base 1e6, and no sliding window."""
    return mistral(
        vocab_size=32_768,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        embed_dim=4096,
        intermediate_dim=14336,
        max_seq_len=32_768,
        norm_eps=1e-5,
        rope_base=1_000_000,
    )
