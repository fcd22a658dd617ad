"""``pretrain_heads=False`` (the forward contract, pipeline/models/base.py): every
architecture returns the same features without running a pretraining head, and
fine-tuning's encode path asks for exactly that.

"A head ran" is seen two ways: a forward hook on every submodule (the named head modules,
e.g. BERT's ``mlm_head`` / ``pooler`` / ``nsp_head``, must not be called) and a dispatch
mode that records every tensor an aten op produces: no tensor with the padded vocabulary
(3008, from a vocabulary of 3000) as its last dimension may appear, which catches the
functional LM heads (GPT's tied ``F.linear``, XLNet's, Transformer-XL's, ELMo's softmax)
and the ``bias + pad_bias`` of the MLM heads.
"""

import inspect

import pytest
import torch
from conftest import random_ids
from conftest import tiny_model as tiny
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pipeline.finetune.heads import FEATURES_ONLY, TaskModel, backbone_layers
from pipeline.models import ARCHITECTURES

VOCAB = 3000  # padded to 3008: a width no other tensor of a tiny model has
PADDED = 3008
FEATURE_KEYS = {"hidden_states", "layers", "mems"}
# the submodules that are pretraining heads (called as modules); the functional heads
# (tied F.linear on the embeddings) are caught by the vocabulary-width check
HEAD_MODULES = (
    "mlm_head",
    "pooler",
    "nsp_head",
    "sop_head",
    "discriminator_head",
    "generator_head",
    "generator",
)


