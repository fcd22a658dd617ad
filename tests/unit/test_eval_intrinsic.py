"""The intrinsic tasks of `plm eval` (word similarity, analogies) on the static vectors of
word2vec and ELMo: the files as distributed are read (headers, tabs, SimLex-999's score
field), a bad line is one `plm:` line, and the scores are a hand computation's (Spearman
by scipy, the analogy's answer planted in the vectors)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from tokenizers import Tokenizer

from pipeline.cli import main
from pipeline.eval import intrinsic
from pipeline.eval.suite import EvalError, validate_suite

WORDS = ["king", "queen", "man", "woman", "cat", "dog", "tree", "river", "book", "city"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    from pipeline.prepare.tokenizer import TokenizerSpec, train_tokenizer

    root = tmp_path_factory.mktemp("intrinsic")
    (root / "c.txt").write_text(("the " + " and the ".join(WORDS) + ".\n") * 50)
    return Path(train_tokenizer([str(root / "c.txt")], TokenizerSpec(kind="wordpiece",
                                vocab_size=120), root / "tok"))  # fmt: skip


def _ids(tok_dir: Path) -> dict[str, int]:
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    ids = {w: tok.token_to_id(w) for w in WORDS}
    assert None not in ids.values(), ids  # every test word is one token
    return ids


@pytest.fixture(scope="module")
def w2v(tok_dir, tmp_path_factory) -> Path:
    """A word2vec bundle with the analogy planted: queen = king - man + woman exactly."""
    from pipeline.models.bundle import save_bundle
    from pipeline.models.registry import build_model, resolve_model_config

    meta = json.loads((tok_dir / "tokenizer_meta.json").read_text())
    cfg = resolve_model_config({"arch": "word2vec", "preset": "word2vec-tiny"},
                               meta["vocab_size"])  # fmt: skip
    torch.manual_seed(0)
    model = build_model("word2vec", cfg)
    ids = _ids(tok_dir)
    with torch.no_grad():
        w = model.input_embeddings.weight
        w.normal_()
        w[ids["queen"]] = w[ids["king"]] - w[ids["man"]] + w[ids["woman"]]
        model.counts[: meta["vocab_size"]] = 1.0
    out = tmp_path_factory.mktemp("w2v") / "bundle"
    return save_bundle(out, "word2vec", model.config, model.state_dict(), tok_dir)


PAIRS = [("king", "queen", 8.5), ("cat", "dog", 7.0), ("tree", "river", 3.1),
         ("book", "city", 1.2), ("man", "woman", 8.0), ("dog", "book", 0.5)]  # fmt: skip


def simlex(path: Path) -> Path:
    """SimLex-999's layout: tab-separated, a header, the score in field 3 (0-based)."""
    lines = ["word1\tword2\tPOS\tSimLex999\tconc(w1)"]
    lines += [f"{a}\t{b}\tN\t{s}\t4.5" for a, b, s in PAIRS]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_similarity_is_spearman_of_the_cosines_by_hand(w2v, tmp_path):
    from scipy.stats import spearmanr

    from pipeline.models.bundle import load_bundle

    rows = intrinsic.read_similarity(str(simlex(tmp_path / "SimLex-999.txt")), 3, "sim")
    assert [(r["a"], r["b"], r["score"]) for r in rows] == PAIRS  # the header skipped
    rows_file = intrinsic.write_rows(rows, tmp_path / "rows.jsonl")
    got = intrinsic.score("similarity", rows_file, str(w2v), "pretrained", 0)

    model, _ = load_bundle(w2v)
    ids, v = _ids(w2v), model.input_embeddings.weight.detach()
    cos = [float(torch.cosine_similarity(v[ids[a]], v[ids[b]], dim=0)) for a, b, _ in PAIRS]
    assert got["spearman"] == pytest.approx(spearmanr(cos, [s for *_, s in PAIRS])[0], abs=1e-9)
    assert got["coverage"] == 1.0


def test_the_planted_analogy_is_answered_and_an_unanswerable_one_counted(w2v, tmp_path):
    path = tmp_path / "questions-words.txt"
    path.write_text(": gender\nman woman king queen\n: mixed\nman woman king zyzzyvas\n")
    rows = intrinsic.read_analogies(str(path), "ana")
    assert [r["section"] for r in rows] == ["gender", "mixed"]
    rows_file = intrinsic.write_rows(rows, tmp_path / "rows.jsonl")
    got = intrinsic.score("analogy", rows_file, str(w2v), "pretrained", 0)
    # "zyzzyvas" is split into pieces: no single token can be the answer
    assert got == {"acc": 1.0, "acc_mul": 1.0, "coverage": 0.5}
    fresh = intrinsic.score("analogy", rows_file, str(w2v), "random", 0)
    assert fresh["coverage"] == 0.5 and fresh["acc"] == 0.0  # nothing planted


