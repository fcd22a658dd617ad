"""GLUE and CLUE read from their distributed layouts (a few rows of every task in its exact
format, quirks included), the official metrics against hand computations, and the bad-input
errors naming the file and line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pipeline.eval.benchmarks import CLUE_TASKS, GLUE_TASKS, benchmark_task
from pipeline.finetune.config import FinetuneError
from pipeline.finetune.metrics import binary_f1, matthews_corrcoef

T = "\t"


def tsv(*rows: list[str] | str) -> str:
    return "".join((r if isinstance(r, str) else T.join(r)) + "\n" for r in rows)


def jl(*objs: dict) -> str:
    return "".join(json.dumps(o, ensure_ascii=False) + "\n" for o in objs)


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def pairs(rows: list[dict]) -> list[tuple]:
    return [(r["text"], r.get("text_pair"), r["label"]) for r in rows]


def write_task(root: Path, folder: str, files: dict[str, str]) -> None:
    (root / folder).mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (root / folder / name).write_text(text, encoding="utf-8")


# ----------------------------------------------------------------------------- GLUE

MNLI_HEAD = (
    "index promptID pairID genre sentence1_binary_parse sentence2_binary_parse sentence1_parse "
    "sentence2_parse sentence1 sentence2"
).split()
MNLI_DEV_HEAD = [*MNLI_HEAD, "label1", "label2", "label3", "label4", "label5", "gold_label"]
STSB_HEAD = "index genre filename year old_index source1 source2 sentence1 sentence2 score".split()
QQP_HEAD = "id qid1 qid2 question1 question2 is_duplicate".split()
PAIR_HEAD = "index sentence1 sentence2 label".split()  # RTE, WNLI
MRPC_HEAD = ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"]


def mnli(i: int, s1: str, s2: str, *labels: str) -> list[str]:
    p = "( ( x ) )"
    return [str(i), "31193", f"{i}n", "government", p, p, "(ROOT x)", "(ROOT x)", s1, s2, *labels]


def stsb(i: int, s1: str, s2: str, score: str) -> list[str]:
    return [str(i), "main-captions", "MSRvid", "2012test", f"{i:04d}", "none", "none", s1, s2,
            score]  # fmt: skip


S1 = 'Amrozi accused his brother , whom he called " the witness " , of distorting his evidence .'
S2 = 'Referring to him as only " the witness " , Amrozi accused his brother .'
RTE1 = 'A place of sorrow became a place of celebration, as Roman "Catholic faithful gathered.'
QNLI1 = "Unlike the two seasons before it, Digimon Tamers takes a darker approach."

# task -> ({file: its content}, {split: [(text, pair, label)]})
# fmt: off
GLUE: dict[str, tuple[dict[str, str], dict[str, list[tuple]]]] = {
    # no header; source, label, original mark, sentence; raw unmatched quotes
    "CoLA": ({
        "train.tsv": tsv(
            ["gj04", "1", "", "Our friends won't buy this analysis, let alone the next one."],
            ["gj04", "1", "", "One more pseudo generalization and I'm giving up."],
            ["gj04", "0", "*", 'The more you eat, the less "you want.'],
            ["gj04", "0", "*", "They drank the pub."],
            ["bc01", "1", "", "John said \"hello\" and left, 'quietly."],
        ),
        "dev.tsv": tsv(
            ["gj04", "1", "", "The sailors rode the breeze clear of the rocks."],
            ["gj04", "0", "*", 'The "book was by John written.'],
        )}, {
        "train": [
            ("Our friends won't buy this analysis, let alone the next one.", None, "1"),
            ("One more pseudo generalization and I'm giving up.", None, "1"),
            ('The more you eat, the less "you want.', None, "0"),
            ("They drank the pub.", None, "0"),
            ("John said \"hello\" and left, 'quietly.", None, "1"),
        ],
        "dev": [
            ("The sailors rode the breeze clear of the rocks.", None, "1"),
            ('The "book was by John written.', None, "0"),
        ]},
    ),
    # header sentence\tlabel; the sentences end in a space before the tab
    "SST-2": ({
        "train.tsv": tsv(
            ["sentence", "label"],
            ["hide new secretions from the parental units ", "0"],
            ["contains no wit , only labored gags ", "0"],
            ["that loves its characters and communicates something rather beautiful ", "1"],
            ['the " greatest musicians " ', "1"],
            ["demonstrates that the director can still turn out a small film ", "1"],
        ),
        "dev.tsv": tsv(
            ["sentence", "label"],
            ["it 's a charming and often affecting journey . ", "1"],
            ["unflinchingly bleak and desperate ", "0"],
        )}, {
        "train": [
            ("hide new secretions from the parental units ", None, "0"),
            ("contains no wit , only labored gags ", None, "0"),
            ("that loves its characters and communicates something rather beautiful ", None, "1"),
            ('the " greatest musicians " ', None, "1"),
            ("demonstrates that the director can still turn out a small film ", None, "1"),
        ],
        "dev": [
            ("it 's a charming and often affecting journey . ", None, "1"),
            ("unflinchingly bleak and desperate ", None, "0"),
        ]},
    ),
    # the header starts with a byte-order mark (copied from Microsoft's file)
    "MRPC": ({
        "train.tsv": "\ufeff" + tsv(
            MRPC_HEAD,
            ["1", "702876", "702977", S1, S2],
            ["0", "2108705", "2108831", "Yucaipa owned Dominick 's .", "Yucaipa bought it ."],
            ["1", "1330381", "1330521", "They published an ad .", "On June 10 , they did ."],
        ),
        "dev.tsv": "\ufeff" + tsv(
            MRPC_HEAD,
            ["1", "1355540", "1355592", "He said it does n't fit .",
             '" It does not fit , " he said .'],
            ["0", "2029631", "2029565", "Magnarelli hated it .", 'He was " 100 percent behind " .'],
        )}, {
        "train": [
            (S1, S2, "1"),
            ("Yucaipa owned Dominick 's .", "Yucaipa bought it .", "0"),
            ("They published an ad .", "On June 10 , they did .", "1"),
        ],
        "dev": [
            ("He said it does n't fit .", '" It does not fit , " he said .', "1"),
            ("Magnarelli hated it .", 'He was " 100 percent behind " .', "0"),
        ]},
    ),
    # 10 columns, the sentences in 8 and 9, the score (0-5) last
    "STS-B": ({
        "train.tsv": tsv(
            STSB_HEAD,
            stsb(1, "A plane is taking off.", "An air plane is taking off.", "5.000"),
            stsb(4, "A man is playing a large flute.", "A man is playing a flute.", "3.800"),
            stsb(10, 'He said "no.', "He didn't agree.", "0.500"),
        ),
        "dev.tsv": tsv(
            STSB_HEAD,
            stsb(0, "A man with a hard hat is dancing.", "A man in a hard hat dances.", "5.000"),
            stsb(2, "A young child is riding a horse.", "A child is riding a horse.", "4.750"),
        )}, {
        "train": [
            ("A plane is taking off.", "An air plane is taking off.", 5.0),
            ("A man is playing a large flute.", "A man is playing a flute.", 3.8),
            ('He said "no.', "He didn't agree.", 0.5),
        ],
        "dev": [
            ("A man with a hard hat is dancing.", "A man in a hard hat dances.", 5.0),
            ("A young child is riding a horse.", "A child is riding a horse.", 4.75),
        ]},
    ),
    # a question holding a newline breaks its row in two (4 and 2 fields): both skipped
    "QQP": ({
        "train.tsv": tsv(
            QQP_HEAD,
            ["133273", "213221", "213222", "How is the life of a math student?",
             "Which level of prepration is enough for the exam jlpt5?", "0"],
            ["402555", "536040", "536041", "How do I control my emotions?", "How to control them?",
             "1"],
            ["105780", "174363", "174364", "How can I develop android app?"],
            ["", "0"],
            ["360472", "364011", "490273", 'What does "a 7 mean?', "What is 7?", "0"],
            ["150662", "155721", "7256", "How do I learn Python?", "Best way to learn Python?",
             "1"],
        ),
        "dev.tsv": tsv(
            QQP_HEAD,
            ["40", "80", "81", "Why are people obsessed with cats?", "Why do people love cats?",
             "1"],
            ["41", "82", "83", "What is 2+2?", "What is the capital of France?", "0"],
        )}, {
        "train": [
            ("How is the life of a math student?",
             "Which level of prepration is enough for the exam jlpt5?", "0"),
            ("How do I control my emotions?", "How to control them?", "1"),
            ('What does "a 7 mean?', "What is 7?", "0"),
            ("How do I learn Python?", "Best way to learn Python?", "1"),
        ],
        "dev": [
            ("Why are people obsessed with cats?", "Why do people love cats?", "1"),
            ("What is 2+2?", "What is the capital of France?", "0"),
        ]},
    ),
    # train: label1 + gold_label (12 columns); dev: label1..label5 + gold_label (16)
    "MNLI": ({
        "train.tsv": tsv(
            [*MNLI_HEAD, "label1", "gold_label"],
            mnli(0, "Cream skimming has two basic dimensions.", "Product and geography work. ",
                 "neutral", "neutral"),
            mnli(1, "you know during the season i guess", 'You lose the "things.',
                 "entailment", "entailment"),
            mnli(2, "One of our number will carry out your instructions.",
                 "A member of my team will execute your orders.", "contradiction", "contradiction"),
        ),
        "dev_matched.tsv": tsv(
            MNLI_DEV_HEAD,
            mnli(0, "The new rights are nice enough", "Everyone really likes the rights.",
                 "neutral", "entailment", "neutral", "neutral", "neutral", "neutral"),
            mnli(1, "This site includes a list.", "The site has a list.", *["entailment"] * 6),
        ),
        "dev_mismatched.tsv": tsv(
            MNLI_DEV_HEAD,
            mnli(0, "Your contribution helped.", "It did nothing.", *["contradiction"] * 6),
        )}, {
        "train": [
            ("Cream skimming has two basic dimensions.", "Product and geography work. ", "neutral"),
            ("you know during the season i guess", 'You lose the "things.', "entailment"),
            ("One of our number will carry out your instructions.",
             "A member of my team will execute your orders.", "contradiction"),
        ],
        "matched": [
            ("The new rights are nice enough", "Everyone really likes the rights.", "neutral"),
            ("This site includes a list.", "The site has a list.", "entailment"),
        ],
        "mismatched": [("Your contribution helped.", "It did nothing.", "contradiction")]},
    ),
    "QNLI": ({
        "train.tsv": tsv(
            "index question sentence label".split(),
            ["0", "When did the third Digimon series begin?", QNLI1, "not_entailment"],
            ["1", "Which batteries have launchers?", "MANPADS batteries have them.", "entailment"],
            ["2", 'What is "the name?', "The name is X.", "entailment"],
        ),
        "dev.tsv": tsv(
            "index question sentence label".split(),
            ["0", "What came into force?", "The new constitution came into force.", "entailment"],
            ["1", "Who wrote it?", "It was a \"long night.", "not_entailment"],
        )}, {
        "train": [
            ("When did the third Digimon series begin?", QNLI1, "not_entailment"),
            ("Which batteries have launchers?", "MANPADS batteries have them.", "entailment"),
            ('What is "the name?', "The name is X.", "entailment"),
        ],
        "dev": [
            ("What came into force?", "The new constitution came into force.", "entailment"),
            ("Who wrote it?", 'It was a "long night.', "not_entailment"),
        ]},
    ),
    "RTE": ({
        "train.tsv": tsv(
            PAIR_HEAD,
            ["0", "No Weapons of Mass Destruction Found in Iraq Yet.",
             "Weapons of Mass Destruction Found in Iraq.", "not_entailment"],
            ["1", RTE1, "Pope Benedict XVI is the new leader of the Church.", "entailment"],
            ["2", "Herceptin was already approved.", "Herceptin can be used.", "entailment"],
        ),
        "dev.tsv": tsv(
            PAIR_HEAD,
            ["0", "Dana Reeve, the widow of the actor, died at 44.", "Reeve had an accident.",
             "not_entailment"],
            ["1", "Yet, we now are discovering that antibiotics are losing.", "Bacteria win.",
             "entailment"],
        )}, {
        "train": [
            ("No Weapons of Mass Destruction Found in Iraq Yet.",
             "Weapons of Mass Destruction Found in Iraq.", "not_entailment"),
            (RTE1, "Pope Benedict XVI is the new leader of the Church.", "entailment"),
            ("Herceptin was already approved.", "Herceptin can be used.", "entailment"),
        ],
        "dev": [
            ("Dana Reeve, the widow of the actor, died at 44.", "Reeve had an accident.",
             "not_entailment"),
            ("Yet, we now are discovering that antibiotics are losing.", "Bacteria win.",
             "entailment"),
        ]},
    ),
    "WNLI": ({
        "train.tsv": tsv(
            PAIR_HEAD,
            ["0", "I stuck a pin through a carrot. When I pulled the pin out, it had a hole.",
             "The carrot had a hole.", "1"],
            ["1", "John couldn't see the stage with Billy in front of him because he is so short.",
             "John is so short.", "1"],
            ["2", 'The "trophy doesn\'t fit into the suitcase because it is too large.',
             "The suitcase is too large.", "0"],
        ),
        "dev.tsv": tsv(
            PAIR_HEAD,
            ["0", "The drain is clogged with hair. It has to be cleaned.",
             "The hair has to be cleaned.", "0"],
            ["1", "Jane knocked on Susan's door but she did not answer.", "Susan did not answer.",
             "1"],
        )}, {
        "train": [
            ("I stuck a pin through a carrot. When I pulled the pin out, it had a hole.",
             "The carrot had a hole.", "1"),
            ("John couldn't see the stage with Billy in front of him because he is so short.",
             "John is so short.", "1"),
            ('The "trophy doesn\'t fit into the suitcase because it is too large.',
             "The suitcase is too large.", "0"),
        ],
        "dev": [
            ("The drain is clogged with hair. It has to be cleaned.", "The hair has to be cleaned.",
             "0"),
            ("Jane knocked on Susan's door but she did not answer.", "Susan did not answer.", "1"),
        ]},
    ),
}
# fmt: on


def test_every_glue_task_has_rows_here():
    assert tuple(GLUE) == GLUE_TASKS


@pytest.mark.parametrize("task", GLUE_TASKS)
def test_glue_task_rows(tmp_path, task):
    files, expected = GLUE[task]
    write_task(tmp_path / "glue_data", task, files)
    bt = benchmark_task("glue", task, tmp_path / "glue_data", tmp_path / "out")
    assert bt.benchmark == "glue" and bt.name == task
    assert bt.train == tmp_path / "out" / "glue" / task / "train.jsonl"
    assert set(bt.evals) == set(expected) - {"train"}
    got = {"train": pairs(read(bt.train))} | {k: pairs(read(p)) for k, p in bt.evals.items()}
    assert got == expected
    assert (bt.text_column, bt.label_column) == ("text", "label")
    single = task in ("CoLA", "SST-2")
    assert bt.text_pair_column == (None if single else "text_pair")
    assert all(("text_pair" in r) != single for r in read(bt.train))
    assert set(bt.skipped) == {f"{task}/{f}" for f in files}
    assert bt.skipped == {
        f"{task}/{f}": 2 if (task, f) == ("QQP", "train.tsv") else 0 for f in files
    }


@pytest.mark.parametrize(
    "task,kind,metrics,positive",
    [
        ("CoLA", "classification", ("mcc",), None),
        ("SST-2", "classification", ("accuracy",), None),
        ("MRPC", "classification", ("f1", "accuracy"), "1"),
        ("STS-B", "regression", ("pearson", "spearman"), None),
        ("QQP", "classification", ("f1", "accuracy"), "1"),
        ("MNLI", "classification", ("accuracy",), None),
        ("QNLI", "classification", ("accuracy",), None),
        ("RTE", "classification", ("accuracy",), None),
        ("WNLI", "classification", ("accuracy",), None),
    ],
)
def test_glue_task_types_and_official_metrics(tmp_path, task, kind, metrics, positive):
    write_task(tmp_path, task, GLUE[task][0])
    bt = benchmark_task("glue", task, tmp_path, tmp_path / "out")
    assert (bt.type, bt.metrics, bt.positive_label) == (kind, metrics, positive)


def test_stsb_scores_are_floats_and_labels_strings(tmp_path):
    for task in ("STS-B", "WNLI"):
        write_task(tmp_path, task, GLUE[task][0])
    assert all(
        isinstance(r["label"], float)
        for r in read(benchmark_task("glue", "STS-B", tmp_path, tmp_path / "o").train)
    )
    assert all(
        isinstance(r["label"], str)
        for r in read(benchmark_task("glue", "WNLI", tmp_path, tmp_path / "o").train)
    )


def test_a_lone_carriage_return_stays_inside_a_sentence(tmp_path):
    write_task(
        tmp_path,
        "SST-2",
        {
            "train.tsv": "sentence\tlabel\r\na \r b\t1\r\nc\t0\r\n",
            "dev.tsv": "sentence\tlabel\nd\t1\n",
        },
    )
    rows = read(benchmark_task("glue", "sst-2", tmp_path, tmp_path / "o").train)
    assert pairs(rows) == [("a \r b", None, "1"), ("c", None, "0")]


# ----------------------------------------------------------------------------- CLUE

WSC_TEXT = "这时候放在床上枕头旁边的手机响了，我感到奇怪，因为欠费已被停机两个月，现在它突然响了。"


def wsc(s1: str, i1: int, s2: str, i2: int, idx: int, label: str, text: str) -> dict:
    return {"target": {"span2_index": i2, "span1_index": i1, "span1_text": s1, "span2_text": s2},
            "idx": idx, "label": label, "text": text}  # fmt: skip


def ocnli(s1: str, s2: str, label: str, i: int, votes: list[str] | None = None) -> dict:
    row = {"level": "medium", "sentence1": s1, "sentence2": s2, "label": label, "genre": "lit",
           "prem_id": f"lit_{i}", "id": i}  # fmt: skip
    return row | {f"label{k}": v for k, v in enumerate(votes or [])}


def pair(s1: str, s2: str, label: str) -> dict:
    return {"sentence1": s1, "sentence2": s2, "label": label}


# task -> (its folder as CLUE distributes it, {file: content}, {split: [(text, pair, label)]})
# fmt: off
CLUE: dict[str, tuple[str, dict[str, str], dict[str, list[tuple]]]] = {
    "AFQMC": ("afqmc", {
        "train.json": jl(
            pair("蚂蚁借呗等额还款可以换成先息后本吗", "借呗有先息到期还本吗", "0"),
            pair("蚂蚁花呗说我违约一次", "蚂蚁花呗违约行为是什么", "0"),
            pair("帮我看一下本月花呗账单有没有结清", "下月花呗账单", "1"),
        ),
        "dev.json": jl(
            pair("双十一花呗提额在哪", "里可以提花呗额度", "0"),
            pair("花呗怎么还款", "花呗如何还钱", "1"),
        )}, {
        "train": [
            ("蚂蚁借呗等额还款可以换成先息后本吗", "借呗有先息到期还本吗", "0"),
            ("蚂蚁花呗说我违约一次", "蚂蚁花呗违约行为是什么", "0"),
            ("帮我看一下本月花呗账单有没有结清", "下月花呗账单", "1"),
        ],
        "dev": [
            ("双十一花呗提额在哪", "里可以提花呗额度", "0"),
            ("花呗怎么还款", "花呗如何还钱", "1"),
        ]},
    ),
    "TNEWS": ("tnews", {
        "train.json": jl(
            {"label": "102", "label_desc": "news_entertainment",
             "sentence": "江疏影甜甜圈自拍，迷之角度竟这么好看", "keywords": "江疏影,甜甜圈"},
            {"label": "110", "label_desc": "news_military", "sentence": "以色列大规模空袭开始！",
             "keywords": ""},
            {"label": "104", "label_desc": "news_finance", "sentence": "出栏一头猪亏损300元",
             "keywords": "商品猪,养猪"},
        ),
        "dev.json": jl(
            {"label": "102", "label_desc": "news_entertainment", "sentence": "看完《少年的你》",
             "keywords": "易烊千玺"},
            {"label": "104", "label_desc": "news_finance", "sentence": "股市收盘", "keywords": ""},
        )}, {
        "train": [
            ("江疏影甜甜圈自拍，迷之角度竟这么好看", None, "102"),
            ("以色列大规模空袭开始！", None, "110"),
            ("出栏一头猪亏损300元", None, "104"),
        ],
        "dev": [("看完《少年的你》", None, "102"), ("股市收盘", None, "104")]},
    ),
    "IFLYTEK": ("iflytek", {
        "train.json": jl(
            {"label": "11", "label_des": "薅羊毛", "sentence": '3分钟赚零花钱的"软件'},
            {"label": "15", "label_des": "银行", "sentence": "移动银行，随时随地"},
            {"label": "11", "label_des": "薅羊毛", "sentence": "每天签到领金币"},
        ),
        "dev.json": jl(
            {"label": "15", "label_des": "银行", "sentence": "手机银行客户端"},
            {"label": "11", "label_des": "薅羊毛", "sentence": "看视频赚钱"},
        )}, {
        "train": [
            ('3分钟赚零花钱的"软件', None, "11"),
            ("移动银行，随时随地", None, "15"),
            ("每天签到领金币", None, "11"),
        ],
        "dev": [("手机银行客户端", None, "15"), ("看视频赚钱", None, "11")]},
    ),
    # "-": the annotators reached no majority; left out and counted
    "CMNLI": ("cmnli", {
        "train.json": jl(
            pair("从概念上讲，奶油略读有两个基本维度-产品和地理。", "产品和地理位置是原因。",
                 "neutral"),
            pair("你知道在这个季节，我猜", "如果人们回忆起来，你就会失去", "entailment"),
            pair("我们的一个号码会非常详细地执行你的指示。", "我团队的一名成员", "-"),
            pair("你怎么知道的？", "这些信息属于他们。", "contradiction"),
        ),
        "dev.json": jl(
            pair("新的权利已经足够好了", "每个人都很喜欢最新的福利", "neutral"),
            pair("这一切都很好", "没有人", "-"),
        )}, {
        "train": [
            ("从概念上讲，奶油略读有两个基本维度-产品和地理。", "产品和地理位置是原因。",
             "neutral"),
            ("你知道在这个季节，我猜", "如果人们回忆起来，你就会失去", "entailment"),
            ("你怎么知道的？", "这些信息属于他们。", "contradiction"),
        ],
        "dev": [("新的权利已经足够好了", "每个人都很喜欢最新的福利", "neutral")]},
    ),
    # dev rows carry the five annotators' votes label0..label4 besides the label
    "OCNLI": ("ocnli", {
        "train.json": jl(
            ocnli("一月份跟二月份肯定有一个月份有.", "肯定有一个月份有", "entailment", 0),
            ocnli("一月份跟二月份肯定有一个月份有.", "一月份有", "neutral", 1),
            ocnli("严冬和酷暑", "夏天很冷", "contradiction", 2),
        ),
        "dev.json": jl(
            ocnli("身上裹一件工厂发的棉大衣", "她穿着大衣", "-", 635,
                  ["contradiction", "neutral", "entailment", "neutral", "contradiction"]),
            ocnli("那是一个晴天", "天气很好", "entailment", 7, ["entailment"] * 5),
        )}, {
        "train": [
            ("一月份跟二月份肯定有一个月份有.", "肯定有一个月份有", "entailment"),
            ("一月份跟二月份肯定有一个月份有.", "一月份有", "neutral"),
            ("严冬和酷暑", "夏天很冷", "contradiction"),
        ],
        "dev": [("那是一个晴天", "天气很好", "entailment")]},
    ),
    # text: the abstract; pair: its keywords joined with "，"
    "CSL": ("csl", {
        "train.json": jl(
            {"id": 1, "abst": "为解决传统均匀FFT波束形成算法引起的3维声呐成像分辨率降低的问题",
             "keyword": ["水声学", "FFT", "波束形成", "3维成像声呐"], "label": "1"},
            {"id": 2, "abst": "研究了一种基于卷积神经网络的目标识别方法",
             "keyword": ["深度学习", "红外图像"], "label": "0"},
            {"id": 3, "abst": "分析了高速列车的气动噪声", "keyword": ["气动噪声", "列车"],
             "label": "1"},
        ),
        "dev.json": jl(
            {"id": 4, "abst": "提出一种新的聚类算法", "keyword": ["聚类"], "label": "1"},
            {"id": 5, "abst": "讨论了土壤的含水量", "keyword": ["水稻", "基因"], "label": "0"},
        )}, {
        "train": [
            ("为解决传统均匀FFT波束形成算法引起的3维声呐成像分辨率降低的问题",
             "水声学，FFT，波束形成，3维成像声呐", "1"),
            ("研究了一种基于卷积神经网络的目标识别方法", "深度学习，红外图像", "0"),
            ("分析了高速列车的气动噪声", "气动噪声，列车", "1"),
        ],
        "dev": [("提出一种新的聚类算法", "聚类", "1"), ("讨论了土壤的含水量", "水稻，基因", "0")]},
    ),
    # CLUE's folder is cluewsc2020; pair: "<span2>指的是<span1>"
    "WSC": ("cluewsc2020", {
        "train.json": jl(
            wsc("床", 5, "它", 37, 261, "false", WSC_TEXT),
            wsc("手机", 13, "它", 37, 262, "true", WSC_TEXT),
            wsc("小红", 6, "她", 9, 263, "false", "小明把书给了小红，因为她看完了。"),
        ),
        "dev.json": jl(
            wsc("小明", 0, "他", 9, 1, "true", "小明把书给了小红，因为他看完了。"),
            wsc("桌子", 2, "它", 9, 2, "false", "猫跳上桌子，因为它饿了。"),
        )}, {
        "train": [
            (WSC_TEXT, "它指的是床", "false"),
            (WSC_TEXT, "它指的是手机", "true"),
            ("小明把书给了小红，因为她看完了。", "她指的是小红", "false"),
        ],
        "dev": [
            ("小明把书给了小红，因为他看完了。", "他指的是小明", "true"),
            ("猫跳上桌子，因为它饿了。", "它指的是桌子", "false"),
        ]},
    ),
}
# fmt: on


def test_every_clue_task_has_rows_here():
    assert tuple(CLUE) == CLUE_TASKS


@pytest.mark.parametrize("task", CLUE_TASKS)
def test_clue_task_rows(tmp_path, task):
    folder, files, expected = CLUE[task]
    write_task(tmp_path / "clue", folder, files)
    bt = benchmark_task("clue", task, tmp_path / "clue", tmp_path / "out")
    assert (bt.benchmark, bt.name, bt.type, bt.metrics) == (
        "clue",
        task,
        "classification",
        ("accuracy",),
    )
    assert bt.positive_label is None
    assert bt.train == tmp_path / "out" / "clue" / task / "train.jsonl"
    assert set(bt.evals) == {"dev"}
    got = {"train": pairs(read(bt.train)), "dev": pairs(read(bt.evals["dev"]))}
    assert got == expected
    assert bt.text_pair_column == (None if task in ("TNEWS", "IFLYTEK") else "text_pair")
    dashes = {"CMNLI": {"train.json": 1, "dev.json": 1}, "OCNLI": {"dev.json": 1}}.get(task, {})
    assert bt.skipped == {f"{folder}/{f}": dashes.get(f, 0) for f in files}


@pytest.mark.parametrize("folder", ["AFQMC", "afqmc_public"])
def test_clue_folder_names_upper_case_and_as_zipped(tmp_path, folder):
    write_task(tmp_path, folder, CLUE["AFQMC"][1])
    bt = benchmark_task("clue", "afqmc", tmp_path, tmp_path / "out")
    assert len(read(bt.train)) == 3 and bt.skipped == {
        f"{folder}/train.json": 0,
        f"{folder}/dev.json": 0,
    }


def test_wsc_json_booleans_and_the_wsc_folder_name(tmp_path):
    row = json.loads(CLUE["WSC"][1]["train.json"].splitlines()[0])
    write_task(
        tmp_path,
        "wsc",
        {
            "train.json": jl(row | {"label": False}, row | {"label": True}),
            "dev.json": jl(row | {"label": "true"}),
        },
    )
    bt = benchmark_task("clue", "CLUEWSC2020", tmp_path, tmp_path / "out")
    assert bt.name == "WSC"
    assert [r["label"] for r in read(bt.train)] == ["false", "true"]


# ----------------------------------------------------------------------------- metrics


def test_mcc_binary_by_hand():
    pred = [1, 1, 0, 0, 1, 0, 1, 1]
    gold = [1, 0, 0, 0, 1, 1, 1, 0]
    tp, fp, tn, fn = 3, 2, 2, 1  # positions 0,4,6 | 1,7 | 2,3 | 5
    want = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert want == pytest.approx(4 / math.sqrt(240))
    assert matthews_corrcoef(pred, gold) == pytest.approx(want)
    # symmetric in the two classes' names
    flip = [1 - x for x in pred], [1 - x for x in gold]
    assert matthews_corrcoef(*flip) == pytest.approx(want)


def test_mcc_multiclass_by_the_k_class_formula():
    gold = [0, 0, 1, 1, 2, 2]
    pred = [0, 1, 1, 1, 2, 0]
    # gold counts t = (2, 2, 2), predicted counts p = (2, 3, 1), correct c = 1+2+1 = 4, s = 6
    t, p, c, s = (2, 2, 2), (2, 3, 1), 4, 6
    tp_dot = sum(a * b for a, b in zip(t, p, strict=True))  # 4 + 6 + 2 = 12
    num = c * s - tp_dot  # 24 - 12 = 12
    den = (s * s - sum(x * x for x in p)) * (s * s - sum(x * x for x in t))  # (36-14)*(36-12)
    assert (num, den) == (12, 22 * 24)
    assert matthews_corrcoef(pred, gold) == pytest.approx(12 / math.sqrt(528))
    # class ids need not be 0..K-1
    remap = {0: 7, 1: 3, 2: 10}
    assert matthews_corrcoef([remap[x] for x in pred], [remap[x] for x in gold]) == pytest.approx(
        12 / math.sqrt(528)
    )


def test_mcc_degenerate_cases():
    assert matthews_corrcoef([], []) == 0.0
    assert matthews_corrcoef([1, 1, 1, 1], [0, 1, 0, 1]) == 0.0  # one class predicted
    assert matthews_corrcoef([0, 1, 0, 1], [1, 1, 1, 1]) == 0.0  # one class in gold
    assert matthews_corrcoef([0, 1, 2, 0], [0, 1, 2, 0]) == pytest.approx(1.0)
    assert matthews_corrcoef([1, 0, 1, 0], [0, 1, 0, 1]) == pytest.approx(-1.0)
    with pytest.raises(ValueError):
        matthews_corrcoef([0, 1], [0])


def test_binary_f1_by_hand():
    pred = [1, 1, 0, 0, 1, 0, 1, 1]
    gold = [1, 0, 0, 0, 1, 1, 1, 0]
    # positive 1: tp=3, fp=2, fn=1 -> precision 3/5, recall 3/4, F1 = 2*3/(2*3+2+1) = 6/9
    prec, rec = 3 / 5, 3 / 4
    assert 2 * prec * rec / (prec + rec) == pytest.approx(6 / 9)
    assert binary_f1(pred, gold, positive=1) == pytest.approx(6 / 9)
    # positive 0: tp=2, fp=1, fn=2 -> 2*2/(4+1+2) = 4/7
    assert binary_f1(pred, gold, positive=0) == pytest.approx(4 / 7)


def test_binary_f1_degenerate_cases():
    assert binary_f1([], [], positive=1) == 0.0
    assert binary_f1([0, 0], [0, 0], positive=1) == 0.0  # never predicted nor gold
    assert binary_f1([1, 1], [0, 0], positive=1) == 0.0  # predicted, never right
    assert binary_f1([0, 0], [1, 1], positive=1) == 0.0  # gold, never found
    assert binary_f1([1, 0], [1, 0], positive=1) == 1.0


# ----------------------------------------------------------------------------- errors


def error(*args) -> str:
    with pytest.raises(FinetuneError) as err:
        benchmark_task(*args)
    return str(err.value)


def test_missing_benchmark_folder(tmp_path):
    msg = error("glue", "CoLA", tmp_path / "nope", tmp_path / "o")
    assert str(tmp_path / "nope") in msg and "glue_data/" in msg


def test_missing_task_folder_says_where_the_layout_expects_it(tmp_path):
    (tmp_path / "glue_data").mkdir()
    msg = error("glue", "RTE", tmp_path / "glue_data", tmp_path / "o")
    assert str(tmp_path / "glue_data" / "RTE") in msg
    msg = error("clue", "WSC", tmp_path / "glue_data", tmp_path / "o")
    assert str(tmp_path / "glue_data" / "wsc") in msg and "cluewsc2020" in msg


def test_a_task_folder_given_as_the_benchmark_folder_is_explained(tmp_path):
    write_task(tmp_path, "RTE", GLUE["RTE"][0])
    msg = error("glue", "RTE", tmp_path / "RTE", tmp_path / "o")
    assert "pass its parent" in msg


@pytest.mark.parametrize(
    "bench,task,missing",
    [
        ("glue", "MNLI", "dev_mismatched.tsv"),
        ("glue", "CoLA", "dev.tsv"),
        ("clue", "CSL", "train.json"),
    ],
)
def test_missing_file_names_it_and_the_layout(tmp_path, bench, task, missing):
    files = GLUE[task][0] if bench == "glue" else CLUE[task][1]
    folder = task if bench == "glue" else CLUE[task][0]
    write_task(tmp_path, folder, {k: v for k, v in files.items() if k != missing})
    msg = error(bench, task, tmp_path, tmp_path / "o")
    assert f"{tmp_path / folder / missing} is missing" in msg


def test_unknown_task_names_suggest_the_right_one(tmp_path):
    msg = error("glue", "SST2", tmp_path, tmp_path / "o")
    assert "'SST-2'" in msg and "did you mean" in msg and "CoLA" in msg and "WNLI" in msg
    assert "'STS-B'" in error("glue", "stsb", tmp_path, tmp_path / "o")
    assert "'IFLYTEK'" in error("clue", "IFLYTK", tmp_path, tmp_path / "o")
    msg = error("glue", "AFQMC", tmp_path, tmp_path / "o")
    assert "CLUE task" in msg and "benchmark clue" in msg
    assert "span QA" in error("clue", "CMRC2018", tmp_path, tmp_path / "o")
    msg = error("glue", "nonsense", tmp_path, tmp_path / "o")
    assert "did you mean" not in msg and "CoLA, SST-2, MRPC" in msg
    assert "glue, clue" in error("superglue", "RTE", tmp_path, tmp_path / "o")


def test_a_row_with_a_missing_column_names_file_and_line(tmp_path):
    files = dict(GLUE["RTE"][0])
    files["train.tsv"] += "7\tonly one sentence\tnot_entailment\n"  # line 5: 3 fields of 4
    write_task(tmp_path, "RTE", files)
    msg = error("glue", "RTE", tmp_path, tmp_path / "o")
    assert f"{tmp_path / 'RTE' / 'train.tsv'}:5:" in msg and "3 tab-separated" in msg


def test_a_cola_row_short_of_its_four_columns(tmp_path):
    files = dict(GLUE["CoLA"][0])
    files["dev.tsv"] = "gj04\t1\tno sentence column\n"
    write_task(tmp_path, "CoLA", files)
    assert f"{tmp_path / 'CoLA' / 'dev.tsv'}:1:" in error("glue", "CoLA", tmp_path, tmp_path / "o")


def test_a_clue_row_with_a_missing_field_names_file_and_line(tmp_path):
    files = dict(CLUE["AFQMC"][1])
    files["dev.json"] += jl({"sentence1": "只有一句", "label": "1"})
    write_task(tmp_path, "afqmc", files)
    msg = error("clue", "AFQMC", tmp_path, tmp_path / "o")
    assert f"{tmp_path / 'afqmc' / 'dev.json'}:3:" in msg and "'sentence2'" in msg
    files = dict(CLUE["WSC"][1])
    files["train.json"] += jl(
        {"target": {"span1_text": "床"}, "idx": 3, "label": "true", "text": "床"}
    )
    write_task(tmp_path, "cluewsc2020", files)
    msg = error("clue", "WSC", tmp_path, tmp_path / "o")
    assert f"{tmp_path / 'cluewsc2020' / 'train.json'}:4:" in msg and "span2_text" in msg


def test_a_non_numeric_or_out_of_range_stsb_score(tmp_path):
    for bad in ("n/a", "7.5"):
        files = dict(GLUE["STS-B"][0])
        files["dev.tsv"] += (
            T.join(["9", "main-news", "x", "2015", "0", "none", "none", "a", "b", bad]) + "\n"
        )
        write_task(tmp_path, "STS-B", files)
        msg = error("glue", "STS-B", tmp_path, tmp_path / "o")
        assert f"{tmp_path / 'STS-B' / 'dev.tsv'}:4:" in msg and repr(bad) in msg


def test_a_dev_label_train_never_has(tmp_path):
    files = dict(GLUE["QNLI"][0])
    files["dev.tsv"] += "1\tq?\ts.\tmaybe\n"
    write_task(tmp_path, "QNLI", files)
    msg = error("glue", "QNLI", tmp_path, tmp_path / "o")
    assert f"{tmp_path / 'QNLI' / 'dev.tsv'}:4:" in msg and "'maybe'" in msg
    assert str(tmp_path / "QNLI" / "train.tsv") in msg
    files = dict(CLUE["TNEWS"][1])
    files["dev.json"] = jl(
        {"label": "116", "label_desc": "news_game", "sentence": "游戏", "keywords": ""}
    )
    write_task(tmp_path, "tnews", files)
    msg = error("clue", "TNEWS", tmp_path, tmp_path / "o")
    assert f"{tmp_path / 'tnews' / 'dev.json'}:1:" in msg and "'116'" in msg


@pytest.mark.parametrize("content,says", [("", "is empty"), ("sentence\tlabel\n", "no rows")])
def test_an_empty_file(tmp_path, content, says):
    write_task(tmp_path, "SST-2", {"train.tsv": GLUE["SST-2"][0]["train.tsv"], "dev.tsv": content})
    msg = error("glue", "SST-2", tmp_path, tmp_path / "o")
    assert str(tmp_path / "SST-2" / "dev.tsv") in msg and says in msg


def test_an_empty_clue_file(tmp_path):
    write_task(tmp_path, "csl", {"train.json": "", "dev.json": CLUE["CSL"][1]["dev.json"]})
    msg = error("clue", "CSL", tmp_path, tmp_path / "o")
    assert f"{tmp_path / 'csl' / 'train.json'} is empty" in msg


def test_a_file_of_only_skipped_rows(tmp_path):
    head = "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
    write_task(
        tmp_path,
        "QQP",
        {"train.tsv": GLUE["QQP"][0]["train.tsv"], "dev.tsv": head + "1\t2\t3\tbroken\n"},
    )
    msg = error("glue", "QQP", tmp_path, tmp_path / "o")
    assert str(tmp_path / "QQP" / "dev.tsv") in msg and "all 1 were skipped" in msg


def test_a_wrong_header_and_bad_json(tmp_path):
    files = dict(GLUE["MRPC"][0])
    files["dev.tsv"] = tsv(["label", "a", "b", "s1", "s2"], ["1", "1", "2", "x", "y"])
    write_task(tmp_path, "MRPC", files)
    msg = error("glue", "MRPC", tmp_path, tmp_path / "o")
    assert f"{tmp_path / 'MRPC' / 'dev.tsv'}:1:" in msg and "'Quality'" in msg
    files = dict(CLUE["IFLYTEK"][1])
    files["train.json"] += '{"label": "11", "sentence": \n'
    write_task(tmp_path, "iflytek", files)
    msg = error("clue", "IFLYTEK", tmp_path, tmp_path / "o")
    assert f"{tmp_path / 'iflytek' / 'train.json'}:4:" in msg and "not valid JSON" in msg


def test_a_file_that_is_not_utf8(tmp_path):
    write_task(tmp_path, "WNLI", GLUE["WNLI"][0])
    (tmp_path / "WNLI" / "dev.tsv").write_bytes(
        b"index\tsentence1\tsentence2\tlabel\n0\t\xff\tb\t1\n"
    )
    msg = error("glue", "WNLI", tmp_path, tmp_path / "o")
    assert str(tmp_path / "WNLI" / "dev.tsv") in msg and "UTF-8" in msg
