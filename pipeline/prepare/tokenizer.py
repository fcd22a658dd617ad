"""Tokenizer training: WordPiece (BERT), byte-level BPE (GPT-2/RoBERTa), Unigram (ALBERT/XLNet).

The tokenizer is trained on a seeded sample of the cleaned corpus: every document gets a
priority from a keyed hash of its text and the ``sample_docs`` documents with the
lowest priorities are used (a bottom-k sample: independent of file order and of where
a document sits, and the same on every run). Selecting it takes two streaming passes
over the corpus that hold only priorities; the chosen texts go to a temporary file
that the trainer passes re-read.

The output folder is a local path or a filesystem URI (``s3://bucket/prefix``, through
``pyarrow.fs.FileSystem.from_uri`` and the AWS_* variables, as a data dir's); a URI's
store is checked before the sampling starts, and ``load_tokenizer`` reads either.

Outputs, both with deterministic bytes (HF's trainers are not deterministic on their
own for WordPiece and Unigram; see ``_continuation_tokens`` and ``_rescore_unigram``):
  tokenizer.json       HF tokenizers format, no post-processor (objectives add specials)
  tokenizer_meta.json  kind, vocab size, special tokens, the eight roles, sha256, spec
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from pipeline.prepare.clean import CleanConfig, clean, reject_reason
from pipeline.prepare.readers import InputError, Source, iter_raw_documents, resolve_inputs
from pipeline.storage import atomic_write, check_store, is_uri, redact_uri

TOKENIZER_FILE = "tokenizer.json"
META_FILE = "tokenizer_meta.json"
ROLES = ("pad", "unk", "cls", "sep", "mask", "bos", "eos", "eod")
_SPECIAL_SCORE = -1.0e6  # log-probability of special pieces in a Unigram model

# Special tokens in id order (they get ids 0..k-1) and which token plays each role.
SPECIALS: dict[str, tuple[list[str], dict[str, str]]] = {
    "wordpiece": (
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
        {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]",
         "bos": "[CLS]", "eos": "[SEP]", "eod": "[SEP]"},
    ),
    "bpe": (
        ["<s>", "<pad>", "</s>", "<unk>", "<mask>", "<|endoftext|>"],
        {"pad": "<pad>", "unk": "<unk>", "cls": "<s>", "sep": "</s>", "mask": "<mask>",
         "bos": "<s>", "eos": "</s>", "eod": "<|endoftext|>"},
    ),
    "unigram": (
        ["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]", "<eod>"],
        {"pad": "<pad>", "unk": "<unk>", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]",
         "bos": "[CLS]", "eos": "[SEP]", "eod": "<eod>"},
    ),
}  # fmt: skip


class TokenizerSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["wordpiece", "bpe", "unigram"]
    vocab_size: int = Field(gt=0)
    lowercase: bool = False
    sample_docs: int = Field(200_000, gt=0)
    seed: int = 1234
    text_field: str = "text"


# ---------------------------------------------------------------------------
# Sampling


def _priority(seed: int, text: str) -> int:
    key = seed.to_bytes(8, "little", signed=True)
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=key).digest()
    return int.from_bytes(digest, "big")


def _counted(items: Iterable, desc: str | None, unit: str = " docs") -> Iterable:
    """``items`` with a tqdm bar on stderr when ``desc`` is given and stderr is a terminal
    (elsewhere the stage lines of ``_Stages`` say what runs)."""
    if desc is None:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=f"tokenizer: {desc}", unit=unit, disable=None, mininterval=1.0,
                file=sys.stderr)  # fmt: skip


class _Stages:
    """One line per stage of a tokenizer training on stderr, with the time since the start:
    a long training (Unigram on a big sample) is never silent."""

    def __init__(self) -> None:
        self.started = time.perf_counter()

    def __call__(self, what: str) -> None:
        elapsed = time.perf_counter() - self.started
        print(f"tokenizer: {what} ({elapsed:.0f} s)", file=sys.stderr, flush=True)


def _clean_documents(
    sources: list[Source], cfg: CleanConfig, progress: str | None = None
) -> Iterator[tuple[int, int, str]]:
    """(source index, ordinal, cleaned text) of every kept document, in corpus order."""
    for index, source in enumerate(_counted(sources, progress, " inputs")):
        for doc in iter_raw_documents(source):
            if doc.text is None:
                continue
            text = clean(doc.text, cfg)
            if reject_reason(text, cfg) is None:
                yield index, doc.ordinal, text


def sample_documents(
    sources: list[Source],
    n: int,
    seed: int,
    cfg: CleanConfig | None = None,
    progress: bool = False,
) -> Iterator[str]:
    """The ``n`` cleaned documents with the lowest seeded hash, yielded in corpus order.

    Two passes: the first keeps the (priority, position) of the best n in a heap, the
    second yields those documents' texts. Ties (duplicate texts) go by position.
    """
    cfg = cfg or CleanConfig()
    heap: list[tuple[int, int, int]] = []  # max-heap via negation: (-priority, -src, -ord)
    first = _clean_documents(sources, cfg, "sampling, pass 1 of 2" if progress else None)
    for index, ordinal, text in first:
        item = (-_priority(seed, text), -index, -ordinal)
        if len(heap) < n:
            heapq.heappush(heap, item)
        elif item > heap[0]:
            heapq.heapreplace(heap, item)
    chosen = {(-i, -o) for _, i, o in heap}
    second = _clean_documents(sources, cfg, "sampling, pass 2 of 2" if progress else None)
    for index, ordinal, text in second:
        if (index, ordinal) in chosen:
            yield text


def _write_sample(sources: list[Source], spec: TokenizerSpec, path: Path) -> int:
    """Write the sample to a jsonl file (each trainer pass re-reads it); returns its size."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for text in sample_documents(sources, spec.sample_docs, spec.seed, progress=True):
            f.write(json.dumps(text, ensure_ascii=False) + "\n")
            n += 1
    return n


