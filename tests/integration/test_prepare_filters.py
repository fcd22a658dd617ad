"""`plm data prepare` with language ID, `--languages` and the `web` filter preset, end to
end with a real (local) Ray: what lands in the shards, the manifest's counts, inspect."""

import json

import pytest
from conftest import GOOD_DOC as GOOD

from pipeline.cli import main
from pipeline.data.shards import DataDir
from pipeline.prepare.config import load_prepare_config
from pipeline.prepare.prepare import run_prepare
from pipeline.prepare.tokenizer import TokenizerSpec, load_tokenizer, train_tokenizer

pytestmark = pytest.mark.slow

ZH = "今天下午我们去超市买了很多水果。请问去火车站怎么走？他每天早上都会喝一杯热牛奶。第{i}天。"
DE = "Der Zug nach München hatte heute Morgen wieder eine halbe Stunde Verspätung, Nummer {i}."


def documents() -> list[str]:
    docs = [GOOD.format(i=i) for i in range(12)]
    docs[3] += "\nPlease enable JavaScript to see the comments on this page."  # line dropped
    docs[4] += "\nHome | About | Contact"  # line dropped
    docs[5] = docs[5] + "\nfunction f() { return 1; }"  # c4.curly_brace
    docs[6] = "Lorem ipsum dolor sit amet. " + docs[6]  # c4.lorem_ipsum
    docs[7] = "\n".join(["buy cheap shoes online now"] * 12)  # gopher_repetition
    # docs[8] after its dropped line equals docs[9]: the key is the final text's.
    docs[8] = GOOD.format(i=9) + "\nClick here to read our privacy policy and terms."
    docs += [ZH.format(i=i) for i in range(3)] + [DE.format(i=i) for i in range(2)]
    return docs


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("web")
    lines = [json.dumps({"text": d}, ensure_ascii=False) for d in documents()]
    (root / "web.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    spec = TokenizerSpec(kind="wordpiece", vocab_size=400, sample_docs=1000)
    tok = train_tokenizer([str(root / "web.jsonl")], spec, root / "wp")
    return root / "web.jsonl", tok


def test_web_preset_and_languages(ray_local, inputs, tmp_path, capsys):
    corpus, tok = inputs
    overrides = {"inputs": [str(corpus)], "tokenizer": str(tok), "output": str(tmp_path / "d"),
                 "languages": "en,zh", "valid_fraction": 0.0}  # fmt: skip
    cfg = load_prepare_config("configs/data/web.yaml", overrides)
    run_prepare(cfg)
    data = DataDir(tmp_path / "d")
    m = data.manifest
    assert m["rejected"] == {"c4": 2, "duplicate": 1, "gopher_repetition": 1, "language": 2}
    assert m["filter_rules"] == {"c4.curly_brace": 1, "c4.lorem_ipsum": 1,
                                 "gopher_repetition.duplicate_lines": 1}  # fmt: skip
    assert m["lines_removed"] == {"c4.javascript": 1, "c4.no_terminal_punctuation": 1,
                                  "c4.policy": 1}  # fmt: skip
    assert m["totals"]["languages"] == {"en": 8, "zh": 3}
    assert {e["detail"] for e in m["reject_examples"]["language"]} == {"de"}
    assert m["reject_examples"]["c4"][0]["text"].startswith("The river runs")
    # The shards hold the codes; Chinese documents are still segmented as Chinese.
    docs = list(data.iter_split("train"))
    assert sorted({d.meta["language"] for d in docs}) == ["en", "zh"]
    tokenizer, _ = load_tokenizer(data.root / "tokenizer")
    texts = [tokenizer.decode(d.tokens.tolist()) for d in docs]
    assert not any("javascript" in t.lower() or "|" in t for t in texts)  # lines dropped
    capsys.readouterr()
    assert main(["data", "inspect", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "filters     c4" in out and "c4.javascript" in out and "language    language" in out
    assert "en 8 (72.7%)  zh 3 (27.3%)" in out
