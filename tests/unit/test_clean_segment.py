import json
from pydoc_data.topics import topics

import jieba
import numpy as np
import pytest

from pipeline.prepare.clean import CleanConfig, clean, dedup_key, language_of, reject_reason
from pipeline.prepare.readers import CORPORA_DIR
from pipeline.prepare.segment import (
    jieba_word_starts,
    process_document,
    process_documents,
    sentence_ends,
)
from pipeline.prepare.tokenizer import TokenizerSpec, load_tokenizer, train_tokenizer

ZH = (CORPORA_DIR / "zh_sample.txt").read_text(encoding="utf-8").split("\n\n")
EN = [clean(topics[k]) for k in sorted(topics)[:25]]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": clean(t)}) + "\n" for t in EN + ZH))
    out = {}
    for kind in ("wordpiece", "bpe", "unigram"):
        spec = TokenizerSpec(kind=kind, vocab_size=3000)
        out[kind] = load_tokenizer(train_tokenizer([str(corpus)], spec, root / kind))[0]
    return out


# -- cleaning ---------------------------------------------------------------------------


def test_clean_normalizes_and_removes_controls():
    raw = "ＡＢＣ１２３\u3000full\u00a0width\x07 bell\u200bzero\ufeff \ud800 end\r\nnext\rline"
    assert clean(raw) == "ABC123 full width bellzero end\nnext\nline"
    assert clean("ﬁ ①") == "fi 1"  # NFKC compatibility forms


def test_clean_folds_whitespace_but_keeps_paragraphs():
    assert clean("  a \t b  \n  c\n\n\n\n\nd  ") == "a b\nc\n\nd"
    assert clean("a\u2029b\x85c") == "a\nb\nc"


def test_clean_joins_hard_line_wraps_inside_chinese_text():
    """A newline between two CJK ideographs is a wrap of the source, not a break: joined
    before segmenting, so jieba keeps the word whole (人身攻击, not 人身 + 攻击)."""
    raw = "他们的评论是人身\n攻击，不是批评。\n下一行\n\n新的段落 \n 继续"
    text = clean(raw)
    assert text == "他们的评论是人身攻击,不是批评。\n下一行\n\n新的段落继续"  # NFKC: ，->,
    starts = jieba_word_starts(text)
    word = text.index("人身攻击")
    assert word in starts and all(s not in starts for s in range(word + 1, word + 4))
    # Everything else keeps its newlines: paragraphs, other scripts, mixed lines.
    assert clean("a\nb\n中文\nEnglish\n字") == "a\nb\n中文\nEnglish\n字"
    assert clean(text) == text  # idempotent


def test_clean_normalization_is_configurable():
    cfg = CleanConfig(normalization="none")
    assert clean("ＡＢ\x00C", cfg) == "ＡＢC"
    assert clean("ＡＢ", CleanConfig(normalization="NFC")) == "ＡＢ"
    with pytest.raises(ValueError):
        CleanConfig(normalization="NFX")
    with pytest.raises(ValueError):
        CleanConfig(min_char=3)  # typo: extra keys are refused


def test_clean_is_idempotent_and_deterministic():
    for text in EN[:5] + ZH[:5]:
        once = clean(text)
        assert clean(once) == once
        assert dedup_key(once) == dedup_key(clean(text))


def test_reject_reason_length_filters():
    cfg = CleanConfig(min_chars=5, max_chars=10)
    assert reject_reason("", cfg) == "too_short"
    assert reject_reason("abcd", cfg) == "too_short"
    assert reject_reason("abcde", cfg) is None
    assert reject_reason("x" * 11, cfg) == "too_long"
    assert reject_reason("", CleanConfig(min_chars=0)) == "too_short"  # empty is never kept


def test_language_of():
    assert all(language_of(clean(t)) == "zh" for t in ZH)
    assert all(language_of(t) == "other" for t in EN)
    assert language_of("我在用 Python 和 PyTorch 写程序。") == "zh"
    assert language_of("The word 中国 appears once in this English sentence.") == "other"
    assert language_of("12345 !!!") == "other"


def test_dedup_key():
    assert len(dedup_key("abc")) == 16
    assert dedup_key("abc") == dedup_key("abc") != dedup_key("abd")
    assert dedup_key(clean("Ａ b\u200b")) == dedup_key(clean("A  b"))


# -- sentences ----------------------------------------------------------------------------


def split(text):
    ends = sentence_ends(text)
    return [text[a:b].strip() for a, b in zip([0] + ends, ends + [len(text)], strict=True)]


