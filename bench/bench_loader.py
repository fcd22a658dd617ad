"""MLM+NSP batches per second of one loader worker vs transformers' MLM collator.

    python bench/bench_loader.py [--docs 4000 --seq-len 128 --batch-size 32 --rounds 3]

Builds a data dir with the real ShardWriter (random token ids, document lengths
log-normal around 400 tokens clipped to [16, 1024] as `plm data prepare` pieces them,
sentences of 8-40 tokens, a vocabulary of 30522), then times, in one process
(= one loader worker), alternating rounds:

* ours, cold:   a whole epoch of PretrainStream (mlm+nsp) from the shards, every
                document read from its block on first use (once per epoch, as with any
                corpus size: the default cache holds two shuffle groups), by
                DataDir.read (memory map + the block index + np.frombuffer, each block's
                crc32 checked on its first read);
* ours, cached: the same epoch again, documents already decoded: the objective's work
                alone, the same footing as the collator, which gets token lists in memory;
* decoding alone: every document read once in a random order by DataDir.read (CPU
                microseconds per document);
* HF:           transformers.DataCollatorForLanguageModeling(mlm_probability=0.15) on
                the same windows as pre-tokenized lists `[CLS] window [SEP]` (no NSP).

Our batches do more work than the collator's (NSP pairs with a random-document read,
fixed seq_len padding, whole example construction). Torch runs one thread, as in a
DataLoader worker. Prints each measure's median rate per wall second and per CPU second
of this process (the latter less disturbed by other processes on a shared machine), and
the ratios to the collator taken within each round, then their median.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.config import ObjectiveSection
from pipeline.data.shards import (
    DataDir,
    Document,
    ShardWriter,
    shard_name,
    write_manifest,
)
from pipeline.loader.stream import PretrainStream
from pipeline.objectives import build_objective

VOCAB = 30522
ROLES = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4, "bos": 2, "eos": 3, "eod": 5}
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[EOD]"]


def build_data(root: Path, n_docs: int, seed: int = 0, per_shard: int = 2000) -> None:
    rng = np.random.default_rng(seed)
    entries = []
    for s in range(-(-n_docs // per_shard)):
        writer = ShardWriter.local(root, shard_name("train", s), np.uint16)
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
        root, {"format_version": 3, "tokenizer": {"path": "tokenizer"}, "splits": splits}
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


def per_second(fn, n: int) -> tuple[float, float]:
    """Calls per second of wall time and per second of this process's CPU time."""
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(n):
        fn(i)
    return n / (time.perf_counter() - wall), n / (time.process_time() - cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=4000)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)  # as in a DataLoader worker (and fair to the collator's CPU time)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_data(root, args.docs)
        objective = build_objective(ObjectiveSection(kind="mlm+nsp"), ROLES, VOCAB, args.seq_len)
        B = args.batch_size
        collator = hf_collator()
        rates: dict[str, list[tuple[float, float]]] = {
            "cold": [],
            "cached": [],
            "hf": [],
        }
        reads = []
        decode = {"DataDir.read": []}
        samples = [
            (e["name"], i) for e in DataDir(root).shards("train") for i in range(e["n_docs"])
        ]
        for epoch in range(args.rounds):  # fresh streams and a new epoch per round
            # the decoding alone: every document once, in a random order, CPU us per document
            order = np.random.default_rng(epoch).permutation(len(samples))
            for name, data in (("DataDir.read", DataDir(root)),):
                _, cpu = per_second(lambda i, d=data, o=order: d.read(*samples[o[i]]), len(order))
                decode[name].append(1e6 / cpu)
            stream = PretrainStream(root, "train", objective, B, seed=1)
            n = stream.batches_per_epoch
            rates["cold"].append(per_second(lambda i, s=stream, e=epoch: s.batch_at(e, i), n))
            reads.append(stream.docs_read / n)
            assert stream.docs_read == args.docs  # the cache held the epoch: no re-decoding
            rates["cached"].append(per_second(lambda i, s=stream, e=epoch: s.batch_at(e, i), n))
            # the collator's input: the same units' windows, pre-tokenized, in memory
            lists = []
            for b in range(n):
                rows = []
                for unit in stream.units_at(epoch, b):
                    (piece,) = unit.pieces
                    window = stream.document(piece.doc).tokens[piece.start : piece.stop]
                    rows.append({"input_ids": [ROLES["cls"], *window.tolist(), ROLES["sep"]]})
                lists.append(rows)
            rates["hf"].append(per_second(lambda i, x=lists: collator(x[i]), n))
        print(
            f"setup: {args.docs} docs ({stream.units_per_epoch} windows), seq_len "
            f"{args.seq_len}, batch {B}, {n} batches per epoch, "
            f"{statistics.median(reads):.1f} docs decoded per batch cold; "
            f"median of {args.rounds} rounds, batches/s per wall / per CPU second"
        )
        names = {
            "cold": "ours mlm+nsp, cold (DataDir.read)",
            "cached": "ours mlm+nsp, documents cached",
            "hf": "HF DataCollatorForLanguageModeling",
        }
        print(
            "decoding one document (CPU us, median): "
            + ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in decode.items())
        )
        for key, name in names.items():
            wall, cpu = (statistics.median(r[c] for r in rates[key]) for c in (0, 1))
            print(f"{name:38s} {wall:7.1f} wall  {cpu:7.1f} CPU")
        for key in ("cached", "cold"):
            # ratios within each round (same load), then the median over rounds
            ratio = [
                statistics.median(a[c] / b[c] for a, b in zip(rates[key], rates["hf"], strict=True))
                for c in (0, 1)
            ]
            rounds = zip(rates[key], rates["hf"], strict=True)
            per_round = ", ".join(f"{a[0] / b[0]:.2f}" for a, b in rounds)
            print(f"{key + '/HF:':13s} {ratio[0]:.2f}x wall ({per_round}), {ratio[1]:.2f}x CPU")


if __name__ == "__main__":
    main()
