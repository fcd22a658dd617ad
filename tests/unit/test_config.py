import pytest

from pipeline.config import CONFIGS_DIR, apply_overrides, load_config, validate_dict
from pipeline.errors import ConfigError

BASE = {"name": "x", "model": {"arch": "bert", "preset": "bert-tiny"}, "data": {"path": "d"}}


def test_misspelled_key_is_named():
    with pytest.raises(ConfigError, match="unknown key 'train.max_stpes'"):
        validate_dict({**BASE, "train": {"max_stpes": 3}})


def test_misspelled_key_gets_the_nearest_valid_one():
    """As the DeepSpeed JSON check does: "did you mean 'train.max_steps'?", in any section
    and at the top level; a key near none gets no guess."""
    for raw, near in (
        ({**BASE, "train": {"max_stpes": 3}}, "train.max_steps"),
        ({**BASE, "mlflow": {"final_wait": 3}}, "mlflow.final_wait_s"),
        ({**BASE, "objective": {"mlm": {"mask_fracton": 0.1}}}, "objective.mlm.mask_fraction"),
        ({**BASE, "trian": {}}, "train"),
    ):
        with pytest.raises(ConfigError, match=rf"did you mean '{near}'\?"):
            validate_dict(raw)
    with pytest.raises(ConfigError, match="see configs/ for valid keys") as err:
        validate_dict({**BASE, "train": {"zzz": 1}})
    assert "did you mean" not in str(err.value)
    from pipeline.models import resolve_model_config

    with pytest.raises(ConfigError, match=r"did you mean 'model.num_layers'\?"):
        resolve_model_config({"arch": "bert", "preset": "bert-tiny", "num_layer": 3}, 100)