def test_english_sentences():
    text = "Hello world. This is a test! Is it? Yes, e.g. this one.\n\nNew paragraph (3.11) ok"
    assert split(text) == [
        "Hello world.",
        "This is a test!",
        "Is it?",
        "Yes, e.g. this one.",
        "New paragraph (3.11) ok",
    ]
    assert split('He said "Stop." Then left.') == ['He said "Stop."', "Then left."]
    assert split("a; b") == ["a; b"]


def test_chinese_sentences_with_closing_quotes():
    text = "我来了。你好吗？他说：“好。”然后走了……真的；是的！"
    assert split(text) == ["我来了。", "你好吗？", "他说：“好。”", "然后走了……", "真的；", "是的！"]
    # NFKC turns ！？ into ASCII and … into "...": still sentence ends before Chinese.
    assert split(clean(text)) == [
        "我来了。",
        "你好吗?",
        "他说:“好。”",
        "然后走了......",
        "真的;",
        "是的!",
    ]


# -- words and pieces ---------------------------------------------------------------------


def groups(array, bounds):
    return [array[a:b] for a, b in zip(bounds, list(bounds[1:]) + [len(array)], strict=True)]


def check_piece(piece, max_len):
    n = piece.n_tokens
    assert 0 < n <= max_len
    assert piece.sents.dtype == np.int32 and piece.words.dtype == np.int32
    assert piece.sents[-1] == n and np.all(np.diff(piece.sents) > 0) and piece.sents[0] > 0
    assert piece.words[0] == 0 and np.all(np.diff(piece.words) > 0) and piece.words[-1] < n
    assert set((0, *piece.sents[:-1])) <= set(piece.words)  # sentence starts are word starts


def test_english_words_follow_the_pre_tokenizer(tokenizers):
    tok = tokenizers["wordpiece"]
    text = EN[3]
    [piece] = process_document(text, "other", tok, 100_000)
    check_piece(piece, 100_000)
    pieces = [tok.id_to_token(int(i)) for i in piece.tokens]
    for word in groups(pieces, piece.words):
        assert not word[0].startswith("##"), word
        assert all(p.startswith("##") for p in word[1:]), word
    assert piece.tokens.tolist() == tok.encode(text, add_special_tokens=False).ids


def test_english_sentences_map_to_tokens(tokenizers):
    text = "Tokenizers are fast. They split words! Really?"
    for kind, tok in tokenizers.items():
        [piece] = process_document(text, "other", tok, 1000)
        decoded = [
            tok.decode(g.tolist()).strip() for g in groups(piece.tokens, [0, *piece.sents[:-1]])
        ]
        assert decoded == ["Tokenizers are fast.", "They split words!", "Really?"], kind


def test_chinese_wordpiece_is_characters_and_jieba_words_map_onto_them(tokenizers):
    tok = tokenizers["wordpiece"]
    text = clean(ZH[0] + ZH[5])
    [piece] = process_document(text, "zh", tok, 100_000)
    check_piece(piece, 100_000)
    chars = [tok.id_to_token(int(i)) for i in piece.tokens]
    assert "".join(chars) == text.replace(" ", "")  # one token per character, no [UNK]
    expected = [w for w in jieba.lcut(text) if not w.isspace()]
    assert ["".join(g) for g in groups(chars, piece.words)] == expected
    assert any(len(g) > 1 for g in groups(chars, piece.words))  # 杭州, 西湖, ...


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_chinese_words_start_at_jieba_boundaries_for_multichar_tokens(tokenizers, kind):
    tok = tokenizers[kind]
    text = clean(ZH[1])
    [piece] = process_document(text, "zh", tok, 100_000)
    check_piece(piece, 100_000)
    enc = tok.encode(text, add_special_tokens=False)
    starts = set(jieba_word_starts(text))
    assert 10 < len(piece.words) <= len(starts)
    for w in piece.words:
        start, end = enc.offsets[w]
        assert start in starts or text[start:end].strip() == "" or start + 1 in starts


def test_long_documents_split_at_sentence_ends(tokenizers):
    tok = tokenizers["bpe"]
    text = " ".join(f"Sentence number {i} is here." for i in range(60))
    [whole] = process_document(text, "other", tok, 100_000)
    pieces = process_document(text, "other", tok, 50)
    assert len(pieces) > 1
    assert np.concatenate([p.tokens for p in pieces]).tolist() == whole.tokens.tolist()
    offset, ends = 0, set(whole.sents.tolist())
    for p in pieces:
        check_piece(p, 50)
        offset += p.n_tokens
        assert offset in ends  # every cut is at a sentence end
        assert tok.decode(p.tokens.tolist()).strip().startswith("Sentence number")


