"""RoBERTa -> transformers ``RobertaForMaskedLM`` (logits equal ours[..., :vocab_size]).

Both number positions from ``pad_token_id + 1`` (our ``roberta_position_ids`` is
fairseq's make_positions, as in transformers), so the position table is copied as is
and the exported config carries our ``pad_token_id``. The tokenizer template is
RoBERTa's: ``<s> A </s>`` and ``<s> A </s></s> B </s>``, all segment ids 0.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}


def encoder_layer_state(sd: dict[str, Tensor], ours: str, hf: str) -> dict[str, Tensor]:
    """One post-LN layer of ours (fused qkv) as a BERT-family transformers layer."""
    out = {}
    weights = sd[f"{ours}attn.qkv.weight"].chunk(3, dim=0)  # rows [query; key; value]
    biases = sd[f"{ours}attn.qkv.bias"].chunk(3, dim=0)
    for j, part in enumerate(("query", "key", "value")):
        out[f"{hf}attention.self.{part}.weight"] = weights[j].contiguous()
        out[f"{hf}attention.self.{part}.bias"] = biases[j].contiguous()
    pairs = {
        "attention.output.dense": "attn.proj",
        "attention.output.LayerNorm": "ln_1",
        "intermediate.dense": "mlp.fc",
        "output.dense": "mlp.proj",
        "output.LayerNorm": "ln_2",
    }
    for hf_name, our_name in pairs.items():
        for p in ("weight", "bias"):
            out[f"{hf}{hf_name}.{p}"] = sd[f"{ours}{our_name}.{p}"]
    return out


def roberta_to_hf_state(sd: dict[str, Tensor], cfg: Any) -> dict[str, Tensor]:
    V = cfg.vocab_size
    out = {
        "roberta.embeddings.word_embeddings.weight": sd["embeddings.word.weight"][:V],
        "roberta.embeddings.position_embeddings.weight": sd["embeddings.position.weight"],
        "roberta.embeddings.token_type_embeddings.weight": sd["embeddings.token_type.weight"],
        "roberta.embeddings.LayerNorm.weight": sd["embeddings.ln.weight"],
        "roberta.embeddings.LayerNorm.bias": sd["embeddings.ln.bias"],
        "lm_head.dense.weight": sd["mlm_head.dense.weight"],
        "lm_head.dense.bias": sd["mlm_head.dense.bias"],
        "lm_head.layer_norm.weight": sd["mlm_head.ln.weight"],
        "lm_head.layer_norm.bias": sd["mlm_head.ln.bias"],
        "lm_head.bias": sd["mlm_head.bias"][:V],
    }
    for i in range(cfg.num_layers):
        out.update(encoder_layer_state(sd, f"blocks.{i}.", f"roberta.encoder.layer.{i}."))
    return out


def hf_roberta_model(cfg: Any, roles: dict[str, int]):
    """A freshly initialised ``RobertaForMaskedLM`` with the shape of our RobertaConfig."""
    import transformers

    if cfg.activation != "gelu":
        raise ValueError(
            f"model.activation={cfg.activation!r}: transformers' RoBERTa LM head always uses "
            "exact GELU, so only activation 'gelu' exports faithfully"
        )
    hf_cfg = transformers.RobertaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        hidden_act=_ACTIVATIONS[cfg.activation],
        hidden_dropout_prob=cfg.dropout,
        attention_probs_dropout_prob=cfg.attention_dropout,
        max_position_embeddings=cfg.max_positions,
        type_vocab_size=cfg.type_vocab_size,
        initializer_range=cfg.init_std,
        layer_norm_eps=cfg.layer_norm_eps,
        pad_token_id=cfg.pad_token_id,
        bos_token_id=roles.get("cls"),
        eos_token_id=roles.get("sep"),
    )
    return transformers.RobertaForMaskedLM(hf_cfg)


def roberta_template(roles: dict[str, int], names: dict[str, str]):
    """``<s> A </s>`` / ``<s> A </s></s> B </s>`` (transformers' RobertaTokenizer)."""
    from tokenizers.processors import TemplateProcessing

    cls, sep = names["cls"], names["sep"]
    return TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} {sep} $B {sep}",
        special_tokens=[(cls, roles["cls"]), (sep, roles["sep"])],
    )
