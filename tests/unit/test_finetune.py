"""Fine-tuning pieces in-process: metrics, CRF, input formats, heads on every architecture,
layer-wise lr decay, and the bad-input errors raised before training starts."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
import torch

from pipeline.finetune import metrics as M
from pipeline.finetune.config import FinetuneError, TaskSection, validate_finetune
from pipeline.finetune.data import Encoder, collate
from pipeline.finetune.heads import CRF, TaskModel, layer_depth, param_groups
from pipeline.finetune.loop import prepare
from pipeline.models.registry import ARCHITECTURES, build_model, resolve_model_config

WORDS = "the cat dog reads a good bad book very new york red blue color is what".split()


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict[str, Path]:
    """A random-weight tiny bundle per architecture that has a `<arch>-tiny` preset."""
    from pipeline.models.bundle import save_bundle
    from pipeline.prepare.tokenizer import TokenizerSpec, train_tokenizer

    root = tmp_path_factory.mktemp("ft_bundles")
    rng = random.Random(0)
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(300)))
    toks = {
        kind: train_tokenizer([str(corpus)], TokenizerSpec(kind=kind, vocab_size=120), root / kind)
        for kind in ("wordpiece", "bpe")
    }
    out = {}
    for arch in ARCHITECTURES:
        tok = toks["bpe" if arch == "gpt2" else "wordpiece"]
        meta = json.loads((Path(tok) / "tokenizer_meta.json").read_text())
        try:
            cfg = resolve_model_config({"arch": arch, "preset": f"{arch}-tiny"}, meta["vocab_size"])
        except Exception:
            continue  # no tiny preset for it yet
        torch.manual_seed(0)
        out[arch] = save_bundle(root / arch, arch, cfg, build_model(arch, cfg).state_dict(), tok)
    return out


def encoder_for(bundle: Path, task: TaskSection) -> tuple[Encoder, torch.nn.Module, dict]:
    from pipeline.models.bundle import load_bundle
    from pipeline.prepare.tokenizer import load_tokenizer

    model, cfg = load_bundle(bundle)
    tok, _ = load_tokenizer(bundle)
    roles = cfg["vocab"]["roles"]
    return Encoder(tok, roles, bool(model.causal), task, cfg["arch"]), model, roles


# ----------------------------------------------------------------------------- metrics


def test_entity_f1_counts_whole_chunks():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["O", "B-ORG"]]
    pred = [["B-PER", "O", "O", "B-LOC"], ["O", "B-ORG"]]  # PER cut short: a wrong entity
    s = M.entity_scores(pred, gold)
    assert s["entity_precision"] == pytest.approx(2 / 3) and s["entity_recall"] == pytest.approx(
        2 / 3
    )
    assert s["token_accuracy"] == pytest.approx(5 / 6)
    assert M.entities(["B-X", "I-X", "B-X", "I-Y"]) == {("X", 0, 2), ("X", 2, 3), ("Y", 3, 4)}


def test_classification_regression_qa_metrics():
    assert M.accuracy([0, 1, 1], [0, 1, 0]) == pytest.approx(2 / 3)
    assert M.macro_f1([0, 0, 1], [0, 1, 1]) == pytest.approx(2 / 3)
    assert M.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert M.pearson([1, 2, 3], [2, 4, 6.5]) > 0.99
    s = M.qa_scores(["The red cat", "blue"], [["red cat"], ["green"]])
    assert s == {"exact_match": 0.5, "f1": 0.5}


def test_crf_matches_brute_force():
    torch.manual_seed(0)
    crf = CRF(3)
    for p in crf.parameters():
        torch.nn.init.normal_(p)
    em = torch.randn(2, 3, 3)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    tags = torch.tensor([[0, 2, 1], [1, 1, 0]])

    def path_score(b, path):
        s = crf.start[path[0]] + em[b, 0, path[0]]
        for w in range(1, len(path)):
            s = s + crf.trans[path[w - 1], path[w]] + em[b, w, path[w]]
        return s + crf.end[path[-1]]

    nll, best = 0.0, []
    for b, n in enumerate([3, 2]):
        paths = list(itertools.product(range(3), repeat=n))
        scores = torch.stack([path_score(b, p) for p in paths])
        nll += torch.logsumexp(scores, 0) - path_score(b, tags[b, :n].tolist())
        best.append(list(paths[int(scores.argmax())]))
    assert crf.nll(em, tags, mask).item() == pytest.approx(nll.item() / 2, rel=1e-5)
    assert crf.decode(em, mask) == best


# ----------------------------------------------------------------------------- input formats


def test_encoder_and_gpt_input_transformations(bundles):
    pair = TaskSection(type="classification", text_pair_column="b", symmetric_pair=True)
    enc, _, roles = encoder_for(bundles["bert"], pair)
    (ex,) = enc.encode([{"text": "the cat", "b": "a dog", "label": "x"}], ["x", "y"], "t", True)
    ids, types = ex.views[0]
    assert ids[0] == roles["cls"] and ids[-1] == roles["sep"] and ids.count(roles["sep"]) == 2
    assert types == [0] * (ids.index(roles["sep"]) + 1) + [1] * (
        len(ids) - ids.index(roles["sep"]) - 1
    )
    assert len(ex.views) == 2  # both orders (GPT's similarity input)

    enc, _, roles = encoder_for(bundles["roberta"], pair)
    (ex,) = enc.encode([{"text": "the cat", "b": "a dog", "label": "x"}], ["x", "y"], "t", True)
    ids, _ = ex.views[0]
    sep = ids.index(roles["sep"])
    assert ids[sep + 1] == roles["sep"] and ids.count(roles["sep"]) == 3  # <s> A </s></s> B </s>

    enc, _, roles = encoder_for(bundles["gpt2"], pair)
    (ex,) = enc.encode([{"text": "the cat", "b": "a dog", "label": "y"}], ["x", "y"], "t", True)
    (a, _), (b, _) = ex.views
    assert (
        a[0] == roles["bos"] and a[-1] == roles["eod"] and roles["sep"] in a
    )  # start, delim, extract
    assert a[1 : a.index(roles["sep"])] == b[b.index(roles["sep"]) + 1 : -1]  # order swapped
    assert ex.label == 1

    mc = TaskSection(type="multiple_choice")
    enc, _, _ = encoder_for(bundles["gpt2"], mc)
    (ex,) = enc.encode(
        [{"text": "the cat is", "choices": ["good", "bad", "red"], "label": 2}], [], "t", True
    )
    assert len(ex.views) == 3 and ex.label == 2  # one pass per choice


def test_tagging_first_subtoken_and_qa_windows(bundles):
    tag = TaskSection(type="tagging")
    enc, _, _ = encoder_for(bundles["bert"], tag)
    words = ["the", "catdog", "reads"]
    (ex,) = enc.encode([{"text": words, "label": ["O", "B-ANI", "O"]}], ["B-ANI", "O"], "t", True)
    ids = ex.views[0][0]
    assert ex.word_starts[0] == 1 and ex.label == [1, 0, 1]
    assert ex.word_starts[2] - ex.word_starts[1] > 1  # the long word has several sub-tokens
    first_piece = enc.tok.encode(["catdog"], is_pretokenized=True).ids[0]
    assert ids[ex.word_starts[1]] == first_piece

    qa = TaskSection(type="span_qa", max_length=16, doc_stride=4)
    enc, _, _ = encoder_for(bundles["bert"], qa)
    ctx = "the cat reads a book " * 3 + "the color is red " + "a dog reads " * 3
    row = {
        "question": "what color",
        "context": ctx,
        "answers": {"text": "red", "answer_start": ctx.index("red")},
    }
    windows = enc.encode([row], [], "t", True)
    assert len(windows) > 3  # a long context: several strided windows
    hits = [w for w in windows if w.label != (0, 0)]
    assert hits
    for w in hits:
        s, e = w.label
        assert ctx[w.offsets[s][0] : w.offsets[e][1]] == "red"


# ----------------------------------------------------------------------------- heads


def tiny_batch(task: str, enc: Encoder):
    r = random.Random(1)
    rows, labels = [], []
    for i in range(8):
        animal = ["cat", "dog"][i % 2]
        if task == "classification":
            rows.append({"text": f"the {animal} reads", "label": animal})
            labels = ["cat", "dog"]
        elif task == "regression":
            rows.append({"text": "very " * (i % 3) + "good", "label": float(i % 3)})
        elif task == "tagging":
            rows.append({"text": ["the", animal, "reads"], "label": ["O", "B-ANI", "O"]})
            labels = ["B-ANI", "O"]
        elif task == "multiple_choice":
            choices = ["good", "bad"] if i % 2 == 0 else ["bad", "good"]  # "good" is right
            rows.append({"text": f"the {animal} is", "choices": choices, "label": i % 2})
        else:
            color = r.choice(["red", "blue"])
            ctx = f"the {animal} is {color} today"
            rows.append(
                {
                    "question": "what color",
                    "context": ctx,
                    "answers": {"text": color, "answer_start": ctx.index(color)},
                }
            )
    ex = enc.encode(rows, labels, "t", True)
    return collate(ex, 0, task), max(1, len(labels))


@pytest.mark.parametrize(
    "task", ["classification", "regression", "tagging", "multiple_choice", "span_qa"]
)
@pytest.mark.parametrize("arch", ["bert", "gpt2"])  # one encoder, one causal model
def test_every_head_learns(bundles, task, arch):
    """A few steps on one batch: the loss falls (CRF tagging on the causal model)."""
    sec = TaskSection(type=task, crf=task == "tagging" and arch == "gpt2", max_length=24)
    enc, backbone, _ = encoder_for(bundles[arch], sec)
    batch, n_labels = tiny_batch(task, enc)
    torch.manual_seed(0)
    model = TaskModel(backbone, task, n_labels, crf=sec.crf)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    losses = []
    for _ in range(12):
        loss = model(batch)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], (arch, task, losses)


def test_every_architecture_takes_every_head(bundles):
    """Every landed architecture: each head it supports gives outputs of the right shape
    and a finite loss whose gradient reaches the head (and the backbone unless frozen)."""
    from pipeline.finetune.heads import FEATURES_ONLY, UNSUPPORTED, backbone_layers

    shapes = {
        "classification": ("logits", (8, 2)),
        "regression": ("logits", (8,)),
        "tagging": ("logits", (8, 3, 2)),
        "multiple_choice": ("logits", (8, 2)),
    }
    for arch, bundle in bundles.items():
        mode = "features" if arch in FEATURES_ONLY else "full"
        for task in [*shapes, "span_qa"]:
            if task in UNSUPPORTED.get(arch, {}):
                continue
            enc, backbone, _ = encoder_for(bundle, TaskSection(type=task, max_length=24))
            batch, n_labels = tiny_batch(task, enc)
            n_layers = 0
            if mode == "features":
                with torch.no_grad():
                    outputs = backbone(input_ids=batch["input_ids"][:, 0])
                n_layers = backbone_layers(outputs).shape[1]
            torch.manual_seed(0)
            model = TaskModel(backbone, task, n_labels, mode=mode, n_feature_layers=n_layers)
            out = model(batch)
            if task == "span_qa":
                n, _, T = batch["input_ids"].shape  # one example per context window
                assert out["start_logits"].shape == out["end_logits"].shape == (n, T)
            else:
                key, shape = shapes[task]
                assert tuple(out[key].shape) == shape, (arch, task, out[key].shape)
            out["loss"].backward()
            assert torch.isfinite(out["loss"]), (arch, task)
            assert model.head.weight.grad.abs().sum() > 0, (arch, task)
            grads = [p.grad for p in backbone.parameters() if p.grad is not None]
            assert bool(grads) == (mode == "full"), (arch, task)


def test_pooling_reads_cls_for_encoders_and_last_real_token_for_causal(bundles):
    for arch in ("bert", "gpt2"):
        sec = TaskSection(type="classification")
        enc, backbone, _ = encoder_for(bundles[arch], sec)
        model = TaskModel(backbone, "classification", 2).eval()
        rows = [
            {"text": "the cat reads a good book", "label": "a"},
            {"text": "a dog", "label": "b"},
        ]
        ex = enc.encode(rows, ["a", "b"], "t", True)
        both = model(collate(ex, 0, "classification"))["logits"]
        alone = model(collate(ex[1:], 0, "classification"))["logits"]
        # the short example padded to the long one's length gives the same logits
        assert torch.allclose(both[1], alone[0], atol=1e-5)
        assert model.pooling == ("last" if arch == "gpt2" else "first")


def test_layer_wise_lr_decay_groups(bundles):
    _, backbone, _ = encoder_for(bundles["bert"], TaskSection(type="classification"))
    model = TaskModel(backbone, "classification", 2)
    groups = param_groups(model, lr=1.0, head_lr=2.0, decay=0.5, weight_decay=0.01)
    lr_of = {id(p): g["lr"] for g in groups for p in g["params"]}
    L = 2  # bert-tiny
    assert lr_of[id(backbone.embeddings.word.weight)] == pytest.approx(0.5 ** (L + 1))
    assert lr_of[id(backbone.blocks[0].mlp.fc.weight)] == pytest.approx(0.5**L)
    assert lr_of[id(backbone.blocks[1].mlp.fc.weight)] == pytest.approx(0.5)
    assert lr_of[id(model.head.weight)] == 2.0
    assert layer_depth("blocks.1.attn.qkv.weight", 2) == 2 and layer_depth("wte.weight", 2) == 0


def test_frozen_mode_trains_only_the_head(bundles):
    _, backbone, _ = encoder_for(bundles["bert"], TaskSection(type="classification"))
    model = TaskModel(backbone, "classification", 2, mode="frozen")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"head.weight", "head.bias"}
    model.train()
    assert not model.backbone.training  # no dropout in a fixed feature extractor


# ----------------------------------------------------------------------------- bad input


def write_jsonl(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def cfg_for(source, train, valid=None, **task):
    return validate_finetune(
        {
            "name": "t",
            "model": {"source": str(source)},
            "task": {"type": "classification", **task},
            "data": {"train": train, "valid": valid},
        }
    )


def test_bad_input_fails_before_training(bundles, tmp_path):
    good = [{"text": "the cat", "label": "a"}, {"text": "a dog", "label": "b"}]
    train = write_jsonl(tmp_path / "train.jsonl", good)
    dl = tmp_path / "dl"
    bad_label = write_jsonl(tmp_path / "valid.jsonl", [*good, {"text": "x", "label": "zzz"}])
    with pytest.raises(FinetuneError, match=r"valid.jsonl row 3: label 'zzz'.*known labels: a, b"):
        prepare(cfg_for(bundles["bert"], train, bad_label), dl)
    with pytest.raises(
        FinetuneError, match=r"missing column\(s\) sentence; the file has columns text, label"
    ):
        prepare(cfg_for(bundles["bert"], train, text_column="sentence"), dl)
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(FinetuneError, match="empty.csv is empty"):
        prepare(cfg_for(bundles["bert"], str(tmp_path / "empty.csv")), dl)
    with pytest.raises(FinetuneError, match="does not exist"):
        prepare(cfg_for(tmp_path / "nope", train), dl)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.yaml").write_text("format_version: 1\narch: lstm9000\n")
    with pytest.raises(FinetuneError, match="incompatible bundle: .*unknown arch 'lstm9000'"):
        prepare(cfg_for(broken, train), dl)
    with pytest.raises(FinetuneError, match="not a model bundle: no config.yaml"):
        prepare(cfg_for(tmp_path, train), dl)
    with pytest.raises(FinetuneError, match="train.metric 'f1'"):
        validate_finetune(
            {**cfg_for(bundles["bert"], train).model_dump(), "train": {"metric": "f1"}}
        )


def test_task_the_architecture_cannot_do():
    from pipeline.finetune.loop import check_task_fits

    qa = validate_finetune(
        {
            "name": "t",
            "model": {"source": "x"},
            "task": {"type": "span_qa"},
            "data": {"train": "x"},
            "train": {"mode": "features"},
        }
    )
    with pytest.raises(FinetuneError, match="span_qa cannot run on arch 'elmo'"):
        check_task_fits("elmo", qa)


# ----------------------------------------------------------------------------- real engine


def topic_rows(n: int, seed: int) -> list[dict[str, str]]:
    """A tiny two-class task in the bundles' vocabulary: is it about a cat or a dog?"""
    r = random.Random(seed)
    rows = []
    for i in range(n):
        animal = ["cat", "dog"][i % 2]
        words = [r.choice(WORDS) for _ in range(4)]
        words.insert(r.randrange(5), animal)
        rows.append({"text": " ".join(words), "label": animal})
    return rows