def _read_sample(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


# ---------------------------------------------------------------------------
# The three kinds


def _pipeline(spec: TokenizerSpec) -> Tokenizer:
    """An untrained tokenizer of the spec's kind: model, normalizer, pre-tokenizer, decoder."""
    if spec.kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        # BertNormalizer puts spaces around CJK ideographs: Chinese becomes characters.
        tok.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, lowercase=spec.lowercase
        )
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(prefix="##")
    elif spec.kind == "bpe":
        tok = Tokenizer(models.BPE())  # byte-level: every byte is in the alphabet, no unk
        if spec.lowercase:
            tok.normalizer = normalizers.Lowercase()
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    else:
        tok = Tokenizer(models.Unigram())
        if spec.lowercase:
            tok.normalizer = normalizers.Lowercase()
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = None  # objectives add [CLS]/[SEP]/<s>; encode never does
    return tok


def _trainer(spec: TokenizerSpec, seeded: list[str]) -> trainers.Trainer:
    specials = SPECIALS[spec.kind][0] + seeded
    if spec.kind == "wordpiece":
        return trainers.WordPieceTrainer(
            vocab_size=spec.vocab_size,
            min_frequency=2,
            special_tokens=specials,
            continuing_subword_prefix="##",
            show_progress=sys.stderr.isatty(),
        )
    if spec.kind == "bpe":
        return trainers.BpeTrainer(
            vocab_size=spec.vocab_size,
            min_frequency=2,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=sys.stderr.isatty(),
        )
    return trainers.UnigramTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=specials,
        unk_token="<unk>",
        max_piece_length=16,
        show_progress=sys.stderr.isatty(),
    )


def _continuation_tokens(tok: Tokenizer, texts: Iterable[str]) -> list[str]:
    """``##c`` for every character c that occurs inside a word, sorted.

    tokenizers 0.23's WordPiece trainer creates these tokens while iterating a hash map,
    so their ids, and through merge tie-breaking even the merges, change from run to
    run (huggingface/tokenizers#1794). Handing them to the trainer up front, sorted,
    fixes their ids; they are removed from the added tokens again after training.
    """
    chars: set[str] = set()
    for text in texts:
        for word, _ in tok.pre_tokenizer.pre_tokenize_str(tok.normalizer.normalize_str(text)):
            chars.update(word[1:])
    return sorted("##" + c for c in chars)


def _alphabet(tok: Tokenizer, texts: Iterable[str]) -> set[str]:
    """The distinct characters of the pre-tokenized words (what a Unigram vocab must hold)."""
    chars: set[str] = set()
    for text in texts:
        if tok.normalizer is not None:
            text = tok.normalizer.normalize_str(text)
        for word, _ in tok.pre_tokenizer.pre_tokenize_str(text):
            chars.update(word)
    return chars