def test_elmo_layer_zero_vectors_are_scored(tok_dir, tmp_path):
    from pipeline.models.bundle import save_bundle
    from pipeline.models.elmo import build_char_table
    from pipeline.models.registry import build_model, resolve_model_config

    meta = json.loads((tok_dir / "tokenizer_meta.json").read_text())
    cfg = resolve_model_config({"arch": "elmo", "preset": "elmo-tiny"}, meta["vocab_size"])
    torch.manual_seed(0)
    model = build_model("elmo", cfg)
    model.set_char_table(build_char_table(tok_dir, cfg))
    bundle = save_bundle(tmp_path / "elmo", "elmo", cfg, model.state_dict(), tok_dir)
    rows = intrinsic.read_similarity(str(simlex(tmp_path / "s.txt")), 3, "sim")
    got = intrinsic.score("similarity", intrinsic.write_rows(rows, tmp_path / "r.jsonl"),
                          str(bundle), "pretrained", 0)  # fmt: skip
    assert got["coverage"] == 1.0 and -1.0 <= got["spearman"] <= 1.0
    random = intrinsic.score("similarity", str(tmp_path / "r.jsonl"), str(bundle), "random", 1)
    assert random["spearman"] != got["spearman"]  # fresh weights, the same char table


@pytest.mark.parametrize(
    ("text", "field", "message"),
    [
        ("a b 1\nc d x\n", 2, "line 2: 'x' is not a number"),  # not the header: line 2
        ("a b\n", 2, "line 1: 2 field(s)"),
        ("w1 w2 s\na b 1\n", 2, "1 pair(s)"),
    ],
)
def test_a_bad_similarity_line_names_the_file_and_line(tmp_path, text, field, message):
    path = tmp_path / "pairs.txt"
    path.write_text(text)
    with pytest.raises(EvalError, match=re.escape(message)) as err:
        intrinsic.read_similarity(str(path), field, "sim")
    assert str(path) in str(err.value)


def test_a_question_of_three_words_names_its_line(tmp_path):
    path = tmp_path / "q.txt"
    path.write_text(": s\na b c d\na b c\n")
    with pytest.raises(EvalError, match=r"q.txt line 3: 3 word\(s\)"):
        intrinsic.read_analogies(str(path), "ana")


def write_suite(tmp_path: Path, tasks: dict) -> str:
    raw = {"name": "intrinsic", "tasks": tasks, "work_dir": str(tmp_path / "work"),
           "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}}  # fmt: skip
    validate_suite(raw)
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(raw))
    return str(tmp_path / "suite.yaml")


@pytest.mark.slow  # an MLflow store
def test_plm_eval_scores_the_bundle_beside_random(w2v, tmp_path, capsys):
    (tmp_path / "q.txt").write_text(": gender\nman woman king queen\n")
    suite = write_suite(tmp_path, {
        "sim": {"kind": "similarity", "score_field": 3,
                "data": {"test": str(simlex(tmp_path / "SimLex-999.txt"))}},
        "ana": {"kind": "analogy", "data": {"test": str(tmp_path / "q.txt")}},
    })  # fmt: skip
    assert main(["eval", suite, "--models", "random", str(w2v), "--no-ray"]) == 0
    table = (tmp_path / "work" / "report" / "table.csv").read_text()
    rows = [line.split(",") for line in table.splitlines()]
    header = rows[0]
    got = {(r[header.index("model")], r[header.index("task")], r[header.index("metric")]):
           float(r[header.index("mean")]) for r in rows[1:]}  # fmt: skip
    trained = next(m for m, _, _ in got if m != "random")
    assert got[(trained, "ana", "acc")] == 1.0 and got[("random", "ana", "acc")] == 0.0
    assert ("random", "sim", "spearman") in got and (trained, "sim", "coverage") in got


def test_an_intrinsic_task_on_an_encoder_or_a_file_it_cannot_score_is_one_line(
    w2v, tmp_path, capsys
):
    from pipeline.models.bundle import save_bundle
    from pipeline.models.registry import build_model, resolve_model_config

    meta = json.loads((w2v / "tokenizer_meta.json").read_text())
    cfg = resolve_model_config({"arch": "bert", "preset": "bert-tiny"}, meta["vocab_size"])
    bert = save_bundle(tmp_path / "bert", "bert", cfg, build_model("bert", cfg).state_dict(), w2v)
    (tmp_path / "q.txt").write_text("man woman king queen\n")
    suite = write_suite(tmp_path, {"ana": {"kind": "analogy",
                                           "data": {"test": str(tmp_path / "q.txt")}}})  # fmt: skip
    assert main(["eval", suite, "--models", str(bert), "--no-ray"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("plm: ") and "'bert'" in err and "word2vec" in err, err

    (tmp_path / "q.txt").write_text("man woman king zyzzyvas\n")
    assert main(["eval", suite, "--models", str(w2v), "--no-ray"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("plm: ") and "scores 0 of the 1 rows" in err, err


def test_a_key_value_after_the_sources_is_an_override_not_a_source(w2v, tmp_path, capsys):
    """`plm eval SUITE --models A key=value`: argparse hands key=value to --models; it is
    the suite's override (here a typo, reported as the command line's), not a source."""
    (tmp_path / "q.txt").write_text(": gender\nman woman king queen\n")
    suite = write_suite(tmp_path, {"ana": {"kind": "analogy",
                                           "data": {"test": str(tmp_path / "q.txt")}}})  # fmt: skip
    assert main(["eval", suite, "--models", str(w2v), "wrok_dir=/tmp/x", "--no-ray"]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'wrok_dir'" in err and "on the command line" in err, err
    assert "wrok_dir=/tmp/x" not in err.split("unknown key")[0], err  # not named a source