@pytest.mark.slow
def test_frozen_mode_leaves_the_encoder_bit_identical(bundles, tmp_path):
    """train.mode=frozen through the real DeepSpeed engine: the head learns, every encoder
    weight in the saved model equals the source bundle's bit for bit."""
    from safetensors.torch import load_file

    from pipeline.finetune.loop import finetune

    train = write_jsonl(tmp_path / "train.jsonl", topic_rows(32, 1))
    valid = write_jsonl(tmp_path / "valid.jsonl", topic_rows(8, 2))
    cfg = validate_finetune(
        {
            "name": "frozen",
            "model": {"source": str(bundles["bert"])},
            "task": {"type": "classification", "max_length": 16},
            "data": {"train": train, "valid": valid},
            "train": {
                "mode": "frozen",
                "epochs": 2,
                "micro_batch_size": 8,
                "lr": 1e-2,
                "out_dir": str(tmp_path / "run"),
            },  # fmt: skip
            "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "register": False},
        }
    )
    res = finetune(cfg)
    assert res.steps == 8
    source = load_file(str(bundles["bert"] / "model.safetensors"))
    tuned = load_file(str(res.model_dir / "backbone" / "model.safetensors"))
    assert source.keys() == tuned.keys()
    for k in source:
        assert torch.equal(source[k], tuned[k]), k
    head = load_file(str(res.model_dir / "head.safetensors"))
    assert head["head.weight"].abs().sum() > 0 and head["head.bias"].abs().sum() > 0