def test_a_bad_key_from_the_command_line_is_reported_as_the_command_lines(tmp_path):
    """`plm train CONFIG train.max_stpes=10` was "invalid config CONFIG: unknown key", as if
    the typo were in the file: the message names the key=value and the command line, and
    a bad key of the file is still the file's."""
    config = CONFIGS_DIR / "test" / "bert-tiny.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(config, ["train.max_stpes=10"])
    text = str(err.value)
    assert text.startswith(f"invalid key=value on the command line (config {config}):"), text
    assert "unknown key 'train.max_stpes' in `train.max_stpes=10` on the command line" in text
    assert "did you mean 'train.max_steps'?" in text
    with pytest.raises(ConfigError, match=r"unknown key 'trian' in `trian.lr=1` on the command"):
        load_config(config, ["trian.lr=1"])  # a section the command line made
    with pytest.raises(ConfigError, match=r"key 'train.lr' in `train.lr=abc` on the command"):
        load_config(config, ["train.lr=abc"])

    path = tmp_path / "c.yaml"  # the file's typo, next to a good override: the file's
    path.write_text("name: x\nmodel: {arch: bert}\ndata: {path: d}\ntrain: {max_stpes: 3}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, ["train.lr=1e-4"])
    assert str(err.value).startswith(f"invalid config {path}:")
    assert "unknown key 'train.max_stpes' (check" in str(err.value)
    assert "command line" not in str(err.value)


def test_dotted_overrides_are_typed():
    raw = apply_overrides(
        dict(BASE), ["train.max_steps=20", "train.lr=3e-4", "mlflow.register=false"]
    )
    cfg = validate_dict(raw)
    assert cfg.train.max_steps == 20 and cfg.train.lr == pytest.approx(3e-4)
    assert cfg.mlflow.register_model is False


def test_bad_value_names_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: x\nmodel: {arch: bert}\ndata: {path: d}\ntrain: {precision: fp8}\n")
    with pytest.raises(ConfigError, match="train.precision"):
        load_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_an_asynchronous_save_buffer_of_nothing_is_refused_naming_the_key():
    """train.save_buffer_mb: the writer's host buffer must hold something."""
    for bad in (0, -64):
        with pytest.raises(ConfigError, match=r"train\.save_buffer_mb.*greater than 0"):
            validate_dict({**BASE, "train": {"save_buffer_mb": bad}})
    assert validate_dict({**BASE, "train": {"save_buffer_mb": 8}}).train.save_buffer_mb == 8


def test_an_upload_timeout_of_nothing_is_refused_naming_the_key():
    """mlflow.upload_timeout_s: how long an artifact upload may wait for the server."""
    for bad in (0, -1):
        with pytest.raises(ConfigError, match=r"mlflow\.upload_timeout_s.*greater than 0"):
            validate_dict({**BASE, "mlflow": {"upload_timeout_s": bad}})
    assert validate_dict({**BASE, "mlflow": {"upload_timeout_s": 60}}).mlflow.upload_timeout_s == 60


@pytest.mark.parametrize(
    "path", sorted((CONFIGS_DIR / "experiments").glob("*.yaml")), ids=lambda p: p.stem
)
def test_every_experiment_config_validates_with_its_model_preset(path):
    """The shipped experiment configs are what users start from: each must load, and its
    model section must resolve against its preset (a renamed preset or key fails here)."""
    from pipeline.models import resolve_model_config

    cfg = load_config(path, [])
    model = resolve_model_config(cfg.model.model_dump(), 1000)
    assert model.vocab_size == 1000


# --- no credentials in a config's URIs (issue 49): it is printed and logged as MLflow params


def test_a_tracking_uri_with_a_user_part_is_refused_naming_the_key(tmp_path):
    """mlflow.tracking_uri (and distill.tracking_uri, and every stage's mlflow section) may
    not carry user:pass@: one line naming the key, the password masked, the variables to
    use; a URI without one, or MLflow's own query, is taken."""
    from pipeline.finetune.config import validate_finetune

    secret = "http://bert-job:hunter2hunter2@mlflow.internal:5000"
    for key, validate in (
        ("mlflow.tracking_uri", lambda v: validate_dict({**BASE, "mlflow": {"tracking_uri": v}})),
        ("objective.distill.tracking_uri", lambda v: validate_dict(
            {**BASE, "objective": {"kind": "distill", "distill": {"tracking_uri": v}}})),
        ("mlflow.tracking_uri", lambda v: validate_finetune(
            {"name": "x", "model": {"source": "m"}, "task": {"type": "classification"},
             "data": {"train": "t.jsonl"}, "mlflow": {"tracking_uri": v}}, "c.yaml")),
    ):  # fmt: skip
        with pytest.raises(ConfigError) as err:
            validate(secret)
        text = str(err.value)
        assert "\n" not in text and "hunter2" not in text and "bert-job" not in text, text
        assert text.startswith(f"{key}=http://***@mlflow.internal:5000: a tracking URI"), text
        assert "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD_FILE" in text
        for fine in ("http://mlflow.internal:5000", "sqlite:///mlflow.db", "databricks"):
            validate(fine)
    with pytest.raises(ConfigError, match="user part"):  # a token alone is a secret too
        validate_dict({**BASE, "mlflow": {"tracking_uri": "https://tok3n@mlflow.internal"}})


def test_a_tracking_uri_override_with_a_password_is_refused_as_the_command_lines():
    config = CONFIGS_DIR / "test" / "bert-tiny.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(config, ["mlflow.tracking_uri=http://u:hunter2hunter2@127.0.0.1:5000"])
    text = str(err.value)
    assert text.startswith("mlflow.tracking_uri=http://***@127.0.0.1:5000: a tracking URI")
    assert text.endswith("(given on the command line: mlflow.tracking_uri=http://***@127.0.0.1:5000)")  # fmt: skip
    assert "hunter2" not in text


def test_a_store_uri_with_credentials_is_refused_naming_the_key():
    """StorePath keys (data.path, train.out_dir, ...) refuse s3://KEY:SECRET@bucket alike
    (every such key: tests/unit/test_uri_paths.py)."""
    for raw, key in (({**BASE, "data": {"path": "s3://AKIA:hunter2@b/d"}}, "data.path"),
                     ({**BASE, "train": {"out_dir": "s3://AKIA:hunter2@b/r"}}, "train.out_dir")):  # fmt: skip
        with pytest.raises(ConfigError) as err:
            validate_dict(raw)
        text = str(err.value)
        assert text.startswith(f"{key}=s3://***@b/") and "hunter2" not in text, text
        assert "user part" in text and "AWS_SECRET_ACCESS_KEY" in text
