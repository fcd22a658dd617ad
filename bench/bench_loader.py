"""MLM+NSP batches per second of one loader worker vs transformers' MLM collator.

    python bench/bench_loader.py [--docs 4000 --seq-len 128 --batch-size 32 --rounds 3]

Builds a data dir with the real ShardWriter (random token ids, document lengths
log-normal around 400 tokens clipped to [16, 1024] as `plm data prepare` pieces them,
sentences of 8-40 tokens, a vocabulary of 30522), then times, in one process
(= one loader worker), alternating rounds:

* ours, cold:   a whole epoch of PretrainStream (mlm+nsp) from the shards, every
                document decoded from its tar member on first use (once per epoch, as
                with any corpus size: the default cache holds two shuffle groups);
* ours, cached: the same epoch again, documents already decoded: the objective's work
                alone, the same footing as the collator, which gets token lists in memory;
* HF:           transformers.DataCollatorForLanguageModeling(mlm_probability=0.15) on
                the same windows as pre-tokenized lists `[CLS] window [SEP]` (no NSP).

Our batches do more work than the collator's (NSP pairs with a random-document read,
fixed seq_len padding, whole example construction). Prints one line per measure and the
ratios; the median of the rounds is reported.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from pipeline.config import ObjectiveSection
from pipeline.data.shards import Document, ShardWriter, shard_name, write_manifest
from pipeline.data.stream import PretrainStream
from pipeline.objectives import build_objective

VOCAB = 30522
ROLES = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4, "bos": 2, "eos": 3, "eod": 5}
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[EOD]"]


def build_data(root: Path, n_docs: int, seed: int = 0, per_shard: int = 2000) -> None:
    rng = np.random.default_rng(seed)
    entries = []
    for s in range(-(-n_docs // per_shard)):
        writer = ShardWriter(root, shard_name("train", s), np.uint16)
        for i in range(s * per_shard, min(n_docs, (s + 1) * per_shard)):
            n = int(np.clip(rng.lognormal(np.log(400), 0.7), 16, 1024))
            ends = np.cumsum(rng.integers(8, 41, n // 8 + 1))
            ends = np.append(ends[ends < n], n).astype(np.int32)
            words = np.flatnonzero(np.concatenate([[True], rng.random(n - 1) < 0.75]))
            tokens = rng.integers(len(SPECIALS), VOCAB, n)
            writer.write(Document(f"doc-{i:07d}", tokens, ends, words.astype(np.int32)))
        entries.append(writer.close())
    splits = {"train": {"shards": entries}}
    write_manifest(
        root, {"format_version": 1, "tokenizer": {"path": "tokenizer"}, "splits": splits}
    )


def hf_collator():
    from tokenizers import Tokenizer, models
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), VOCAB)})
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordPiece(vocab, unk_token="[UNK]")),
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )
    return DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=0.15)


def per_second(fn, n: int) -> float:
    start = time.perf_counter()
    for i in range(n):
        fn(i)
    return n / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=4000)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_data(root, args.docs)
        objective = build_objective(ObjectiveSection(kind="mlm+nsp"), ROLES, VOCAB, args.seq_len)
        B = args.batch_size
        collator = hf_collator()
        cold, cached, hf, reads = [], [], [], []
        for epoch in range(args.rounds):  # a fresh stream and a new epoch per round
            stream = PretrainStream(root, "train", objective, B, seed=1)
            n = stream.batches_per_epoch
            cold.append(per_second(lambda i, s=stream, e=epoch: s.batch_at(e, i), n))
            reads.append(stream.docs_read / n)
            assert stream.docs_read == args.docs  # the cache held the epoch: no re-decoding
            cached.append(per_second(lambda i, s=stream, e=epoch: s.batch_at(e, i), n))
            # the collator's input: the same units' windows, pre-tokenized, in memory
            lists = []
            for b in range(n):
                rows = []
                for unit in stream.units_at(epoch, b):
                    (piece,) = unit.pieces
                    window = stream.document(piece.doc).tokens[piece.start : piece.stop]
                    rows.append({"input_ids": [ROLES["cls"], *window.tolist(), ROLES["sep"]]})
                lists.append(rows)
            hf.append(per_second(lambda i, x=lists: collator(x[i]), n))
        c, w, h = (statistics.median(x) for x in (cold, cached, hf))
        print(
            f"setup: {args.docs} docs ({stream.units_per_epoch} windows), seq_len "
            f"{args.seq_len}, batch {B}, {n} batches per epoch, {args.rounds} rounds (median)"
        )
        print(
            f"ours mlm+nsp, cold (decoding shards): {c:8.1f} batches/s  "
            f"({statistics.median(reads):.1f} docs decoded per batch)"
        )
        print(f"ours mlm+nsp, documents cached:       {w:8.1f} batches/s")
        print(f"HF DataCollatorForLanguageModeling:   {h:8.1f} batches/s")
        print(f"ratio cached/HF {w / h:.2f}x, cold/HF {c / h:.2f}x")


if __name__ == "__main__":
    main()
