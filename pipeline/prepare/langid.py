"""Language identification of `plm data prepare`: an ISO 639-1 code per document.

py3langid (a fork of langid.py: a naive Bayes model over byte n-grams, over a hundred languages)
ships its model inside its wheel, so nothing is downloaded at run time. It was chosen
over pycld2 and lingua for its accuracy on short documents and its speed
(bench/bench_langid.py; BENCHMARKS.md, docs/data.md). Deterministic: the same text gives
the same code on every machine.

Only the first ``LANGID_CHARS`` characters of a document are classified: the cost stays
bounded on long documents, and a few hundred characters are plenty for the model.
"""

from __future__ import annotations

from functools import cache

LANGID_CHARS = 2000


@cache
def _classifier():
    import py3langid

    return py3langid.classify


def identify(text: str) -> str:
    """The ISO 639-1 code of the language ``text`` is written in (e.g. ``en``, ``zh``)."""
    code, _score = _classifier()(text[:LANGID_CHARS])
    return str(code)


@cache
def known_languages() -> tuple[str, ...]:
    """The ISO 639-1 codes the model knows."""
    import py3langid
    from py3langid import langid

    py3langid.classify("")  # loads the model
    return tuple(langid.IDENTIFIER.nb_classes)


ALL = "*"  # ``--languages all`` (or ``*``): keep every language


def parse_languages(value: object) -> object:
    """``--languages en,zh`` (or a YAML list) as a list of lowercase codes; ``all`` or
    ``*`` (alone or among codes) as ``["*"]``: every language is kept."""
    if isinstance(value, str):
        value = value.split(",")
    if isinstance(value, list):
        codes = [str(code).strip().lower() for code in value if str(code).strip()]
        return [ALL] if ALL in codes or "all" in codes else codes
    return value
