"""`plm finetune`'s printed lines round their numbers for people: 4 significant digits, a
whole number (the epoch) as an integer (issue 52: `valid accuracy 0.6746031746031746`,
`epoch 1.0000`). A real fine-tuning run, in-process, through DeepSpeed."""

from __future__ import annotations

import json
import random
import re

import pytest

from pipeline.finetune.loop import for_people

WORDS = "the cat dog reads a good bad book very new york red blue color is what".split()
LONG_FLOAT = re.compile(r"\d\.\d{5,}")  # more digits than a person reads


def test_for_people_rounds_to_4_significant_digits_and_prints_whole_numbers_as_integers():
    assert for_people(0.6746031746031746) == "0.6746"
    assert for_people(1.0) == "1" and for_people(20) == "20"
    assert for_people(2.3456789) == "2.346" and for_people(0.000123456) == "0.0001235"
    assert for_people(float("nan")) == "nan" and for_people("cls") == "cls"


def rows(n: int, seed: int) -> list[dict[str, str]]:
    r = random.Random(seed)
    out = []
    for i in range(n):
        animal = ["cat", "dog"][i % 2]
        words = [r.choice(WORDS) for _ in range(4)]
        words.insert(r.randrange(5), animal)
        out.append({"text": " ".join(words), "label": animal})
    return out


@pytest.mark.slow
def test_the_finetune_lines_show_rounded_numbers_and_whole_epochs(tmp_path, capsys):
    import torch

    from pipeline.finetune.config import validate_finetune
    from pipeline.finetune.loop import finetune
    from pipeline.models.bundle import save_bundle
    from pipeline.models.registry import build_model, resolve_model_config
    from pipeline.prepare.tokenizer import TokenizerSpec, train_tokenizer

    rng = random.Random(0)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(300)))
    tok = train_tokenizer([str(corpus)], TokenizerSpec(kind="wordpiece", vocab_size=120),
                          tmp_path / "tok")  # fmt: skip
    meta = json.loads((tmp_path / "tok" / "tokenizer_meta.json").read_text())
    cfg = resolve_model_config({"arch": "bert", "preset": "bert-tiny"}, meta["vocab_size"])
    torch.manual_seed(0)
    bundle = save_bundle(tmp_path / "bert", "bert", cfg, build_model("bert", cfg).state_dict(), tok)
    data = {}
    for split, (n, seed) in {"train": (16, 1), "valid": (7, 2), "test": (7, 3)}.items():
        path = tmp_path / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows(n, seed)))
        data[split] = str(path)
    ft = validate_finetune({
        "name": "lines",
        "model": {"source": str(bundle)},
        "task": {"type": "classification", "max_length": 16},
        "data": data,
        "train": {"epochs": 2, "micro_batch_size": 8, "lr": 1e-3, "out_dir": str(tmp_path / "run")},
    })  # fmt: skip
    capsys.readouterr()
    finetune(ft, track=False)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[plm finetune]")]
    steps = [x for x in lines if re.match(r"\[plm finetune\] step \d+: ", x)]
    assert len(steps) == 2, lines  # one evaluation per epoch
    assert " epoch 1 " in steps[0] and " epoch 2 " in steps[1], steps
    best = next(x for x in lines if "best model (valid accuracy " in x)
    test = next(x for x in lines if x.startswith("[plm finetune] test: accuracy "))
    for line in [*steps, best, test]:
        assert not LONG_FLOAT.search(line), line  # 7 valid rows: accuracies like 0.5714285714
