"""Quality filters (pipeline/prepare/quality.py): each rule on hand-made documents that must
pass and must fail, at the papers' default thresholds."""

import pytest

from pipeline.prepare.config import PrepareConfig
from pipeline.prepare.quality import C4, FineWeb, GopherQuality, GopherRepetition, run_filters

GOOD = (
    "The river runs through the old town and past the market square.\n"
    "Every morning the fishermen bring their catch to the stalls by the water.\n"
    "Visitors come to see the bridge, which was built with stone from the hills.\n"
    "In the evening the lights of the cafes shine on the water and people walk slowly home.\n"
    "Nobody in the town remembers a year when the river froze over completely."
)


def judge(text: str, spec, language: str = "en"):
    return run_filters(text, language, [spec])


def rule_of(text: str, spec, language: str = "en") -> str | None:
    return judge(text, spec, language).rule


def web() -> list:
    return PrepareConfig(inputs=["x"], tokenizer="t", output="o", filters="web").filters


def test_a_good_document_passes_every_filter_unchanged():
    result = run_filters(GOOD, "en", web())
    assert result.text == GOOD and result.reason is None and not result.lines_removed


# --- Gopher repetition


def test_gopher_repetition_duplicate_lines_and_paragraphs():
    spec = GopherRepetition()
    line = "Buy the best shoes online today at low prices."
    lines = GOOD.split("\n") + [line] * 4  # 3 of 9 lines repeat one: 33% > 30%
    assert rule_of("\n".join(lines), spec) == "duplicate_lines"
    long_line = "A long line that says the same thing again, " * 4  # 180 characters
    # 2 of 7 lines repeat (29% <= 30%) but they hold over 20% of the characters.
    long_text = "\n".join(GOOD.split("\n") + [long_line.strip()] * 3)
    assert rule_of(long_text, spec) == "duplicate_line_chars"
    # 2 of 4 paragraphs repeat one, but only 2 of 9 lines repeat (22%).
    paras = [GOOD + "\nOne more line.\nAnd another one.", "A short note.", "A short note.",
             "A short note."]  # fmt: skip
    assert rule_of("\n\n".join(paras), spec) == "duplicate_paragraphs"
    assert rule_of(GOOD, spec) is None


def test_gopher_repetition_top_and_duplicate_ngrams():
    spec = GopherRepetition()
    spam = " ".join(["click here"] * 10) + " " + " ".join(f"w{i}x" for i in range(40))
    assert rule_of(spam, spec) == "top_2gram"
    # A 6-word passage said three times among distinct words: no frequent 2-4-gram
    # dominates, but the repeated 5-grams cover too many characters.
    words = [f"word{i}" for i in range(60)]
    passage = "alpha beta gamma delta epsilon zeta"
    text = " ".join(words[:20] + [passage] + words[20:40] + [passage] + words[40:] + [passage])
    assert rule_of(text, spec) == "duplicate_5grams"
    assert rule_of(" ".join(words), spec) is None


# --- Gopher quality


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        ("The cat sat on the mat and looked at the dog.", "too_few_words"),
        (" ".join(["a an of to in it is as at by"] * 6), "short_words"),
        (
            " ".join(["the", "internationalization", "and", "compartmentalization"] * 15),
            "long_words",
        ),
        (GOOD + " #tag #tag #tag #tag #tag #tag #tag #tag #tag #tag", "symbols"),
        ("\n".join(f"- item {i} of the list with the words" for i in range(12)), "bullet_lines"),
        (
            "\n".join(
                f"the story of day {i} goes on with the people of the town..." for i in range(9)
            ),
            "ellipsis_lines",
        ),
        (GOOD + " " + " ".join(["12", "=", "34", "+", "56"] * 8), "non_alphabetic_words"),
        (" ".join(f"apple banana cherry dates river stone {i}" for i in range(10)), "stop_words"),
    ],
)
def test_gopher_quality_rules_fail(text, rule):
    assert rule_of(text, GopherQuality()) == rule


def test_gopher_quality_thresholds_can_be_overridden():
    short = "The cat sat on the mat and looked at the dog."
    assert rule_of(short, GopherQuality(min_words=5)) is None


# --- C4


def test_c4_drops_lines_and_counts_them_by_rule():
    text = "\n".join(
        [
            GOOD,
            "Please enable JavaScript to view the comments.",
            "Read our privacy policy before you sign up for anything.",
            "Home | About | Contact",
            "Short line.",
            "And the last line of the page never ends",
        ]
    )
    result = judge(text, C4())
    assert result.text == GOOD and result.reason is None
    assert result.lines_removed == {
        "c4.javascript": 1,
        "c4.policy": 1,
        "c4.no_terminal_punctuation": 2,
        "c4.too_few_words": 1,
    }


def test_c4_document_rules():
    assert rule_of(GOOD + "\nLorem ipsum dolor sit amet, consectetur.", C4()) == "lorem_ipsum"
    assert rule_of(GOOD + "\nfunction f() { return 1; }", C4()) == "curly_brace"
    two = "The first sentence is here and fine.\nThe second sentence is also fine."
    assert rule_of(two, C4()) == "too_few_sentences"
    assert rule_of("menu\nhome\nlogin", C4()) == "too_few_sentences"  # nothing left
    long_word = judge(GOOD + "\nA line holding a " + "x" * 1001 + " word.", C4())
    assert long_word.text == GOOD and long_word.lines_removed == {"c4.long_word": 1}
    assert rule_of(GOOD, C4()) is None


def test_c4_ellipsis_is_not_terminal_punctuation():
    text = GOOD + "\nAnd then the story goes on and on and on..."
    assert judge(text, C4()).lines_removed == {"c4.no_terminal_punctuation": 1}


# --- FineWeb


def test_fineweb_rules():
    spec = FineWeb()
    menu = "\n".join(f"Section {i} of the long navigation menu here" for i in range(10))
    assert rule_of(menu, spec) == "line_punctuation"
    repeated = GOOD + "\n" + GOOD.split("\n")[3]
    assert rule_of(repeated, spec) == "duplicate_line_chars"
    short = "\n".join(["Yes it is.", "No.", "Fine then.", GOOD.split("\n")[0]])
    assert rule_of(short, spec) == "short_lines"
    assert rule_of(GOOD, spec) is None


def test_fineweb_list_rule():
    spec = FineWeb(max_short_line_fraction=1.0)
    text = "\n".join(f"Item number {i} is on the list of things to buy today." for i in range(3))
    assert rule_of(text, spec) is None
    assert rule_of(text, FineWeb(max_short_line_fraction=1.0, max_newlines_per_word=0.01)) == "list"


# --- languages


def test_rules_apply_only_to_their_languages():
    chinese = "今天天气很好。我们去公园散步吧。"  # one "word" for blank-separated counts
    for spec in web():
        assert rule_of(chinese, spec, "zh") is None  # English rules do not judge Chinese
    assert rule_of(chinese, GopherQuality(), "en") == "too_few_words"
    assert rule_of(chinese, GopherQuality(languages=["*"]), "zh") == "too_few_words"
    assert rule_of(chinese, GopherQuality(languages=["en", "zh"]), "zh") == "too_few_words"


def test_filters_run_in_order_and_the_first_reject_wins():
    text = GOOD + "\nfunction f() { return 1; }"
    result = run_filters(text, "en", [GopherQuality(), C4(), FineWeb()])
    assert (result.reason, result.rule) == ("c4", "curly_brace")


def test_filters_are_deterministic():
    text = GOOD + "\n" + " ".join(["click here"] * 10)
    first = [run_filters(text, "en", web()) for _ in range(3)]
    assert all(r == first[0] for r in first)
