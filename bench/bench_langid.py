"""Language identification libraries on short documents: accuracy and speed, side by side.

    python bench/bench_langid.py [--repeat 3]

Candidates: those that ship their model inside the wheel (nothing is downloaded at run
time) and are installed in this Python: py3langid, pycld2, lingua-language-detector
(high- and low-accuracy mode). A candidate that is not installed is skipped (only
py3langid is a dependency of the project; ``pip install pycld2 lingua-language-detector``
for the others).

The labelled set (built here, nothing is fetched):
- ``bench/langid_samples.tsv``: hand-written sentences in 11 languages (en de fr es it
  pt nl ru ja ko zh), one short text each;
- ``builtin:python-docs``: 200 English prose paragraphs of 60-200 characters (the first
  paragraphs of its documents that are mostly letters);
- ``builtin:zh-sample``: each of its Chinese paragraphs, cut to 100 characters.

Accuracy: the share of texts whose top language is the label (zh-Hant and the like count
as zh). Speed: documents per second of one process over the whole set, best of
``--repeat``, after one warm-up pass (lingua loads its models lazily); and over 300 whole
python-docs documents (a few KB each), the size the pipeline sees.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def labelled_set() -> list[tuple[str, str]]:
    from pipeline.prepare.readers import python_docs

    items = []
    for line in (HERE / "langid_samples.tsv").read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            code, text = line.split("\t", 1)
            items.append((code, text))
    letters = re.compile(r"[A-Za-z ]")
    english = []
    for doc in python_docs():
        for para in doc.split("\n\n"):
            para = " ".join(para.split())
            if 60 <= len(para) <= 200 and len(letters.findall(para)) >= 0.85 * len(para):
                english.append(para)
                break
        if len(english) == 200:
            break
    items += [("en", text) for text in english]
    zh = (Path(__file__).resolve().parents[1] / "pipeline/prepare/corpora/zh_sample.txt").read_text(
        encoding="utf-8"
    )
    items += [("zh", p.strip()[:100]) for p in zh.split("\n\n") if p.strip()]
    return items


def candidates():
    found = {}
    try:
        import py3langid

        found["py3langid 0.4.0"] = lambda text: py3langid.classify(text)[0]
    except ImportError:
        pass
    try:
        import pycld2

        def cld2(text: str) -> str:
            try:
                return pycld2.detect(text)[2][0][1]
            except pycld2.error:
                return "un"

        found["pycld2 0.42"] = cld2
    except ImportError:
        pass
    try:
        from lingua import LanguageDetectorBuilder

        for mode in ("high", "low"):
            builder = LanguageDetectorBuilder.from_all_languages()
            if mode == "low":
                builder = builder.with_low_accuracy_mode()
            detector = builder.build()

            def detect(text: str, detector=detector) -> str:
                lang = detector.detect_language_of(text)
                return lang.iso_code_639_1.name.lower() if lang else "un"

            found[f"lingua 2.1.1 ({mode} accuracy)"] = detect
    except ImportError:
        pass
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    from pipeline.prepare.readers import python_docs

    items = labelled_set()
    long_docs = list(python_docs()[:300])
    labels = sorted({code for code, _ in items})
    print(
        f"{len(items)} labelled short texts ({', '.join(labels)}), "
        f"mean {sum(len(t) for _, t in items) / len(items):.0f} characters; "
        f"{len(long_docs)} whole documents, mean {sum(map(len, long_docs)) / len(long_docs):.0f}"
    )
    print("| library | accuracy (all) | en | zh | other 9 | short docs/s | whole docs/s |")
    print("|---|---|---|---|---|---|---|")
    for name, detect in candidates().items():
        for _, text in items[:50]:  # warm-up
            detect(text)
        got = [detect(text).split("-")[0] for _, text in items]
        right = [g == code for g, (code, _) in zip(got, items, strict=True)]

        def share(keep, right=right) -> str:
            picked = [r for r, (code, _) in zip(right, items, strict=True) if keep(code)]
            return f"{sum(picked)}/{len(picked)}"

        rates = []
        for texts in ([t for _, t in items], long_docs):
            best = float("inf")
            for _ in range(args.repeat):
                started = time.perf_counter()
                for text in texts:
                    detect(text)
                best = min(best, time.perf_counter() - started)
            rates.append(len(texts) / best)
        print(
            f"| {name} | {sum(right) / len(right):.1%} | {share(lambda c: c == 'en')} | "
            f"{share(lambda c: c == 'zh')} | {share(lambda c: c not in ('en', 'zh'))} | "
            f"{rates[0]:,.0f} | {rates[1]:,.0f} |"
        )
        wrong = [
            (code, g, text[:40])
            for g, (code, text), r in zip(got, items, right, strict=True)
            if not r
        ]
        for code, g, text in wrong[:6]:
            print(f"    {name}: {code} read as {g}: {text!r}")


if __name__ == "__main__":
    main()
