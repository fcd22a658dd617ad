"""Intrinsic tasks of the static word vectors: nothing is trained, one cell per model.

The vectors are ``plm neighbors``' (pipeline/neighbors.py): word2vec's word vectors, and
ELMo's layer 0 (the char-CNN token vectors). A word the tokenizer splits gets the mean of
its pieces' vectors.

- ``similarity``: word pairs with a human score (WordSim-353, SimLex-999, MEN as
  distributed): Spearman's rho between the pairs' cosines and the scores;
- ``analogy``: "a b c d" questions (questions-words.txt of the word2vec tool: ``: section``
  lines, then four words a line): is d the word of the vocabulary nearest to b - a + c
  (3CosAdd, unit vectors; a, b, c excluded)? ``acc_mul`` is Levy & Goldberg's 3CosMul.
  A question whose answer is not one token of the vocabulary cannot be answered; the
  accuracies are over the answerable ones, and ``coverage`` says how many those are.

The files are read in ``read_*`` at plan time (a bad line is one ``plm:`` line naming it);
``score`` runs in the cell.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from pipeline.eval.suite import EvalError

INTRINSIC_ARCHS = ("word2vec", "elmo")
METRICS: dict[str, tuple[str, ...]] = {  # the first ranks
    "similarity": ("spearman", "coverage"),
    "analogy": ("acc", "acc_mul", "coverage"),
}
_MUL_EPS = 1e-3  # 3CosMul's guard against a zero denominator (Levy & Goldberg's value)


def _fields(line: str, path: str) -> list[str]:
    if "\t" in line:
        return [f.strip() for f in line.split("\t")]
    if path.endswith(".csv"):
        return [f.strip() for f in line.split(",")]
    return line.split()


def read_similarity(path: str, score_field: int, task: str) -> list[dict]:
    """[{a, b, score}] of a pairs file: tab-separated (else comma for .csv, else spaces),
    the words in the first two fields, the human score in field ``score_field`` (0-based).
    '#' lines are comments; a first line whose score is not a number is its header."""
    if not Path(path).is_file():
        raise EvalError(f"tasks.{task}: data.test {path} does not exist")
    rows: list[dict] = []
    header_allowed = True
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        fields = _fields(line, path)
        if len(fields) <= max(1, score_field):
            raise EvalError(f"{path} line {n}: {len(fields)} field(s), the pair and its score "
                            f"need {max(2, score_field + 1)} (tasks.{task}.score_field is "
                            f"{score_field}, 0-based)")  # fmt: skip
        try:
            score = float(fields[score_field])
        except ValueError:
            if header_allowed:
                header_allowed = False
                continue
            raise EvalError(f"{path} line {n}: {fields[score_field]!r} is not a number; set "
                            f"tasks.{task}.score_field to the 0-based field of the score "
                            "(SimLex-999: 3)") from None  # fmt: skip
        header_allowed = False
        rows.append({"a": fields[0], "b": fields[1], "score": score})
    if len(rows) < 3:
        raise EvalError(f"{path}: {len(rows)} pair(s); a rank correlation needs at least 3")
    return rows


def read_analogies(path: str, task: str) -> list[dict]:
    """[{a, b, c, d, section}] of a questions-words file."""
    if not Path(path).is_file():
        raise EvalError(f"tasks.{task}: data.test {path} does not exist")
    rows: list[dict] = []
    section = ""
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if line.startswith(":"):
            section = line[1:].strip()
            continue
        words = line.split()
        if len(words) != 4:
            raise EvalError(f"{path} line {n}: {len(words)} word(s); a question is four "
                            "words 'a b c d' (a is to b as c is to d)")  # fmt: skip
        rows.append(dict(zip("abcd", words, strict=True), section=section))
    if not rows:
        raise EvalError(f"{path}: no question (lines of four words)")
    return rows


def write_rows(rows: list[dict], out: Path) -> str:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
    return str(out)


def _read_rows(rows_file: str) -> list[dict]:
    return [json.loads(line) for line in Path(rows_file).read_text("utf-8").splitlines()]


def check_coverage(kind: str, task: str, rows_file: str, bundle: str | Path) -> None:
    """Refuse, before any cell, a file of which the bundle's vocabulary can score nothing
    (a similarity pair needs both words, an analogy its answer as one token)."""
    from tokenizers import Tokenizer

    from pipeline.models.bundle import own_file, special_ids

    tokenizer = Tokenizer.from_file(str(own_file(bundle, "tokenizer.json")))
    specials = special_ids(Path(bundle))
    rows = _read_rows(rows_file)
    if kind == "similarity":
        scored = [r for r in rows if all(_word_ids(tokenizer, specials, r[k]) for k in "ab")]
        enough, need = len(scored) >= 3, "at least 3 pairs whose words it knows"
    else:
        scored = [r for r in rows if len(_word_ids(tokenizer, specials, r["d"])) == 1]
        enough, need = bool(scored), "a question whose answer is one of its tokens"
    if not enough:
        raise EvalError(f"tasks.{task}: the vocabulary of {bundle} scores {len(scored)} of the "
                        f"{len(rows)} rows of data.test; a {kind} task needs {need}")  # fmt: skip


def _vectors(bundle: str, init: str, seed: int):
    """(vectors [V, D], candidates [V] bool, tokenizer, special ids) of the bundle, or of
    fresh weights of its shape for ``random`` (its buffers kept: the char table, counts)."""
    from tokenizers import Tokenizer

    from pipeline.models.bundle import load_bundle, special_ids
    from pipeline.models.registry import build_model
    from pipeline.neighbors import static_vectors

    model, config = load_bundle(Path(bundle))
    arch = config["arch"]
    _, candidates = static_vectors(model, arch)
    if init == "random":
        torch.manual_seed(seed)
        fresh = build_model(arch, model.config)
        fresh.load_state_dict(dict(model.named_buffers()), strict=False)
        model = fresh
    vectors, _ = static_vectors(model.eval(), arch)
    tokenizer = Tokenizer.from_file(str(Path(bundle) / "tokenizer.json"))
    return vectors, candidates, tokenizer, special_ids(Path(bundle))


def _word_ids(tokenizer, specials: set[int], word: str) -> list[int]:
    from pipeline.neighbors import word_ids

    return [i for i in word_ids(tokenizer, word) if i not in specials]


def similarity(vectors: Tensor, tokenizer, specials: set[int], rows: list[dict]) -> dict:
    from pipeline.finetune.metrics import spearman

    cos, gold = [], []
    for r in rows:
        a, b = _word_ids(tokenizer, specials, r["a"]), _word_ids(tokenizer, specials, r["b"])
        if a and b:
            va, vb = vectors[a].mean(0), vectors[b].mean(0)
            cos.append(float(F.cosine_similarity(va, vb, dim=0)))
            gold.append(r["score"])
    return {"spearman": spearman(cos, gold), "coverage": len(cos) / len(rows)}


@torch.no_grad()
def analogy(
    vectors: Tensor, candidates: Tensor, tokenizer, specials: set[int], rows: list[dict]
) -> dict:
    unit = F.normalize(vectors, dim=-1)
    allowed = candidates.clone()
    allowed[sorted(specials)] = False
    for token, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if token.startswith("##"):  # a WordPiece continuation is not a word
            allowed[i] = False
    add = mul = answered = 0
    for r in rows:
        ids = [_word_ids(tokenizer, specials, r[k]) for k in "abcd"]
        if not all(ids) or len(ids[3]) != 1 or not allowed[ids[3][0]]:
            continue
        a, b, c = (F.normalize(unit[i].mean(0), dim=0) for i in ids[:3])
        sims = {k: unit @ v for k, v in zip("abc", (a, b, c), strict=True)}
        mask = allowed.clone()
        mask[[i for w in ids[:3] for i in w]] = False
        cos_add = torch.where(mask, sims["b"] - sims["a"] + sims["c"], -float("inf"))
        pos = {k: (s + 1) / 2 for k, s in sims.items()}  # cosines moved into [0, 1]
        cos_mul = torch.where(mask, pos["b"] * pos["c"] / (pos["a"] + _MUL_EPS), -float("inf"))
        add += int(cos_add.argmax()) == ids[3][0]
        mul += int(cos_mul.argmax()) == ids[3][0]
        answered += 1
    n = max(answered, 1)
    return {"acc": add / n, "acc_mul": mul / n, "coverage": answered / len(rows)}


def score(kind: str, rows_file: str, bundle: str, init: str, seed: int) -> dict[str, float]:
    """The task's metrics for one model (the rows as ``read_*`` wrote them)."""
    rows = _read_rows(rows_file)
    vectors, candidates, tokenizer, specials = _vectors(bundle, init, seed)
    if kind == "similarity":
        return similarity(vectors, tokenizer, specials, rows)
    return analogy(vectors, candidates, tokenizer, specials, rows)
