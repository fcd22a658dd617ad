"""`plm data prepare` is never silent on a long run: without a terminal the driver prints a
progress line (units, documents, MB, MB/s) every `every` seconds as units finish."""

from __future__ import annotations

from collections import Counter

from pipeline.prepare.job import _Progress
from pipeline.prepare.worker import UnitResult


def test_progress_lines_count_units_documents_and_bytes(capsys):
    progress = _Progress(total_bytes=3_000_000, n_units=3, every=0.0)  # a line per unit
    for unit in range(2):
        progress.update(UnitResult(unit=unit, read=Counter({0: 1000}), input_bytes=1_000_000))
    progress.close()
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("prepare: ")]
    assert len(lines) == 2
    assert lines[-1].startswith("prepare: 2/3 units, 2,000 documents, 2 of 3 MB, ")
    assert lines[-1].endswith(" MB/s")


def test_no_line_before_the_interval(capsys):
    progress = _Progress(total_bytes=1_000_000, n_units=1, every=3600.0)
    progress.update(UnitResult(unit=0, read=Counter({0: 5}), input_bytes=1_000_000))
    assert "prepare: " not in capsys.readouterr().err
