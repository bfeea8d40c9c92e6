"""zb's LLaMA as Hugging Face's `LlamaForCausalLM`: parameter names, the RoPE layout, config.json.

RoPE. zb rotates consecutive pairs of each head's dims, (x[2i], x[2i+1]) by angle pos * f_i, as
Meta's complex-number code does (zb.models.llama.apply_rope). transformers' Llama rotates halves,
(x[i], x[i + D/2]) by the same angle (its rotate_half). So the rows of wq and wk are reordered
within each head: HF row i takes zb row 2i and HF row D/2 + i takes zb row 2i + 1. Queries and keys
move the same way, so every score q.k is unchanged; wv and wo are untouched. transformers' own Llama
converter applies the same reordering to Meta's weights, which use zb's convention.

What the export refuses (exit 2): a family other than zb's llama2/llama3, or a parameter Llama has no
place for (zb's model growing a feature Llama cannot express must fail here, not export wrongly).
"""

from __future__ import annotations

import torch

from zb.errors import InvalidInput
from zb.models.args import ModelArgs

FAMILIES = ("llama2", "llama3")

# zb name (per layer: "layers.{i}." + key) -> HF name.
_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


def hf_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    prefix, _, rest = name.partition(".")
    index, _, key = rest.partition(".")
    if prefix == "layers" and index.isdigit() and key in _LAYER:
        return f"model.layers.{index}.{_LAYER[key]}"
    raise InvalidInput(f"parameter {name} has no place in Hugging Face's Llama layout: this model cannot be "
                       "exported as LlamaForCausalLM")


def interleaved_to_half(weight: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Reorder the output rows of a q or k projection from pairwise RoPE to half-split RoPE."""
    rows, cols = weight.shape
    if rows != n_heads * head_dim:
        raise InvalidInput(f"a projection of {rows} rows cannot hold {n_heads} heads of {head_dim} dims")
    return weight.view(n_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_state_dict(params: dict[str, torch.Tensor], args: ModelArgs, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """{HF name: tensor in `dtype`} from zb's whole parameters."""
    out = {}
    for name, tensor in params.items():
        if name.endswith("attention.wq.weight"):
            tensor = interleaved_to_half(tensor, args.n_heads, args.head_dim)
        elif name.endswith("attention.wk.weight"):
            tensor = interleaved_to_half(tensor, args.kv_heads, args.head_dim)
        out[hf_name(name)] = tensor.to(dtype).contiguous()
    return out


def hf_config(args: ModelArgs, dtype: torch.dtype, *, bos_id: int | None, eos_id: int | None,
              pad_id: int | None) -> dict:
    """config.json of LlamaForCausalLM (keys older and newer transformers read: rope_theta beside
    rope_parameters)."""
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": name,
        "dtype": name,
    }
