"""The `web` preset's language choice is explicit: English, as FineWeb keeps English
before it filters (the Gopher, C4 and FineWeb rules are English rules); `--languages`
overrides it (`all` keeps every language); a filter says which languages it skipped."""

import pytest

from pipeline.prepare.config import load_prepare_config
from pipeline.prepare.quality import run_filters

LOREM = (
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor "
    "incididunt ut labore et dolore magna aliqua. Ut enim ad minim veniam, quis nostrud "
    "exercitation ullamco laboris nisi ut aliquip ex ea commodo consequat."
)
BASE = {"inputs": ["x"], "tokenizer": "t", "output": "o"}


def test_the_web_config_keeps_english_only():
    cfg = load_prepare_config("configs/data/web.yaml", dict(BASE))
    assert cfg.languages == ["en"] and cfg.language_id


def test_the_web_preset_alone_keeps_english_only():
    """`--filters web` without a data config: the preset's languages, not every one."""
    cfg = load_prepare_config(None, {**BASE, "filters": "web"})
    assert cfg.languages == ["en"]
    assert cfg.filter_settings()["languages"] == ["en"]  # in the data config hash


@pytest.mark.parametrize("flag,kept", [("en,de", ["en", "de"]), ("all", None), ("*", None)])
def test_languages_overrides_the_preset(flag, kept):
    cfg = load_prepare_config("configs/data/web.yaml", {**BASE, "languages": flag})
    assert cfg.kept_languages() == (None if kept is None else tuple(kept))
    assert cfg.language_id and [f.name for f in cfg.filters][-1] == "fineweb"


def test_all_without_filters_turns_language_id_on_and_keeps_everything():
    cfg = load_prepare_config(None, {**BASE, "languages": "all"})
    assert cfg.language_id and cfg.kept_languages() is None


def test_a_filter_list_keeps_every_language_unless_told():
    cfg = load_prepare_config(None, {**BASE, "filters": ["c4"]})
    assert cfg.kept_languages() is None


def test_run_filters_names_the_filters_a_language_skipped():
    cfg = load_prepare_config(None, {**BASE, "filters": "web"})
    judged = run_filters(LOREM, "la", cfg.filters)
    assert judged.text == LOREM  # nothing judged it
    assert judged.skipped == ["gopher_repetition", "gopher_quality", "c4", "fineweb"]
    assert run_filters(LOREM, "en", cfg.filters).skipped == []