def _drop_added(tok: Tokenizer, contents: set[str]) -> Tokenizer:
    """The tokenizer without the added tokens ``contents`` (they stay in the model vocab)."""
    data = json.loads(tok.to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in contents]
    return Tokenizer.from_str(json.dumps(data))


def _rescore_unigram(tok: Tokenizer, specials: list[str], texts: Iterable[str]) -> Tokenizer:
    """Deterministic scores and ids for a trained Unigram model.

    The Unigram trainer sums its EM statistics in hash-map order, so its scores differ in
    the last digits from run to run and pieces of equal score swap ids. The piece set is
    kept; each piece's score becomes the log relative frequency of the piece in the
    Viterbi segmentation of the sample (integer counts, the same on every run), and ids
    go by count, then piece. Special pieces get a score no segmentation picks (the
    trainer gives them 0.0, the best possible, so the text "[MASK]" would become the
    mask token).
    """
    model = json.loads(tok.to_str())["model"]
    pieces = [piece for piece, _ in model["vocab"]]
    counts = dict.fromkeys(pieces, 0)
    tok.encode_special_tokens = True

    def count(batch: list[str]) -> None:
        for enc in tok.encode_batch(batch, add_special_tokens=False):
            for piece in enc.tokens:
                counts[piece] += 1

    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == 256:
            count(batch)
            batch = []
    count(batch)
    total = sum(counts.values()) + len(pieces)
    others = sorted((p for p in pieces if p not in specials), key=lambda p: (-counts[p], p))
    vocab = [(p, _SPECIAL_SCORE) for p in specials]
    vocab += [(p, math.log((counts[p] + 0.5) / total)) for p in others]
    tok.model = models.Unigram(vocab, unk_id=specials.index("<unk>"), byte_fallback=False)
    return tok


def _meta(tok: Tokenizer, spec: TokenizerSpec, json_bytes: bytes) -> dict:
    specials, roles = SPECIALS[spec.kind]
    ids = {token: tok.token_to_id(token) for token in specials}
    if list(ids.values()) != list(range(len(specials))):
        raise RuntimeError(f"special tokens did not get the first ids: {ids}")
    return {
        "kind": spec.kind,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "lowercase": spec.lowercase,
        "special_tokens": ids,
        "roles": {role: ids[roles[role]] for role in ROLES},
        "sha256": hashlib.sha256(json_bytes).hexdigest(),
        "spec": spec.model_dump(),
    }


# ---------------------------------------------------------------------------
# Public entry points


