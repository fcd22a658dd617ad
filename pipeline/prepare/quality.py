"""Quality filters of `plm data prepare`: the data config's ``filters`` list.

Four filters, each with the thresholds its paper published as defaults (every one can
be overridden in the config):

- ``gopher_repetition`` (Rae et al. 2021, Gopher, table A1), document level: too many
  repeated lines or paragraphs, a word n-gram (2-4) that covers too many characters, or
  too many characters inside repeated n-grams (5-10).
- ``gopher_quality`` (same paper), document level: word count, mean word length, "#"
  and ellipses per word, bullet lines, lines ending in an ellipsis, words without a
  letter, English stop words.
- ``c4`` (Raffel et al. 2020, T5), line level then document level: lines without
  terminal punctuation, with fewer than 5 words, a word over 1,000 characters,
  "javascript" or a cookie/terms/privacy policy phrase are dropped from the document;
  a document holding "lorem ipsum" or a curly brace, or left with fewer than 3
  sentences, is rejected.
- ``fineweb`` (Penedo et al. 2024, FineWeb), document level over line statistics: too
  few lines ending in punctuation, too many characters in repeated lines, too many
  short lines, too many lines per word (a list).

Each filter applies to the languages in its ``languages`` list (codes from
``langid``; ``"*"`` is every language). The papers built English corpora, so every
default is ``[en]``: Chinese text, which has no spaces between words, is never judged
by word counts made for English. A filter says which documents it skipped for their
language (``FilterResult.skipped``; the manifest's ``filter_language_skips``).

``run_filters`` returns the final text (C4 may have dropped lines), or the name of the
filter that rejected the document and the rule inside it, plus the lines removed per
rule. Pure and deterministic: the same text and config give the same answer anywhere.
"""

from __future__ import annotations

import string
from collections import Counter
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

ALL_LANGUAGES = "*"
NgramSize = Annotated[int, Field(ge=1, le=64)]
Share = Annotated[float, Field(ge=0, le=1)]


class _Filter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    languages: list[str] = Field(default_factory=lambda: ["en"], min_length=1)

    def applies_to(self, language: str) -> bool:
        return ALL_LANGUAGES in self.languages or language in self.languages


class GopherRepetition(_Filter):
    name: Literal["gopher_repetition"] = "gopher_repetition"
    max_duplicate_line_fraction: float = Field(0.30, ge=0, le=1)
    max_duplicate_paragraph_fraction: float = Field(0.30, ge=0, le=1)
    max_duplicate_line_char_fraction: float = Field(0.20, ge=0, le=1)
    max_duplicate_paragraph_char_fraction: float = Field(0.20, ge=0, le=1)
    # n -> the most a single n-gram (its characters times its count) may cover.
    max_top_ngram_char_fraction: dict[NgramSize, Share] = Field(
        default_factory=lambda: {2: 0.20, 3: 0.18, 4: 0.16}
    )
    # n -> the most all repeated n-grams together may cover (each word counted once).
    max_duplicate_ngram_char_fraction: dict[NgramSize, Share] = Field(
        default_factory=lambda: {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10}
    )


class GopherQuality(_Filter):
    name: Literal["gopher_quality"] = "gopher_quality"
    min_words: int = Field(50, ge=0)
    max_words: int = Field(100_000, gt=0)
    min_mean_word_length: float = Field(3.0, ge=0)
    max_mean_word_length: float = Field(10.0, gt=0)
    max_symbol_word_ratio: float = Field(0.1, ge=0)  # "#" and ellipses per word
    max_bullet_line_fraction: float = Field(0.9, ge=0, le=1)
    max_ellipsis_line_fraction: float = Field(0.3, ge=0, le=1)
    min_alphabetic_word_fraction: float = Field(0.8, ge=0, le=1)
    min_stop_words: int = Field(2, ge=0)
    stop_words: list[str] = Field(
        default_factory=lambda: ["the", "be", "to", "of", "and", "that", "have", "with"]
    )


