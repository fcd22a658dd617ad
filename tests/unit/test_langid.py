"""Language ID (pipeline/prepare/langid.py) and the config keys that use it."""

import pytest

from pipeline.cli import main
from pipeline.errors import ConfigError
from pipeline.prepare.config import PrepareConfig, load_prepare_config
from pipeline.prepare.langid import identify, known_languages, parse_languages


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("The last bus leaves the station at half past eleven.", "en"),
        ("请问去火车站怎么走？", "zh"),
        ("Der Zug nach München hatte heute wieder Verspätung.", "de"),
        ("すみません、図書館はどこにありますか。", "ja"),
        ("Скажите, пожалуйста, как пройти к библиотеке?", "ru"),
    ],
)
def test_short_texts_get_their_iso_code(text, code):
    assert identify(text) == code


def test_only_the_start_of_a_long_document_is_classified():
    english = "The library will be closed on Monday for maintenance work. " * 100
    assert identify(english + "请问去火车站怎么走？" * 1000) == "en"


def test_language_codes_are_parsed_and_checked():
    assert parse_languages("en, ZH") == ["en", "zh"]
    assert {"en", "zh", "de"} <= set(known_languages())
    cfg = PrepareConfig(inputs=["x"], tokenizer="t", output="o", languages="en,zh")
    assert cfg.languages == ["en", "zh"] and cfg.language_id
    plain = PrepareConfig(inputs=["x"], tokenizer="t", output="o")
    assert not plain.language_id and plain.filters == []
    assert "language_id" not in plain.output_settings()  # old data dirs keep their hash
    assert cfg.output_settings()["languages"] == ["en", "zh"]


def test_config_errors_name_the_key(tmp_path):
    path = tmp_path / "d.yaml"
    path.write_text("filters:\n  - name: c4\n    min_sentence: 2\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"key `filters.0.c4.min_sentence`"):
        load_prepare_config(path, {"inputs": ["x"], "tokenizer": "t", "output": "o"})
    with pytest.raises(ConfigError, match=r"key `filters`.*unknown filter preset 'webb'"):
        load_prepare_config(None, {"inputs": ["x"], "tokenizer": "t", "output": "o",
                                   "filters": "webb"})  # fmt: skip


def test_an_unknown_language_code_is_one_plm_line(tmp_path, capsys):
    code = main(["data", "prepare", "--input", "x", "--tokenizer", "t", "--output",
                 str(tmp_path / "o"), "--languages", "en,xx"])  # fmt: skip
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("plm:")
    assert "languages" in lines[0] and "xx" in lines[0] and "Traceback" not in err