@pytest.mark.slow
def test_zero3_finetune_loads_into_partitions_and_keeps_the_best_on_disk(bundles, tmp_path):
    """Under ZeRO-3 the backbone is built partitioned and filled one gathered parameter at
    a time (each equal to the bundle's tensor); the best weights go to disk as they
    improve, and the saved model (frozen encoder) equals the source bit for bit."""
    import deepspeed
    from safetensors.torch import load_file

    from pipeline.finetune.loop import finetune
    from pipeline.models.bundle import read_tensors

    zero3 = str(Path(__file__).parents[2] / "configs/deepspeed/zero3.json")
    train = write_jsonl(tmp_path / "train.jsonl", topic_rows(32, 1))
    valid = write_jsonl(tmp_path / "valid.jsonl", topic_rows(8, 2))
    cfg = validate_finetune(
        {
            "name": "zero3",
            "model": {"source": str(bundles["bert"])},
            "task": {"type": "classification", "max_length": 16},
            "data": {"train": train, "valid": valid},
            "deepspeed": zero3,
            "train": {
                "mode": "frozen",
                "epochs": 2,
                "micro_batch_size": 8,
                "lr": 1e-2,
                "out_dir": str(tmp_path / "run"),
            },  # fmt: skip
            "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "register": False},
        }
    )
    res = finetune(cfg)  # one gloo rank
    assert res.steps == 8 and not (res.run_dir / "best").exists()  # moved into model/
    source = dict(read_tensors(bundles["bert"]))
    tuned = load_file(str(res.model_dir / "backbone" / "model.safetensors"))
    assert source.keys() == tuned.keys()
    for k in source:
        assert torch.equal(source[k], tuned[k]), k
    assert load_file(str(res.model_dir / "head.safetensors"))["head.weight"].abs().sum() > 0

    from pipeline.train.engine import build_ds_config

    prepared = prepare(cfg, tmp_path / "dl", build_ds_config(cfg, 1))
    params = dict(prepared.backbone.named_parameters())
    assert params and all(hasattr(p, "ds_id") for p in params.values())  # built partitioned
    for name, p in params.items():
        with deepspeed.zero.GatheredParameters([p]):
            assert torch.equal(p.data, source[name]), name
