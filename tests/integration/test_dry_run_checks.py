"""`plm train --dry-run` refuses what the real run refuses, with the same one `plm:` line
(exit 2), seconds instead of a DeepSpeed start later; the real run refuses the new
checks too (sequence length vs positions, unknown DeepSpeed keys)."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import REPO, one_plm_line, plm

pytestmark = pytest.mark.slow

TEST = REPO / "configs" / "test"


def dry(config: str, *overrides: str, cwd, real: bool = False) -> str:
    """The `plm:` line of a dry run (and of the real run with ``real``: the same one)."""
    args = ["train", str(TEST / config), *overrides, f"train.out_dir={cwd / 'run'}"]
    line = one_plm_line(plm(*args, "--dry-run", cwd=cwd, check=False))
    if real:
        assert one_plm_line(plm(*args, cwd=cwd, check=False)) == line
    return line


def test_roberta_on_a_wordpiece_data_dir(tiny_data, tmp_path):
    line = dry("roberta-tiny.yaml", f"data.path={tiny_data}", cwd=tmp_path)
    assert "model.pad_token_id=1 but the tokenizer pads with id 0" in line


def test_seq_len_beyond_the_position_table(tiny_data, tmp_path):
    line = dry("bert-tiny.yaml", f"data.path={tiny_data}", "data.seq_len=600", cwd=tmp_path,
               real=True)  # fmt: skip
    assert "data.seq_len=600 needs 600 positions but model.max_positions is 256" in line
    assert "pass data.seq_len=256 or less" in line


def test_a_misspelled_top_level_deepspeed_key(tiny_data, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimisation": {"stage": 2}}))
    line = dry("bert-tiny.yaml", f"data.path={tiny_data}", f"deepspeed={ds}", cwd=tmp_path,
               real=True)  # fmt: skip
    assert "unknown top-level key 'zero_optimisation'" in line
    assert "did you mean 'zero_optimization'" in line


def test_a_distilbert_teacher_of_another_tokenizer(tiny_data, tmp_path):
    sys.path.insert(0, str(REPO / "tests" / "unit"))
    from test_export_hf import bytelevel_bpe_dir

    from pipeline.models import build_model, resolve_model_config
    from pipeline.models.bundle import save_bundle

    tok = tmp_path / "bpe"
    tok.mkdir()
    bytelevel_bpe_dir(tok)
    vocab = json.loads((tok / "tokenizer_meta.json").read_text())["vocab_size"]
    cfg = resolve_model_config({"arch": "bert", "preset": "bert-tiny"}, vocab)
    teacher = save_bundle(tmp_path / "teacher", "bert", cfg, build_model("bert", cfg)
                          .state_dict(), tok)  # fmt: skip
    line = dry("distilbert-tiny.yaml", f"data.path={tiny_data}",
               f"objective.distill.teacher={teacher}", cwd=tmp_path)  # fmt: skip
    assert "objective.distill.teacher: the teacher's tokenizer" in line


def test_a_checkpoint_of_another_zero_stage(tiny_data, tmp_path):
    from test_resume_refusals import fake_checkpoint

    fake_checkpoint(tmp_path / "run", world_size=2, global_batch=16, zero_stage=3)
    # an explicit other stage (`deepspeed: auto`, the config's, would keep ZeRO-3)
    line = dry("bert-tiny.yaml", f"data.path={tiny_data}", "deepspeed=configs/deepspeed/zero2.json",
               cwd=tmp_path)  # fmt: skip
    assert "pass deepspeed=configs/deepspeed/zero3.json" in line
