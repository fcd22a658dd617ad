"""The whole-model paths stream: exporting a bundle to transformers and loading it for a
ZeRO-3 fine-tune never hold the whole model on a rank. Two gloo ranks run
stream_memory_probe.py on a ~38M-parameter BERT (151 MB of fp32); each phase's peak
resident growth is measured by the kernel (VmHWM, reset per phase).

Measured here (2 ranks, MALLOC_MMAP_THRESHOLD_=65536 as docs/training.md sets ZeRO-3
ranks): the export grows rank 0 by 0.08-0.13 of the model's bytes (the largest tensor,
the word embeddings, is 0.12), each rank's ZeRO-3 load by 0.75 (its half of the
partitions, one whole module while zero.Init partitions it, one gathered parameter).
The code before streaming, same probe: export 2.01, load 2.00 (the whole model, and the
pages of the memory-mapped bundle file it read). The bounds (export 0.4, load 1.0) sit
between the two."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import free_port

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

PROBE = Path(__file__).with_name("stream_memory_probe.py")


def wordpiece_dir(out: Path, vocab_size: int) -> Path:
    """A WordPiece tokenizer of ``vocab_size`` made-up tokens (no training needed)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(vocab_size - 5)])}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    out.mkdir(parents=True)
    tok.save(str(out / "tokenizer.json"))
    ids = {s: vocab[s] for s in specials}
    meta = {
        "kind": "wordpiece", "vocab_size": vocab_size, "lowercase": False,
        "special_tokens": ids,
        "roles": {"pad": ids["[PAD]"], "unk": ids["[UNK]"], "cls": ids["[CLS]"],
                  "sep": ids["[SEP]"], "mask": ids["[MASK]"]},
        "sha256": hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest(),
        "spec": {},
    }  # fmt: skip
    (out / "tokenizer_meta.json").write_text(json.dumps(meta, sort_keys=True))
    return out


def write_bundle(
    root: Path, preset: dict, vocab_size: int, name: str = "bundle"
) -> tuple[Path, int]:
    """(bundle, its weights' bytes), written from a model built once and freed."""
    from pipeline.models import build_model, resolve_model_config
    from pipeline.models.bundle import save_bundle

    tok = root / "tok"
    if not tok.is_dir():
        wordpiece_dir(tok, vocab_size)
    cfg = resolve_model_config({"arch": "bert", **preset}, vocab_size)
    model = build_model("bert", cfg)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    bundle = save_bundle(root / name, "bert", cfg, model.state_dict(), tok)
    return bundle, nbytes


def run_probe(
    bundle: Path, small: Path, out: Path, world: int = 2, timeout: int = 600
) -> list[dict]:
    port = free_port()
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": "1",
        "MALLOC_MMAP_THRESHOLD_": "65536",
    }  # as docs/training.md sets ZeRO-3 ranks; fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, str(PROBE), str(bundle), str(out), str(small)],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_export_and_zero3_load_never_hold_the_whole_model(tmp_path):
    preset = {"preset": "bert-base", "num_layers": 6, "max_positions": 128}
    bundle, nbytes = write_bundle(tmp_path, preset, 8_000)
    assert nbytes > 100 * 2**20  # big enough that a whole copy stands out of the noise
    small, _ = write_bundle(tmp_path, {**preset, "num_layers": 1}, 8_000, "small")
    ranks = run_probe(bundle, small, tmp_path)
    print(f"model {nbytes / 2**20:.0f} MiB; " + "; ".join(
        f"rank {r}: " + ", ".join(f"{k} {v / nbytes:.2f}" for k, v in m.items() if "growth" in k)
        for r, m in enumerate(ranks)))  # fmt: skip
    assert ranks[0]["export_growth"] < 0.4 * nbytes
    for m in ranks:
        assert m["load_growth"] < 1.0 * nbytes

    # the export is what transformers loads
    transformers = pytest.importorskip("transformers")
    from pipeline.models.bundle import load_bundle

    ours, _ = load_bundle(bundle)
    hf = transformers.BertForPreTraining.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, 8_000, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(input_ids=x).prediction_logits
    torch.testing.assert_close(theirs, ours(x)["mlm_logits"][..., :8_000], atol=1e-4, rtol=1e-4)