def train_tokenizer(inputs: list[str], spec: TokenizerSpec, output: str | Path) -> Path | str:
    """Train on a seeded sample of ``inputs``; writes OUTPUT/tokenizer.json + meta; returns
    OUTPUT (a Path, or the URI as given). The stores of URI inputs and output are checked
    first: a missing bucket, refused credentials or no connection stop it before any work."""
    for item in inputs:
        if is_uri(item):
            check_store(item, "--input")
    store = check_store(str(output), "--output") if is_uri(output) else None
    sources = resolve_inputs(list(inputs), text_field=spec.text_field)
    specials = SPECIALS[spec.kind][0]
    stage = _Stages()
    stage(f"sampling up to {spec.sample_docs:,} documents of {len(sources)} input(s)")
    with tempfile.TemporaryDirectory(prefix="plm-tokenizer-") as tmp:
        sample = Path(tmp) / "sample.jsonl"
        n_sample = _write_sample(sources, spec, sample)
        if n_sample == 0:
            raise InputError(
                f"inputs {list(inputs)} hold no usable document (all empty, too short or rejected)"
            )
        stage(
            f"training a {spec.kind} vocabulary of {spec.vocab_size:,} on {n_sample:,} "
            f"documents{' (minutes on a big sample)' if spec.kind == 'unigram' else ''}"
        )
        tok = _pipeline(spec)
        seeded = []
        if spec.kind == "wordpiece":
            seeded = _continuation_tokens(tok, _read_sample(sample))
        try:
            tok.train_from_iterator(_read_sample(sample), trainer=_trainer(spec, seeded))
        except Exception as err:  # tokenizers raises a bare Exception
            if "not large enough to contain all chars" not in str(err):
                raise
            need = len(_alphabet(tok, _read_sample(sample))) + len(specials)
            raise InputError(
                f"--vocab-size {spec.vocab_size} is too small for a {spec.kind} tokenizer of "
                f"these inputs: every one of the sample's {need - len(specials)} distinct "
                f"characters must be a piece, plus {len(specials)} special tokens; pass "
                f"--vocab-size {need} or more"
            ) from None
        if seeded:
            tok = _drop_added(tok, set(seeded))
        if spec.kind == "unigram":
            stage("rescoring the unigram pieces on the sample (deterministic scores)")
            tok = _rescore_unigram(tok, specials, _read_sample(sample))
    json_bytes = tok.to_str(pretty=True).encode("utf-8")
    meta = _meta(tok, spec, json_bytes)
    meta_bytes = (json.dumps(meta, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()
    if store is not None:  # tokenizer.json first: a reader checks it against the meta's sha256
        fs, root = store
        root = root.rstrip("/")
        fs.create_dir(root, recursive=True)
        atomic_write(f"{root}/{TOKENIZER_FILE}", json_bytes, fs)
        atomic_write(f"{root}/{META_FILE}", meta_bytes, fs)
        return str(output)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / TOKENIZER_FILE, json_bytes)
    atomic_write(out / META_FILE, meta_bytes)
    return out


def tokenizer_files(directory: str | Path, what: str = "--tokenizer") -> tuple[bytes, bytes]:
    """The bytes of tokenizer.json and tokenizer_meta.json of a folder or a URI (its store
    checked first), the fingerprint checked: a swapped file is caught."""
    if is_uri(directory):
        import pyarrow.fs as pafs

        uri = str(directory).rstrip("/")
        fs, root = check_store(uri, what)
        root = root.rstrip("/")
        found = []
        for name in (TOKENIZER_FILE, META_FILE):
            try:
                with fs.open_input_stream(f"{root}/{name}") as f:
                    found.append(f.read())
            except FileNotFoundError:
                found.append(None)
            except OSError as err:
                if fs.get_file_info(f"{root}/{name}").type != pafs.FileType.NotFound:
                    raise InputError(f"{redact_uri(uri)}/{name}: cannot read it ({err})") from None
                found.append(None)
        where = [f"{redact_uri(uri)}/{name}" for name in (TOKENIZER_FILE, META_FILE)]
    else:
        paths = [Path(directory) / TOKENIZER_FILE, Path(directory) / META_FILE]
        found = [p.read_bytes() if p.is_file() else None for p in paths]
        where = [str(p) for p in paths]
    for data, path in zip(found, where, strict=True):
        if data is None:
            raise InputError(f"{path} not found: train one with `plm data tokenizer`")
    data, meta_bytes = found
    meta = json.loads(meta_bytes.decode("utf-8"))
    if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        raise InputError(
            f"{where[0]} does not match the sha256 in {where[1]}: the files come from "
            "different trainings; retrain or copy both together"
        )
    return data, meta_bytes


def tokenizer_folder(path: str) -> str:
    """The tokenizer folder ``path`` names: the folder, or, for one of its two files given
    (``tok/tokenizer.json``), the folder that holds it. A URI is taken as it is."""
    if not is_uri(path) and Path(path).name in (TOKENIZER_FILE, META_FILE):
        if Path(path).is_file():
            return str(Path(path).parent)
    return path


def check_tokenizer_folder(path: str) -> None:
    """An InputError for a local tokenizer folder that is missing or is a file."""
    if is_uri(path) or Path(path).is_dir():
        return
    if Path(path).exists():
        raise InputError(
            f"tokenizer folder {path} is a file: pass the folder that holds {TOKENIZER_FILE} "
            f"and {META_FILE} (what `plm data tokenizer --output` wrote)"
        )
    raise InputError(f"tokenizer folder {path} does not exist: train one with `plm data tokenizer`")


def load_tokenizer(directory: str | Path) -> tuple[Tokenizer, dict]:
    """The tokenizer and its meta, from a folder or a URI; checks the fingerprint so a
    swapped file is caught."""
    data, meta_bytes = tokenizer_files(directory)
    meta = json.loads(meta_bytes.decode("utf-8"))
    tok = Tokenizer.from_str(data.decode("utf-8"))
    tok.encode_special_tokens = True  # "<s>" in a document is text, not a control token
    return tok, meta
