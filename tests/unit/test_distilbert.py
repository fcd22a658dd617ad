"""DistilBERT distillation: the student starts as the teacher's chosen layers, the teacher
is frozen and outside the model, the tokenizers must match, bundles resolve from MLflow."""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline.config import ObjectiveSection
from pipeline.errors import ConfigError
from pipeline.models import build_model
from pipeline.models.bert import BertConfig
from pipeline.models.bundle import save_bundle
from pipeline.models.distilbert import DistilBertConfig
from pipeline.objectives import build_objective
from pipeline.objectives.distill import default_layers, resolve_bundle

ROLES = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
V = 100
SHAPE = dict(hidden_size=32, num_heads=2, intermediate_size=64, max_positions=64)


def tokenizer_dir(root: Path, sha: str = "a" * 64) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokenizer.json").write_text("{}")
    meta = {"kind": "wordpiece", "vocab_size": V, "roles": ROLES, "sha256": sha}
    (root / "tokenizer_meta.json").write_text(json.dumps(meta))
    return root


def teacher_bundle(tmp_path: Path, layers: int = 4) -> Path:
    cfg = BertConfig(vocab_size=V, num_layers=layers, **SHAPE)
    torch.manual_seed(0)
    teacher = build_model("bert", cfg)
    with torch.no_grad():  # distinct biases/LayerNorms per layer so a wrong copy shows
        for name, p in teacher.named_parameters():
            if p.ndim == 1:
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    return save_bundle(
        tmp_path / "teacher", "bert", cfg, teacher.state_dict(), tokenizer_dir(tmp_path / "tok")
    )


def student_and_objective(teacher: Path, n_layers: int, **distill):
    cfg = ObjectiveSection(kind="distill", distill={"teacher": str(teacher), **distill})
    objective = build_objective(cfg, ROLES, V, 32)
    torch.manual_seed(1)
    student = build_model(
        "distilbert", DistilBertConfig(vocab_size=V, num_layers=n_layers, **SHAPE)
    )
    objective.attach(student)
    return student, objective


@pytest.mark.parametrize(("layers", "chosen"), [(2, None), (2, [0, 2]), (1, None)])
def test_student_layers_equal_the_chosen_teacher_layers(tmp_path, layers, chosen):
    student, objective = student_and_objective(teacher_bundle(tmp_path), layers, layers=chosen)
    teacher = objective.teacher
    picked = chosen or default_layers(4, layers)
    assert picked == (chosen or ([1, 3] if layers == 2 else [3]))
    for i, j in enumerate(picked):
        s, t = student.blocks[i].state_dict(), teacher.blocks[j].state_dict()
        assert s.keys() == t.keys()
        assert all(torch.equal(s[k], t[k]) for k in s), (i, j)
    for k, v in teacher.mlm_head.state_dict().items():
        assert torch.equal(student.mlm_head.state_dict()[k], v)
    assert torch.equal(student.embeddings.word.weight, teacher.embeddings.word.weight)


def test_full_depth_student_reproduces_the_teacher(tmp_path):
    """Every layer copied: the student computes the teacher's function on any one-segment
    input (the segment-A embedding is folded into the positions), over many inputs."""
    student, objective = student_and_objective(teacher_bundle(tmp_path), 4, layers=[0, 1, 2, 3])
    student.eval()
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        x = torch.randint(5, V, (4, 24), generator=g)
        mask = torch.ones_like(x)
        mask[1, 17:] = 0
        with torch.no_grad():
            s, t = student(x, attention_mask=mask), objective.teacher(x, attention_mask=mask)
        real = mask.bool()
        torch.testing.assert_close(s["mlm_logits"][real], t["mlm_logits"][real])
        torch.testing.assert_close(s["hidden_states"][real], t["hidden_states"][real])


def test_teacher_is_frozen_and_not_in_the_student(tmp_path):
    student, objective = student_and_objective(teacher_bundle(tmp_path), 2)
    assert not any(k.startswith("teacher") for k in student.state_dict())
    assert not any(p.requires_grad for p in objective.teacher.parameters())
    assert objective.__getstate__()["teacher"] is None  # loader workers never get it
    B, T = 4, 16
    ids = torch.randint(5, V, (B, T))
    labels = torch.full_like(ids, -100)
    labels[:, 3] = ids[:, 3]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mlm_labels": labels,
             "token_type_ids": torch.zeros_like(ids)}  # fmt: skip
    loss, metrics = objective.loss(student(ids, attention_mask=batch["attention_mask"]), batch)
    loss.backward()
    assert all(p.grad is None for p in objective.teacher.parameters())
    d = objective.distill
    expected = d.alpha_ce * metrics["ce_loss"] + d.alpha_mlm * metrics["mlm_loss"]
    assert float(loss.detach()) == pytest.approx(
        float(expected + d.alpha_cos * metrics["cos_loss"])
    )
    assert float(metrics["ce_loss"]) >= 0


def test_different_tokenizers_are_refused_naming_both(tmp_path):
    student, objective = student_and_objective(teacher_bundle(tmp_path), 2)
    other = tokenizer_dir(tmp_path / "data" / "tokenizer", sha="b" * 64)
    data = SimpleNamespace(tokenizer_path=other / "tokenizer.json")
    with pytest.raises(ConfigError, match="a" * 64 + r".*" + "b" * 64):
        objective.bind_data(data, student)
    same = SimpleNamespace(tokenizer_path=tmp_path / "tok" / "tokenizer.json")
    objective.bind_data(same, student)  # the teacher's own tokenizer: fine


def test_bad_teacher_and_shape_errors(tmp_path):
    with pytest.raises(ConfigError, match="objective.distill.teacher: missing"):
        build_objective(ObjectiveSection(kind="distill"), ROLES, V, 32)
    with pytest.raises(ConfigError, match="not a model bundle"):
        student_and_objective(tmp_path / "nowhere", 2)
    bundle = teacher_bundle(tmp_path)
    cfg = ObjectiveSection(kind="distill", distill={"teacher": str(bundle)})
    wide = build_model("distilbert", DistilBertConfig(vocab_size=V, **{**SHAPE, "hidden_size": 64}))
    with pytest.raises(ConfigError, match="model.hidden_size"):
        build_objective(cfg, ROLES, V, 32).attach(wide)
    with pytest.raises(ConfigError, match="objective.distill.layers"):
        student_and_objective(bundle, 2, layers=[0, 7])


@pytest.mark.slow
def test_teacher_from_mlflow_uris(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    bundle = teacher_bundle(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.chdir(tmp_path)  # the artifact store of a sqlite tracking URI: ./mlruns
    client = MlflowClient(uri)  # no global mlflow state: other tests keep theirs
    run = client.create_run(client.create_experiment("distill-teacher"))
    client.log_artifacts(run.info.run_id, str(bundle), "model")
    client.set_terminated(run.info.run_id)
    source = f"{run.info.artifact_uri}/model"
    client.create_registered_model("teacher")
    mv = client.create_model_version("teacher", source, run_id=run.info.run_id)
    client.set_registered_model_alias("teacher", "current", mv.version)
    for ref in (f"runs:/{run.info.run_id}/model", "models:/teacher@current"):
        local = resolve_bundle(ref, uri)
        assert (local / "model.safetensors").read_bytes() == (
            bundle / "model.safetensors"
        ).read_bytes()
    with pytest.raises(ConfigError, match="cannot fetch .models:/nobody@current. from MLflow"):
        resolve_bundle("models:/nobody@current", uri)
    np.testing.assert_equal(default_layers(12, 6), [1, 3, 5, 7, 9, 11])