def test_a_sentence_longer_than_the_limit_is_cut_at_word_starts(tokenizers):
    tok = tokenizers["wordpiece"]
    text = "unbelievably " * 40 + "long."
    [whole] = process_document(text, "other", tok, 100_000)
    pieces = process_document(text, "other", tok, 7)
    assert np.concatenate([p.tokens for p in pieces]).tolist() == whole.tokens.tolist()
    offset, words = 0, set(whole.words.tolist())
    for p in pieces:
        check_piece(p, 7)
        assert offset in words
        offset += p.n_tokens


def test_batch_equals_single_and_empty_gives_nothing(tokenizers):
    tok = tokenizers["unigram"]
    texts = [EN[1], clean(ZH[2]), "", EN[2][:500]]
    langs = [language_of(t) for t in texts]
    batch = process_documents(texts, langs, tok, 64)
    assert batch[2] == []
    for text, lang, pieces in zip(texts, langs, batch, strict=True):
        single = process_document(text, lang, tok, 64)
        assert len(single) == len(pieces)
        for a, b in zip(single, pieces, strict=True):
            assert a.tokens.tolist() == b.tokens.tolist()
            assert a.sents.tolist() == b.sents.tolist() and a.words.tolist() == b.words.tolist()


def test_special_tokens_spelled_in_text_are_not_control_tokens(tokenizers):
    for kind, tok in tokenizers.items():
        specials = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        unk = tok.token_to_id("[UNK]" if kind == "wordpiece" else "<unk>")
        text = "Use <s> or [MASK] or <pad> and <|endoftext|> [CLS] [SEP] <eod> here."
        [piece] = process_document(text, "other", tok, 1000)
        assert not (set(piece.tokens.tolist()) & (specials - {unk})), kind


def test_a_unigram_model_lacking_the_characters_cannot_emit_special_ids(tmp_path):
    # Trained on Chinese only: "[", "M", "<", ... are unknown, and the cheapest path
    # through "[MASK]" is the special piece itself; it must come out as unk.
    spec = TokenizerSpec(kind="unigram", vocab_size=1000)
    tok, meta = load_tokenizer(train_tokenizer(["builtin:zh-sample"], spec, tmp_path))
    assert meta["roles"]["mask"] in tok.encode("杭州[MASK]").ids  # what the model alone does
    [piece] = process_document("杭州[MASK]西湖<pad>。", "zh", tok, 100)
    ids = set(piece.tokens.tolist())
    assert meta["roles"]["unk"] in ids
    assert not ids & (set(meta["special_tokens"].values()) - {meta["roles"]["unk"]})


# -- entity spans (ERNIE) ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["wordpiece", "bpe", "unigram"])
def test_entity_spans_cover_exactly_the_mentions(tokenizers, kind):
    from pipeline.prepare.segment import entity_pattern, segment_encoding

    tok = tokenizers[kind]
    pattern = entity_pattern(["Python", "Python Software Foundation", "北京", "北京大学"])
    text = (
        "The Python Software Foundation manages Python. Pythonic code is not a mention. "
        "他在北京大学读书，后来去了北京。"
    )
    enc = tok.encode(text, add_special_tokens=False)
    (piece,) = segment_encoding(text, "zh", enc, 4096, entities=pattern)
    spans = piece.spans
    assert spans.dtype == np.int32 and spans.shape == (4, 2)
    assert (spans[1:, 0] >= spans[:-1, 1]).all()  # ordered, disjoint
    # Decoding each span's characters gives back the mention, longest entity first.
    starts, ends = np.array(enc.offsets).T
    found = [text[starts[a] : ends[b - 1]].strip() for a, b in spans]
    assert found == ["Python Software Foundation", "Python", "北京大学", "北京"]


def test_entity_spans_follow_pieces_and_none_without_a_list(tokenizers):
    from pipeline.prepare.segment import entity_pattern, segment_encoding

    tok = tokenizers["wordpiece"]
    text = " ".join(f"Sentence {i} talks about Python here." for i in range(40))
    enc = tok.encode(text, add_special_tokens=False)
    pieces = segment_encoding(text, "other", enc, 50, entities=entity_pattern(["Python"]))
    assert len(pieces) > 3
    total = sum(len(p.spans) for p in pieces)
    assert total == 40  # sentence cuts never split a mention here
    for p in pieces:
        assert ((p.spans >= 0) & (p.spans <= p.n_tokens)).all()
        for a, b in p.spans:
            assert tok.decode(p.tokens[a:b].tolist()).replace(" ", "").lower() == "python"
    assert all(p.spans is None for p in segment_encoding(text, "other", enc, 50))
