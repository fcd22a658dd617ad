"""ERNIE knowledge masking: whole entities and phrases are masked together, units follow
the stages of training, and about the same share of tokens is masked in every stage."""

import numpy as np
import pytest

from pipeline.config import ObjectiveSection
from pipeline.data.shards import Document
from pipeline.errors import ConfigError
from pipeline.objectives import Piece, Unit, build_objective
from pipeline.objectives.ernie import phrase_starts, unit_starts

ROLES = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
V, SEQ = 200, 64


def document(seed: int, language: str, n: int = 60) -> Document:
    """Random words of 1-3 tokens, sentences of a few words, entity spans over words."""
    rng = np.random.default_rng(seed)
    words = np.cumsum(np.concatenate([[0], rng.integers(1, 4, 40)]))
    words = words[words < n].astype(np.int32)
    sents = np.append(words[rng.choice(np.arange(1, len(words)), 4, replace=False)], n)
    sents = np.unique(sents).astype(np.int32)
    k = len(words) - 1
    firsts = np.sort(rng.choice(np.arange(k - 3), 4, replace=False))
    spans = np.array(
        [[words[i], words[i + rng.integers(1, 3)]] for i in firsts[::2]], dtype=np.int32
    )  # two non-overlapping entity mentions of 1-2 words
    return Document(
        key=f"d{seed}",
        tokens=rng.integers(5, V, n).astype(np.uint16),
        sents=sents,
        words=words,
        meta={"language": language},
        spans=spans,
    )


def objective(**ernie):
    cfg = ObjectiveSection(kind="ernie", ernie={"nsp": False, **ernie})
    obj = build_objective(cfg, ROLES, V, SEQ)
    obj.total_batches = 10
    return obj


def examples(obj, language: str, position: int | None, n: int = 300):
    """(doc, selected [n_tokens] bool) of n examples, each from its own generator."""
    for seed in range(n):
        doc = document(seed, language)
        unit = Unit(key=(seed, 0), pieces=(Piece(seed, 0, doc.n_tokens),))
        ex = obj.make_example(unit, [doc], np.random.default_rng([seed, 99]), position=position)
        yield doc, ex["mlm_labels"][1 : 1 + doc.n_tokens] >= 0  # [CLS] doc [SEP]


def all_or_none(selected: np.ndarray, start: int, stop: int) -> bool:
    part = selected[start:stop]
    return bool(part.all() or not part.any())


def word_ranges(doc: Document):
    ends = np.append(doc.words[1:], doc.n_tokens)
    return list(zip(doc.words.tolist(), ends.tolist(), strict=True))


def test_entity_stage_masks_whole_entity_spans():
    obj = objective()
    hits = 0
    for doc, selected in examples(obj, "other", position=9):  # 9/10: the entity stage
        for s, e in doc.spans.tolist():
            assert all_or_none(selected, s, e), (doc.key, s, e, selected[s:e])
            hits += int(selected[s:e].all())
        for s, e in word_ranges(doc):  # and never half a word elsewhere
            assert all_or_none(selected, s, e)
    assert hits > 30  # entities really get masked


def test_phrase_stage_masks_whole_multi_word_phrases():
    obj = objective(phrase_max_words=3)
    multi = 0
    for seed, (doc, selected) in enumerate(examples(obj, "other", position=5)):
        # the same generator state the objective used gives the same phrase units
        rows = obj.new_rows(1)
        obj.masking = "phrase"
        unit = Unit(key=(seed, 0), pieces=(Piece(seed, 0, doc.n_tokens),))
        obj.fill(rows, 0, unit, [doc], np.random.default_rng([seed, 99]))
        starts = np.flatnonzero(rows.word_start[0, 1 : 1 + doc.n_tokens])
        ends = np.append(starts[1:], doc.n_tokens)
        for s, e in zip(starts, ends, strict=True):
            assert all_or_none(selected, s, e), (doc.key, s, e)
            n_words = int(np.isin(doc.words, np.arange(s, e)).sum())
            assert 1 <= n_words <= 3
            multi += int(selected[s:e].all() and n_words >= 2)
    assert multi > 30


def test_chinese_basic_is_characters_and_phrase_is_jieba_words():
    basic, phrase = objective(), objective()
    split_words = 0
    for doc, selected in examples(basic, "zh", position=0):
        split_words += sum(not all_or_none(selected, s, e) for s, e in word_ranges(doc))
    assert split_words > 30  # basic units are single characters: words get cut
    for doc, selected in examples(phrase, "zh", position=5):
        for s, e in word_ranges(doc):
            assert all_or_none(selected, s, e)


@pytest.mark.parametrize("position", [0, 5, 9])
def test_every_stage_masks_about_fifteen_percent(position):
    obj = objective()
    rates = [selected.mean() for _, selected in examples(obj, "other", position, n=200)]
    assert 0.11 < float(np.mean(rates)) < 0.19


def test_stages_follow_training_progress():
    obj = objective()
    assert [obj.stage_at(p) for p in (0, 3, 4, 6, 7, 9, 12, None)] == [
        "basic", "basic", "phrase", "phrase", "entity", "entity", "entity", "entity",
    ]  # fmt: skip
    obj.total_batches = None
    with pytest.raises(RuntimeError, match="total_batches"):
        obj.stage_at(0)
    bad = [{"masking": "phrase", "until": 0.6}, {"masking": "entity", "until": 0.5}]
    with pytest.raises(ConfigError, match="objective.ernie.stages"):
        objective(stages=bad)


def test_overlapping_entities_merge_and_phrases_stay_in_sentences():
    doc = document(0, "other")
    doc.spans = np.array([[2, 6], [4, 9]], dtype=np.int32)
    starts = unit_starts(doc, 0, doc.n_tokens, "entity", np.random.default_rng(0), 3)
    assert starts[2] and not starts[3:9].any() and starts[9]
    words = np.arange(0, 20, 2)
    got = phrase_starts(words, np.array([0, 6]), np.random.default_rng(1), 3)
    assert 6 in got and set(got) <= set(words)  # a sentence start always starts a phrase


def test_nsp_variant_builds_pairs():
    cfg = ObjectiveSection(kind="ernie")
    obj = build_objective(cfg, ROLES, V, SEQ)
    obj.total_batches = 10
    doc = document(3, "other")
    unit = Unit(key=(0, 0), pieces=(Piece(0, 0, doc.n_tokens),))
    ex = obj.make_example(unit, [doc], np.random.default_rng(0), position=9)
    assert ex["nsp_labels"] == 0 and ex["token_type_ids"].max() == 1
