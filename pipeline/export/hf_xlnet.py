"""XLNet -> transformers ``XLNetLMHeadModel``: weight mapping, config and tokenizer template.

transformers keeps each attention projection as one [H, heads, head_dim] tensor used as
``einsum("ibh,hnd->ibnd")``; ours are nn.Linear weights [heads*head_dim, H], i.e. the same
numbers reshaped and transposed (the output projection ``o`` is [H, heads, head_dim] there
and [H, heads*head_dim] here: a plain reshape). Dropping the padded vocabulary rows makes
HF's logits equal ours[..., :vocab_size].
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from pipeline.export.hf_common import ACTIVATIONS


def xlnet_to_hf_state(sd: dict[str, Tensor], cfg: Any) -> dict[str, Tensor]:
    V, H, n = cfg.vocab_size, cfg.hidden_size, cfg.num_heads
    d = H // n
    word = sd["word.weight"][:V]
    out = {
        "transformer.word_embedding.weight": word,
        "transformer.mask_emb": sd["mask_emb"].view(1, 1, H),
        "lm_loss.weight": word,  # tied: the same tensor as the embedding
        "lm_loss.bias": sd["lm_bias"][:V],
    }
    for i in range(cfg.num_layers):
        ours, hf = f"layers.{i}.", f"transformer.layer.{i}."
        q, k, v = sd[f"{ours}attn.qkv.weight"].chunk(3, dim=0)
        for name, w in (("q", q), ("k", k), ("v", v), ("r", sd[f"{ours}attn.r.weight"])):
            out[f"{hf}rel_attn.{name}"] = w.t().reshape(H, n, d).contiguous()
        out[f"{hf}rel_attn.o"] = sd[f"{ours}attn.o.weight"].reshape(H, n, d).contiguous()
        for name in ("r_w_bias", "r_r_bias", "r_s_bias", "seg_embed"):
            out[f"{hf}rel_attn.{name}"] = sd[f"{ours}attn.{name}"]
        pairs = {
            "rel_attn.layer_norm": "attn.ln",
            "ff.layer_1": "ff.fc",
            "ff.layer_2": "ff.proj",
            "ff.layer_norm": "ff.ln",
        }
        for hf_name, our_name in pairs.items():
            for p in ("weight", "bias"):
                out[f"{hf}{hf_name}.{p}"] = sd[f"{ours}{our_name}.{p}"]
    return out


def hf_xlnet_config(cfg: Any, roles: dict[str, int]):
    """transformers.XLNetConfig with our shape; bidirectional, no bi_data, same memory."""
    import transformers

    return transformers.XLNetConfig(
        vocab_size=cfg.vocab_size,
        d_model=cfg.hidden_size,
        n_layer=cfg.num_layers,
        n_head=cfg.num_heads,
        d_inner=cfg.intermediate_size,
        ff_activation=ACTIVATIONS[cfg.activation],
        attn_type="bi",
        bi_data=False,
        same_length=False,
        clamp_len=cfg.clamp_len,
        mem_len=cfg.mem_len or None,
        # Our model keeps memory exactly when mem_len > 0, training or not. transformers
        # would keep *all* past states with mem_len None and use_mems on (its eval default).
        use_mems_eval=cfg.mem_len > 0,
        use_mems_train=cfg.mem_len > 0,
        reuse_len=cfg.reuse_len,
        dropout=cfg.dropout,  # HF has one rate for everything (attention included)
        layer_norm_eps=cfg.layer_norm_eps,
        initializer_range=cfg.init_std,
        pad_token_id=roles.get("pad"),
        bos_token_id=roles.get("bos"),
        eos_token_id=roles.get("eos"),
    )


def hf_xlnet_model(cfg: Any, roles: dict[str, int]):
    """A freshly initialised `XLNetLMHeadModel` with the shape of our XLNetConfig."""
    import transformers

    return transformers.XLNetLMHeadModel(hf_xlnet_config(cfg, roles))


def xlnet_template(roles: dict[str, int], names: dict[str, str]):
    """XLNet's input format, as its HF tokenizer builds it: ``A <sep> B <sep> <cls>`` with
    segment ids 0 for A and its <sep>, 1 for B and its <sep>, 2 for the trailing <cls>."""
    from tokenizers.processors import TemplateProcessing

    cls, sep = names["cls"], names["sep"]
    return TemplateProcessing(
        single=f"$A:0 {sep}:0 {cls}:2",
        pair=f"$A:0 {sep}:0 $B:1 {sep}:1 {cls}:2",
        special_tokens=[(cls, roles["cls"]), (sep, roles["sep"])],
    )
