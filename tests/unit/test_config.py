import pytest

from pipeline.config import CONFIGS_DIR, ConfigError, apply_overrides, load_config, validate_dict

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