class VocabularyOps(TorchDispatchMode):
    """Counts aten ops whose output's last dimension is the padded vocabulary."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == PADDED:
                self.count += 1
        return out


def called_heads(model: torch.nn.Module) -> tuple[list[str], list]:
    """(names of the head submodules called, the hook handles); names fill as it runs."""
    called: list[str] = []
    handles = []
    for name, module in model.named_modules():
        if set(name.split(".")) & set(HEAD_MODULES):  # a head or a part of one
            handles.append(module.register_forward_hook(lambda m, a, o, n=name: called.append(n)))
    return called, handles


def inputs_for(model: torch.nn.Module, B: int = 2, T: int = 12) -> dict[str, torch.Tensor]:
    """input_ids plus what the forward takes of: a padded attention mask, segment ids, and
    word2vec's contexts and negatives (so its pretraining scores would be computed)."""
    names = set(inspect.signature(model.forward).parameters)
    ids = random_ids(B, T, vocab_size=VOCAB)
    ids[:, 0] = 5  # not RoBERTa's pad id (1): the first token is real
    kw = {"input_ids": ids}
    if "attention_mask" in names:
        mask = torch.ones(B, T, dtype=torch.long)
        mask[1, T - 4 :] = 0  # the second row padded
        kw["attention_mask"] = mask
    if "token_type_ids" in names:
        kw["token_type_ids"] = torch.cat(
            [torch.zeros(B, T // 2, dtype=torch.long), torch.ones(B, T - T // 2, dtype=torch.long)],
            dim=1,
        )
    if "context_ids" in names:
        W, K = model.config.window, model.config.negatives
        g = torch.Generator().manual_seed(2)
        kw["context_ids"] = torch.randint(0, VOCAB, (B, T, 2 * W), generator=g)
        kw["negative_ids"] = torch.randint(0, VOCAB, (B, T, 2 * W, K), generator=g)
    return kw


def assert_same(a, b, what: str) -> None:
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y), what
    elif a is None:
        assert b is None, what
    else:
        assert torch.equal(a, b), what


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_features_only_forward_gives_the_same_features_and_no_head(arch):
    model = tiny(arch, vocab_size=VOCAB).eval()
    assert "pretrain_heads" in inspect.signature(model.forward).parameters, arch
    kw = inputs_for(model)
    called, handles = called_heads(model)
    with torch.no_grad():
        full_ops = VocabularyOps()
        with full_ops:
            full = model(**kw)
        heads_in_full = list(called)
        called.clear()
        feat_ops = VocabularyOps()
        with feat_ops:
            feats = model(**kw, pretrain_heads=False)
    for h in handles:
        h.remove()

    # the default is pretraining's forward: it has its heads' outputs (and runs them)
    assert set(full) - FEATURE_KEYS, (arch, sorted(full))
    assert full_ops.count > 0 or heads_in_full or arch in ("electra", "word2vec"), arch
    # features only: the feature keys alone, equal to the default forward's
    assert set(feats) <= FEATURE_KEYS and "hidden_states" in feats, (arch, sorted(feats))
    assert not [k for k in feats if k.endswith("logits") or k.endswith("scores")], arch
    for key in feats:
        assert_same(full[key], feats[key], f"{arch}: {key}")
    # and no pretraining head ran
    assert called == [], (arch, called)
    assert feat_ops.count == 0, (arch, feat_ops.count)


def test_xlnet_features_skip_the_query_stream():
    """With a target_mapping the default forward predicts from the query stream; the
    features are the content stream, the same without it."""
    model = tiny("xlnet", vocab_size=VOCAB).eval()
    ids = random_ids(2, 10, vocab_size=VOCAB)
    target = torch.zeros(2, 2, 10)
    target[:, 0, 3] = target[:, 1, 7] = 1
    perm = torch.zeros(2, 10, 10)
    perm[:, :, 3] = perm[:, :, 7] = 1
    with torch.no_grad():
        full = model(ids, perm_mask=perm, target_mapping=target)
        feats = model(ids, perm_mask=perm, target_mapping=target, pretrain_heads=False)
    assert full["logits"].shape[:2] == (2, 2)
    assert "logits" not in feats
    assert torch.equal(full["hidden_states"], feats["hidden_states"])


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_finetuning_encode_runs_no_pretraining_head(arch):
    """TaskModel (construction and forward, what `plm finetune` and `plm predict` run)
    calls the backbone with pretrain_heads=False: no head module, no vocabulary-wide op;
    its features are the backbone's hidden_states."""
    backbone = tiny(arch, vocab_size=VOCAB)
    kw = inputs_for(backbone)
    ids, B, T = kw["input_ids"], *kw["input_ids"].shape
    mask = kw.get("attention_mask", torch.ones(B, T, dtype=torch.long))
    types = kw.get("token_type_ids", torch.zeros(B, T, dtype=torch.long))
    mode = "features" if arch in FEATURES_ONLY else "full"
    called, handles = called_heads(backbone)
    ops = VocabularyOps()
    with ops:
        n_layers = 0
        if mode == "features":
            with torch.no_grad():
                n_layers = backbone_layers(backbone(input_ids=ids, pretrain_heads=False)).shape[1]
        model = TaskModel(backbone, "classification", 2, mode=mode, n_feature_layers=n_layers)
        model.eval()
        batch = {
            "input_ids": ids[:, None],
            "attention_mask": mask[:, None],
            "token_type_ids": types[:, None],
            "view_mask": torch.ones(B, 1, dtype=torch.bool),
            "labels": torch.tensor([0, 1]),
        }
        out = model(batch)
        with torch.no_grad():
            h = model.encode(ids, types, mask)
    for handle in handles:
        handle.remove()
    assert out["logits"].shape == (B, 2) and torch.isfinite(out["loss"]), arch
    assert called == [], (arch, called)
    assert ops.count == 0, (arch, ops.count)
    if mode == "full":  # the task features are the backbone's final layer, as before
        with torch.no_grad():
            names = set(inspect.signature(backbone.forward).parameters)
            args = {k: v for k, v in kw.items() if k in ("input_ids", "attention_mask")}
            if "token_type_ids" in names and getattr(backbone.config, "type_vocab_size", 2) > 1:
                args["token_type_ids"] = types
            full = backbone(**args)["hidden_states"]
        assert torch.equal(h, full), arch
