"""Whole-word masking (BERT-wwm) and ALBERT's n-gram masking, measured over many samples:
every piece of a selected word is masked together, for English WordPiece words and for
Chinese jieba words (character tokens), on real prepared data dirs."""

import json

import numpy as np
import pytest

from pipeline.config import ObjectiveSection
from pipeline.data.shards import DataDir
from pipeline.errors import ConfigError
from pipeline.objectives import IGNORE_INDEX, Piece, Unit, build_objective
from pipeline.objectives.mlm import draw_ngrams, ngram_cover, ngram_probabilities, ngram_start_rate


def objective_for(data: DataDir, seq_len: int, **mlm):
    meta = json.loads(data.tokenizer_path.with_name("tokenizer_meta.json").read_text())
    specials = {int(i) for i in meta["special_tokens"].values()}
    cfg = ObjectiveSection(kind="mlm", mlm={"whole_word": True, **mlm})
    return build_objective(cfg, meta["roles"], meta["vocab_size"], seq_len, specials), specials


def check_whole_words(data: DataDir, epochs: int, seq_len: int = 130, **mlm):
    """Mask every document (one window each) ``epochs`` times; assert the whole-word
    property; return (selected words of >= 2 pieces, selected share of words, selected
    word run lengths)."""
    obj, specials = objective_for(data, seq_len, **mlm)
    multi = n_words = n_selected = 0
    runs = []
    for d, doc in enumerate(data.iter_split("train")):
        n = min(doc.n_tokens, seq_len - 2)
        unit = Unit(key=(d, 0), pieces=(Piece(d, 0, n),))
        starts = doc.words[doc.words < n]
        word = np.cumsum(np.isin(np.arange(n), starts)) - 1
        special = np.isin(doc.tokens[:n], list(specials))
        real = ~special  # [UNK] inside a word is never a label
        pieces = np.bincount(word[real], minlength=int(word[-1]) + 1)
        for epoch in range(epochs):
            ex = obj.make_example(unit, [doc], np.random.default_rng([epoch, d]))
            sel = ex["mlm_labels"][1 : n + 1] != IGNORE_INDEX
            assert not sel[special].any()
            labelled = np.bincount(word[real], weights=sel[real], minlength=pieces.shape[0])
            # THE property: a word's pieces are all labelled or none is
            partial = (labelled > 0) & (labelled < pieces)
            assert not partial.any(), (doc.key, np.flatnonzero(partial))
            chosen = (labelled == pieces)[pieces > 0]
            n_words += chosen.shape[0]
            n_selected += int(chosen.sum())
            multi += int((chosen & (pieces[pieces > 0] >= 2)).sum())
            runs += [len(r) for r in "".join("x" if c else " " for c in chosen).split()]
    return multi, n_selected / n_words, runs


def test_whole_word_masking_on_wordpiece_words(tiny_data):
    data = DataDir(tiny_data)
    multi, share, _ = check_whole_words(data, epochs=5)
    assert multi > 200  # words of several WordPieces really were masked (and whole)
    assert abs(share - 0.15) < 0.02  # probability = share of words selected


@pytest.fixture(scope="module")
def zh_data(tmp_path_factory):
    """builtin:zh-sample through the real tokenizer trainer (WordPiece: one token per
    Chinese character) and the real `plm data prepare` (jieba words into words.npy)."""
    from pipeline.prepare.config import PrepareConfig
    from pipeline.prepare.prepare import run_prepare
    from pipeline.prepare.tokenizer import TokenizerSpec, train_tokenizer

    root = tmp_path_factory.mktemp("zh")
    tok = train_tokenizer(
        ["builtin:zh-sample"], TokenizerSpec(kind="wordpiece", vocab_size=3000), root / "tok"
    )
    cfg = PrepareConfig(
        inputs=["builtin:zh-sample"], tokenizer=str(tok), output=str(root / "data"),
        valid_fraction=0.0, shard_docs=64, max_doc_tokens=128, num_cpus=1,
    )  # fmt: skip
    return DataDir(run_prepare(cfg))


@pytest.mark.slow  # a real tokenizer training and prepare (a local Ray job)
def test_chinese_whole_word_masking_masks_whole_jieba_words(zh_data):
    from tokenizers import Tokenizer

    from pipeline.prepare.segment import jieba_word_starts

    tok = Tokenizer.from_file(str(zh_data.tokenizer_path))
    docs = list(zh_data.iter_split("train"))
    assert len(docs) >= 20
    # Chinese BERT tokenizes to characters; words.npy holds jieba's words, not characters
    doc = next(d for d in docs if 1 not in d.tokens.tolist())  # one without [UNK]
    chars = [tok.id_to_token(int(t)) for t in doc.tokens]
    assert all(len(c) == 1 for c in chars)
    text = "".join(chars)
    assert doc.words.tolist() == jieba_word_starts(text)[: len(doc.words)]
    assert len(doc.words) < 0.8 * doc.n_tokens  # many words of two or more characters

    multi, share, _ = check_whole_words(zh_data, epochs=20)
    assert multi > 300  # multi-character words masked as a whole, many times
    assert abs(share - 0.15) < 0.03


def test_ngram_lengths_follow_one_over_n_and_cover_the_probability():
    rng = np.random.default_rng(0)
    rate = ngram_start_rate(0.15, 3)
    lengths = draw_ngrams(rng, 400_000, rate, 3)
    started = lengths[lengths > 0]
    hist = np.bincount(started, minlength=4)[1:] / started.shape[0]
    np.testing.assert_allclose(hist, ngram_probabilities(3), atol=0.01)
    np.testing.assert_allclose(ngram_probabilities(3), np.array([6, 3, 2]) / 11)
    assert abs(ngram_cover(lengths).mean() - 0.15) < 0.003
    assert ngram_cover(np.array([0, 3, 0, 0, 0, 2, 0, 1])).tolist() == [
        False, True, True, True, False, True, True, True,
    ]  # fmt: skip


def test_ngram_masking_masks_runs_of_whole_words(tiny_data):
    data = DataDir(tiny_data)
    _, share_1, runs_1 = check_whole_words(data, epochs=4)
    _, share_3, runs_3 = check_whole_words(data, epochs=4, ngram=3)  # asserts whole words too
    assert abs(share_3 - 0.15) < 0.02  # same budget ...
    long_1 = np.mean(np.array(runs_1) >= 2)
    long_3 = np.mean(np.array(runs_3) >= 2)
    assert long_3 > long_1 + 0.2  # ... spent on spans of consecutive words


def test_ngram_needs_whole_word():
    roles = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    with pytest.raises(ConfigError, match=r"objective.mlm.ngram=3.*whole_word=true"):
        build_objective(ObjectiveSection(kind="mlm", mlm={"ngram": 3}), roles, 100, 32)