class C4(_Filter):
    name: Literal["c4"] = "c4"
    min_words_per_line: int = Field(5, ge=0)
    max_word_length: int = Field(1000, gt=0)
    min_sentences: int = Field(3, ge=0)
    terminal_punctuation: bool = True  # drop lines that do not end in . ! ? or a quote
    javascript: bool = True  # drop lines that mention javascript
    policy_phrases: list[str] = Field(
        default_factory=lambda: [
            "terms of use",
            "privacy policy",
            "cookie policy",
            "uses cookies",
            "use of cookies",
            "use cookies",
        ]
    )
    lorem_ipsum: bool = True  # reject documents holding "lorem ipsum"
    curly_brace: bool = True  # reject documents holding "{" (code, templates)


class FineWeb(_Filter):
    name: Literal["fineweb"] = "fineweb"
    min_punctuated_line_fraction: float = Field(0.12, ge=0, le=1)
    max_duplicate_line_char_fraction: float = Field(0.10, ge=0, le=1)
    short_line_chars: int = Field(30, gt=0)
    max_short_line_fraction: float = Field(0.67, ge=0, le=1)
    max_newlines_per_word: float = Field(0.3, ge=0)


FilterConfig = Annotated[
    GopherRepetition | GopherQuality | C4 | FineWeb, Field(discriminator="name")
]
FILTER_NAMES = ("gopher_repetition", "gopher_quality", "c4", "fineweb")

# Presets: a name in the config's ``filters`` stands for this list at the defaults.
PRESETS: dict[str, list[str]] = {"web": ["gopher_repetition", "gopher_quality", "c4", "fineweb"]}
# ... and for these kept languages when the config names none (``languages``): the web
# rules are English rules, and FineWeb keeps English before it filters. A page in another
# language would pass every filter unjudged (lorem ipsum is Latin to language ID).
PRESET_LANGUAGES: dict[str, list[str]] = {"web": ["en"]}


def expand_filters(value: object) -> object:
    """The config's ``filters`` as a list of filter configs: a preset name becomes its
    filters, a bare filter name becomes ``{"name": name}``; the rest pydantic validates."""
    if isinstance(value, str):
        if value not in PRESETS:
            raise ValueError(
                f"unknown filter preset {value!r}: use one of {sorted(PRESETS)} or a list of "
                f"filters ({', '.join(FILTER_NAMES)})"
            )
        value = PRESETS[value]
    if isinstance(value, list):
        return [{"name": item} if isinstance(item, str) else item for item in value]
    return value


@dataclass
class FilterResult:
    """What ``run_filters`` decides about one document."""

    text: str | None  # the final text; None when rejected
    reason: str | None = None  # the filter that rejected it
    rule: str | None = None  # the rule of that filter
    lines_removed: Counter = field(default_factory=Counter)  # "filter.rule" -> lines
    # The filters that did not judge the document: its language is not in their
    # ``languages`` (those reached: a reject ends the list).
    skipped: list[str] = field(default_factory=list)


def run_filters(text: str, language: str, filters: list) -> FilterResult:
    """Apply ``filters`` in order to ``text`` (of ``language``); see the module doc."""
    removed: Counter = Counter()
    skipped: list[str] = []
    for spec in filters:
        if not spec.applies_to(language):
            skipped.append(spec.name)
            continue
        if isinstance(spec, C4):
            text, rule = _c4(text, spec, removed)
        else:
            rule = _CHECKS[type(spec)](text, spec)
        if rule is not None:
            return FilterResult(None, spec.name, rule, removed, skipped)
    return FilterResult(text, lines_removed=removed, skipped=skipped)


# ---------------------------------------------------------------------------
# Shared measures


def _lines(text: str) -> list[str]:
    return [line for line in (raw.strip() for raw in text.split("\n")) if line]


