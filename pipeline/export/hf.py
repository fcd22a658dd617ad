"""Export a model bundle as a transformers folder: ``from_pretrained(OUT)`` works offline.

    bert -> BertForPreTraining   (prediction_logits, seq_relationship_logits)
    gpt2 -> GPT2LMHeadModel      (logits)
    gpt  -> OpenAIGPTLMHeadModel (logits; adapter in hf_gpt.py)

The vocabulary: our models pad it to a multiple of 64 with rows that can never be
predicted. The export drops those rows, so the HF model's vocab_size equals the
tokenizer's and its logits equal ours[..., :vocab_size].

The tokenizer is written as a PreTrainedTokenizerFast with the bundle's special tokens.
For bert a post-processor adds [CLS] A [SEP] (B [SEP]) with segment ids, as the HF BERT
tokenizers do; gpt2 adds nothing, as HF's GPT-2 tokenizer. Special-token text in an input
("[MASK]" typed in a prompt) is the special token, as in every HF tokenizer, so the folder
works as it is with ``pipeline("fill-mask", model=OUT)``; ``split_special_tokens=True``
(here, or on a call) makes it plain text, as `plm`'s own ``load_tokenizer`` always reads it.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pipeline.export.hf_albert import albert_to_hf_state, hf_albert_model
from pipeline.export.hf_bert import bert_to_hf_state, hf_bert_model
from pipeline.export.hf_common import (
    ACTIVATIONS,
    ExportError,
    LazyState,
    decoder_config_fields,
    decoder_layer_state,
    stored_tensors,
    write_hf_folder,
)
from pipeline.export.hf_distilbert import distilbert_to_hf_state, hf_distilbert_model
from pipeline.export.hf_electra import electra_to_hf_state, hf_electra_model, write_generator
from pipeline.export.hf_ernie import ernie_to_hf_state, hf_ernie_model
from pipeline.export.hf_gpt import gpt_state, hf_gpt_model
from pipeline.export.hf_roberta import hf_roberta_model, roberta_template, roberta_to_hf_state
from pipeline.export.hf_xlnet import hf_xlnet_model, xlnet_template, xlnet_to_hf_state
from pipeline.models.bundle import (
    BundleTensors,
    max_shard_bytes_of,
    own_file,
    read_bundle_config,
    replace_dir,
)
from pipeline.models.registry import ARCHITECTURES

# ----------------------------------------------------------------------------- gpt2


def _gpt2_state(sd: dict[str, Tensor], cfg: Any) -> dict[str, Tensor]:
    V = cfg.vocab_size
    out = {
        "transformer.wte.weight": sd["wte.weight"][:V],
        "transformer.wpe.weight": sd["wpe.weight"],
        "transformer.ln_f.weight": sd["ln_f.weight"],
        "transformer.ln_f.bias": sd["ln_f.bias"],
    }
    for i in range(cfg.num_layers):
        out.update(decoder_layer_state(sd, f"blocks.{i}.", f"transformer.h.{i}."))
    return out


def hf_gpt2_model(cfg: Any, roles: dict[str, int]):
    """A freshly initialised `GPT2LMHeadModel` with the shape of our GPT2Config."""
    import transformers

    hf_cfg = transformers.GPT2Config(
        **decoder_config_fields(cfg, roles),
        n_inner=cfg.intermediate_size,
        activation_function=ACTIVATIONS[cfg.activation],
    )
    return transformers.GPT2LMHeadModel(hf_cfg)


_ADAPTERS = {"bert": (bert_to_hf_state, hf_bert_model), "gpt2": (_gpt2_state, hf_gpt2_model)}
_ADAPTERS["roberta"] = (roberta_to_hf_state, hf_roberta_model)  # RobertaForMaskedLM
_ADAPTERS["albert"] = (albert_to_hf_state, hf_albert_model)  # AlbertForPreTraining
_ADAPTERS["electra"] = (electra_to_hf_state, hf_electra_model)  # ElectraForPreTraining
_ADAPTERS["distilbert"] = (distilbert_to_hf_state, hf_distilbert_model)  # ...ForMaskedLM
_ADAPTERS["ernie"] = (ernie_to_hf_state, hf_ernie_model)  # ErnieForPreTraining
# More transformers models written beside the main one: fn(state, cfg, roles, out, tokenizer)
_EXTRA_WRITERS = {"electra": write_generator}  # the generator in OUT/generator/
_ADAPTERS["gpt"] = (gpt_state, hf_gpt_model)  # OpenAIGPTLMHeadModel
_ADAPTERS["xlnet"] = (xlnet_to_hf_state, hf_xlnet_model)  # XLNetLMHeadModel


# ----------------------------------------------------------------------------- tokenizer


def _hf_tokenizer(
    bundle_dir: Path,
    arch: str,
    roles: dict[str, int],
    max_len: int,
    type_vocab_size: int = 2,
    split_special_tokens: bool = False,
):
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_file(str(own_file(bundle_dir, "tokenizer.json")))
    names = {role: tok.id_to_token(i) for role, i in roles.items() if i is not None}
    if arch in ("bert", "albert", "electra", "ernie", "distilbert"):
        cls, sep = names["cls"], names["sep"]
        # segment B: type 1, or 0 for a model with one segment type (type_vocab_size 1;
        # type 1 would be out of its embedding's range), as the objectives and our model do
        b = 1 if type_vocab_size > 1 else 0
        tok.post_processor = TemplateProcessing(
            single=f"{cls} $A:0 {sep}:0",
            pair=f"{cls} $A:0 {sep}:0 $B:{b} {sep}:{b}",
            special_tokens=[(cls, roles["cls"]), (sep, roles["sep"])],
        )
        input_names = ["input_ids", "token_type_ids", "attention_mask"]
        if arch == "distilbert":  # no segment embeddings
            input_names = ["input_ids", "attention_mask"]
    elif arch == "xlnet":  # A <sep> B <sep> <cls>, segment ids 0 / 1 / 2
        tok.post_processor = xlnet_template(roles, names)
        input_names = ["input_ids", "token_type_ids", "attention_mask"]
    elif arch == "roberta":  # <s> A </s></s> B </s>, no segment ids
        tok.post_processor = roberta_template(roles, names)
        input_names = ["input_ids", "attention_mask"]
    else:
        input_names = ["input_ids", "attention_mask"]
    specials = {
        f"{role}_token": names[role]
        for role in ("unk", "pad", "cls", "sep", "mask", "bos", "eos")
        if role in names
    }
    # Special-token text ("[MASK]" typed in a prompt) is the special token: HF's convention,
    # which its pipelines rely on (fill-mask looks for the mask token's id). With
    # split_special_tokens=True (saved in tokenizer_config.json) it is plain text, as in our
    # load_tokenizer, where training data must not inject control tokens.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_input_names=input_names,
        model_max_length=max_len,
        split_special_tokens=split_special_tokens,
        **specials,
    )


# ----------------------------------------------------------------------------- export


def max_input_tokens(arch: str, cfg: Any) -> int:
    """The tokenizer's ``model_max_length``: the longest input the exported model takes.

    RoBERTa numbers real tokens from ``pad_token_id + 1`` (fairseq), so of its
    ``max_positions`` rows only ``max_positions - pad_token_id - 1`` serve tokens: 512 of
    roberta-base's 514, as transformers' ``roberta-base`` tokenizer says.
    """
    if arch == "roberta":
        return cfg.max_positions - cfg.pad_token_id - 1
    return cfg.max_positions


def export_to_hf(
    bundle_dir: str | Path,
    out_dir: str | Path,
    max_shard_bytes: int | None = None,
    split_special_tokens: bool = False,
) -> Path:
    """Write OUT/config.json, the weights (``model.safetensors``, or above
    ``max_shard_bytes`` -- default: what the bundle was written with -- transformers'
    ``model-0000K-of-0000N.safetensors`` + ``model.safetensors.index.json``) and the
    tokenizer files, atomically. ``split_special_tokens``: the exported tokenizer reads
    special-token text ("[MASK]", "<|endoftext|>") as plain text, as ``load_tokenizer``
    does (for code of ours that must score text as our training saw it); by default it is
    the special token, HF's convention (``pipeline("fill-mask", model=OUT)`` works).

    Streamed: the transformers model is built on the meta device (its names, shapes and
    tied weights, no memory), each of its tensors is computed from the bundle tensor(s) it
    comes from when its turn to be written comes, and appended to the files
    (``ShardedWriter``): one or two tensors in memory at a time, never the model."""
    bundle_dir, out_dir = Path(bundle_dir), Path(out_dir)
    try:
        config = read_bundle_config(bundle_dir)  # FileNotFoundError when it is no bundle
    except ValueError as err:
        raise ExportError(str(err)) from None
    arch = config["arch"]
    if arch not in _ADAPTERS:
        raise ExportError(
            f"{bundle_dir}: no transformers export for arch {arch!r} (the bundle is its "
            f"interface: pipeline.models.bundle.load_bundle); exportable: "
            f"{', '.join(sorted(_ADAPTERS))}"
        )
    if max_shard_bytes is None:
        max_shard_bytes = max_shard_bytes_of(config)
    to_state, make_model = _ADAPTERS[arch]
    cfg = ARCHITECTURES[arch][0].model_validate(config["model"])
    roles = config["vocab"].get("roles", {})

    state = LazyState(BundleTensors(bundle_dir))  # nothing read yet
    try:
        hf_state = to_state(state, cfg)  # names -> deferred tensors
        with torch.device("meta"):
            model = make_model(cfg, roles)
    except ExportError as err:
        raise ExportError(f"{bundle_dir} ({arch}): {err}") from None
    expected = stored_tensors(model, hf_state, arch)
    tokenizer = _hf_tokenizer(
        bundle_dir, arch, roles, max_input_tokens(arch, cfg), getattr(cfg, "type_vocab_size", 2),
        split_special_tokens,
    )  # fmt: skip

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        write_hf_folder(tmp, model, expected, hf_state, max_shard_bytes)
        tokenizer.save_pretrained(tmp)
        if arch in _EXTRA_WRITERS:
            _EXTRA_WRITERS[arch](state, cfg, roles, tmp, tokenizer, max_shard_bytes)
        tmp.chmod(0o755)
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
