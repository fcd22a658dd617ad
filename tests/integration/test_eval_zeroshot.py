"""The zero-shot tasks of `plm eval` through lm-evaluation-harness on the transformers export
of a tiny GPT-2, from local files: what lm-eval reports is what our own model computes
(word perplexity from the summed log-likelihoods; multiple-choice accuracy from the
choices' log-likelihoods), and the suite runs them next to the random baseline."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml
from conftest import synthetic_corpus

pytestmark = pytest.mark.slow

CHOICES = ["today", "again", "slowly", "at night"]


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> dict:
    """A gpt2-tiny bundle, its weights nudged towards the corpus by a few steps of plain
    next-token training (so it is not the random baseline), and the task files."""
    import torch

    from pipeline.models.bundle import save_bundle
    from pipeline.models.registry import build_model, resolve_model_config
    from pipeline.prepare.tokenizer import TokenizerSpec, load_tokenizer, train_tokenizer

    root = tmp_path_factory.mktemp("zeroshot")
    (root / "c.txt").write_text(synthetic_corpus())
    tok_dir = train_tokenizer([str(root / "c.txt")], TokenizerSpec(kind="bpe", vocab_size=400),
                              root / "tok")  # fmt: skip
    meta = json.loads((Path(tok_dir) / "tokenizer_meta.json").read_text())
    cfg = resolve_model_config({"arch": "gpt2", "preset": "gpt2-tiny", "dropout": 0.0,
                                "attention_dropout": 0.0}, meta["vocab_size"])  # fmt: skip
    torch.manual_seed(0)
    model = build_model("gpt2", cfg)
    tok, _ = load_tokenizer(tok_dir)
    docs = synthetic_corpus(60, seed=3).split("\n\n")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for doc in docs[:40]:  # 40 steps, one document each
        ids = torch.tensor([tok.encode(doc).ids[:128]])
        logits = model(ids)["logits"][0, :-1, : meta["vocab_size"]]
        loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    bundle = save_bundle(root / "b", "gpt2", cfg, model.state_dict(), tok_dir)
    held = root / "held.jsonl"
    held.write_text("".join(json.dumps({"text": d.split(". ")[0] + "."}) + "\n"
                            for d in docs[40:])[:20000])  # fmt: skip
    choice = root / "choice.jsonl"
    rows = [{"text": d.split(" today")[0].split(" again")[0][:80], "choices": CHOICES,
             "label": i % len(CHOICES)} for i, d in enumerate(docs[40:52])]  # fmt: skip
    choice.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"root": root, "bundle": bundle, "held": held, "choice": choice, "rows": rows}


def _loglik(model, ids: list[int], start: int, vocab: int) -> float:
    """Sum of log p(ids[i] | ids[:i]) for i >= start, by our own model."""
    import torch

    x = torch.tensor([ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(x)["logits"][0, :-1, :vocab].float(), -1)
    return float(logp[start - 1 :].gather(1, x[0, start:, None]).sum())


def test_lm_evals_word_perplexity_is_our_models(gpt2, tmp_path):
    from transformers import AutoTokenizer

    from pipeline.eval import zeroshot
    from pipeline.models.bundle import load_bundle

    got = zeroshot.score("perplexity", "held", str(gpt2["held"]), str(gpt2["bundle"]),
                         "pretrained", 0, tmp_path, 256)  # fmt: skip
    model, cfg = load_bundle(gpt2["bundle"])
    model.eval()
    hf = AutoTokenizer.from_pretrained(tmp_path / "hf")
    total, words = 0.0, 0
    for line in gpt2["held"].read_text().splitlines():
        text = json.loads(line)["text"]
        ids = [hf.bos_token_id, *hf(text, add_special_tokens=False)["input_ids"]]
        total += _loglik(model, ids, 1, cfg["model"]["vocab_size"])
        words += len(re.split(r"\s+", text))
    assert got["word_perplexity"] == pytest.approx(math.exp(-total / words), rel=1e-3)
    assert got["bits_per_byte"] == pytest.approx(math.log2(got["byte_perplexity"]), rel=1e-6)


def test_lm_evals_choice_accuracy_is_our_models_argmax(gpt2, tmp_path):
    from transformers import AutoTokenizer

    from pipeline.eval import zeroshot
    from pipeline.eval.plan import plan_task
    from pipeline.eval.suite import validate_suite
    from pipeline.models.bundle import load_bundle

    suite = validate_suite({"name": "z", "tasks": {"choice": {
        "kind": "choice", "data": {"test": str(gpt2["choice"])}}}})  # fmt: skip
    plan = plan_task("choice", suite.tasks["choice"], suite, tmp_path)
    got = zeroshot.score("choice", "choice", plan.text_file, str(gpt2["bundle"]), "pretrained",
                         0, tmp_path / "s", 256)  # fmt: skip
    model, cfg = load_bundle(gpt2["bundle"])
    model.eval()
    hf = AutoTokenizer.from_pretrained(tmp_path / "s" / "hf")
    right = 0
    for row in gpt2["rows"]:
        ctx = hf(row["text"], add_special_tokens=False)["input_ids"]
        scores = []
        for choice in row["choices"]:
            whole = hf(row["text"] + " " + choice, add_special_tokens=False)["input_ids"]
            scores.append(_loglik(model, whole, len(ctx), cfg["model"]["vocab_size"]))
        right += max(range(len(scores)), key=scores.__getitem__) == row["label"]
    assert got["acc"] == pytest.approx(right / len(gpt2["rows"]))


def test_the_suite_scores_zero_shot_tasks_next_to_random(gpt2, tmp_path, capsys):
    from pipeline.cli import main

    suite = {"name": "zs", "work_dir": str(tmp_path / "w"), "tasks": {
        "held": {"kind": "perplexity", "data": {"test": str(gpt2["held"])}},
        "last": {"kind": "last_word", "data": {"test": str(gpt2["held"])}},
        "choice": {"kind": "choice", "data": {"test": str(gpt2["choice"])}}}}  # fmt: skip
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    store = f"sqlite:///{tmp_path / 'm.db'}"
    code = main(["eval", str(path), "--models", "random", str(gpt2["bundle"]), "--no-ray",
                 "--tracking-uri", store])  # fmt: skip
    assert code == 0
    rows = (tmp_path / "w" / "report" / "table.csv").read_text().splitlines()
    ppl = {r.split(",")[2]: float(r.split(",")[5]) for r in rows
           if ",held,word_perplexity," in r}  # fmt: skip
    assert ppl["pretrained"] < ppl["random"]  # 40 steps of training beat random weights
    assert any(",last,acc," in r for r in rows) and any(",choice,acc_norm," in r for r in rows)