def _paragraphs(text: str) -> list[str]:
    return [para for para in (raw.strip() for raw in text.split("\n\n")) if para]


def _duplicates(items: list[str]) -> tuple[int, int]:
    """(how many items repeat an earlier one, their characters)."""
    seen: set[str] = set()
    count = chars = 0
    for item in items:
        if item in seen:
            count += 1
            chars += len(item)
        else:
            seen.add(item)
    return count, chars


_PUNCTUATION = string.punctuation + "“”‘’«»…—–·"


def _words(text: str) -> list[str]:
    """Blank-separated words with punctuation stripped from both ends; pure punctuation
    is not a word."""
    return [w for w in (raw.strip(_PUNCTUATION) for raw in text.split()) if w]


# ---------------------------------------------------------------------------
# Gopher repetition


def _top_ngram_share(words: list[str], n: int, total_chars: int) -> float:
    """Characters of the most frequent n-gram times its count, over all word characters
    (ties: the longest n-gram, so the answer never depends on hash order)."""
    counts = Counter(zip(*(words[i:] for i in range(n)), strict=False))
    if not counts:
        return 0.0
    best = max(counts.values())
    if best < 2:
        return 0.0
    longest = max(sum(map(len, gram)) for gram, c in counts.items() if c == best)
    return longest * best / total_chars


def _duplicate_ngram_share(words: list[str], n: int, total_chars: int) -> float:
    """Characters of the words inside any n-gram that occurs more than once (each word
    counted once), over all word characters."""
    grams = list(zip(*(words[i:] for i in range(n)), strict=False))
    counts = Counter(grams)
    covered = bytearray(len(words))
    for i, gram in enumerate(grams):
        if counts[gram] > 1:
            covered[i : i + n] = b"\x01" * n
    return sum(len(w) for w, c in zip(words, covered, strict=True) if c) / total_chars


def _gopher_repetition(text: str, spec: GopherRepetition) -> str | None:
    lines = _lines(text)
    if lines:
        count, chars = _duplicates(lines)
        if count / len(lines) > spec.max_duplicate_line_fraction:
            return "duplicate_lines"
        if chars / len(text) > spec.max_duplicate_line_char_fraction:
            return "duplicate_line_chars"
    paragraphs = _paragraphs(text)
    if paragraphs:
        count, chars = _duplicates(paragraphs)
        if count / len(paragraphs) > spec.max_duplicate_paragraph_fraction:
            return "duplicate_paragraphs"
        if chars / len(text) > spec.max_duplicate_paragraph_char_fraction:
            return "duplicate_paragraph_chars"
    words = text.split()
    total = sum(map(len, words))
    if not total:
        return None
    for n, limit in sorted(spec.max_top_ngram_char_fraction.items()):
        if _top_ngram_share(words, n, total) > limit:
            return f"top_{n}gram"
    limits = sorted(spec.max_duplicate_ngram_char_fraction.items())
    lowest = min((limit for _, limit in limits), default=1.0)
    for n, limit in limits:
        share = _duplicate_ngram_share(words, n, total)
        if share > limit:
            return f"duplicate_{n}grams"
        # Words inside a repeated (n+1)-gram are inside a repeated n-gram: the shares
        # only shrink as n grows, so under the lowest limit no larger n can fail.
        if share <= lowest:
            break
    return None


# ---------------------------------------------------------------------------
# Gopher quality

_BULLETS = ("•", "‣", "◦", "⁃", "▪", "●", "-", "*")


def _gopher_quality(text: str, spec: GopherQuality) -> str | None:
    words = _words(text)
    if len(words) < spec.min_words:
        return "too_few_words"
    if len(words) > spec.max_words:
        return "too_many_words"
    if words:
        mean = sum(map(len, words)) / len(words)
        if mean < spec.min_mean_word_length:
            return "short_words"
        if mean > spec.max_mean_word_length:
            return "long_words"
        symbols = text.count("#") + text.count("...") + text.count("…")
        if symbols / len(words) > spec.max_symbol_word_ratio:
            return "symbols"
    lines = _lines(text)
    if lines:
        bullets = sum(line.startswith(_BULLETS) for line in lines)
        if bullets / len(lines) > spec.max_bullet_line_fraction:
            return "bullet_lines"
        ellipses = sum(line.endswith(("...", "…")) for line in lines)
        if ellipses / len(lines) > spec.max_ellipsis_line_fraction:
            return "ellipsis_lines"
    tokens = text.split()
    if tokens:
        alphabetic = sum(any(ch.isalpha() for ch in token) for token in tokens)
        if alphabetic / len(tokens) < spec.min_alphabetic_word_fraction:
            return "non_alphabetic_words"
    stop = set(spec.stop_words)
    if sum(word.lower() in stop for word in words) < spec.min_stop_words:
        return "stop_words"
    return None


# ---------------------------------------------------------------------------
# C4

_TERMINAL = (".", "!", "?", '"', "”", "’", "'")
_SENTENCE_END = frozenset(".!?")


def _count_sentences(text: str) -> int:
    """Runs of . ! ? followed by a blank or the end: a sentence each (a plain rule, the
    same on every machine; C4 used a sentence tokenizer)."""
    count = 0
    n = len(text)
    for i, ch in enumerate(text):
        if ch in _SENTENCE_END and (i + 1 == n or text[i + 1].isspace()):
            count += 1
    return count


def _c4_line_rule(line: str, spec: C4) -> str | None:
    words = line.split()
    if any(len(word) > spec.max_word_length for word in words):
        return "long_word"
    lowered = line.lower()
    if spec.javascript and "javascript" in lowered:
        return "javascript"
    if any(phrase in lowered for phrase in spec.policy_phrases):
        return "policy"
    if spec.terminal_punctuation and (not line.endswith(_TERMINAL) or line.endswith(("...", "…"))):
        return "no_terminal_punctuation"
    if len(words) < spec.min_words_per_line:
        return "too_few_words"
    return None


def _c4(text: str, spec: C4, removed: Counter) -> tuple[str, str | None]:
    lowered = text.lower()
    if spec.lorem_ipsum and "lorem ipsum" in lowered:
        return text, "lorem_ipsum"
    if spec.curly_brace and "{" in text:
        return text, "curly_brace"
    kept: list[str] = []
    for raw in text.split("\n"):
        line = raw.strip()
        if not line:
            if kept and kept[-1]:
                kept.append("")  # a paragraph break stays (one)
            continue
        rule = _c4_line_rule(line, spec)
        if rule is None:
            kept.append(line)
        else:
            removed[f"{spec.name}.{rule}"] += 1
    text = "\n".join(kept).strip()
    if _count_sentences(text) < spec.min_sentences:
        return text, "too_few_sentences"
    return text, None


# ---------------------------------------------------------------------------
# FineWeb

_FINEWEB_STOPS = (".", "'", '"', "!", "?")


def _fineweb(text: str, spec: FineWeb) -> str | None:
    lines = _lines(text)
    if not lines:
        return None
    punctuated = sum(line.endswith(_FINEWEB_STOPS) for line in lines)
    if punctuated / len(lines) <= spec.min_punctuated_line_fraction:
        return "line_punctuation"
    _, chars = _duplicates(lines)
    if chars / len(text.replace("\n", "")) >= spec.max_duplicate_line_char_fraction:
        return "duplicate_line_chars"
    short = sum(len(line) <= spec.short_line_chars for line in lines)
    if short / len(lines) >= spec.max_short_line_fraction:
        return "short_lines"
    words = text.split()
    if words and text.count("\n") / len(words) > spec.max_newlines_per_word:
        return "list"
    return None


_CHECKS = {
    GopherRepetition: _gopher_repetition,
    GopherQuality: _gopher_quality,
    FineWeb: _fineweb,
}
