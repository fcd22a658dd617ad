"""A fine-tuned model (``plm finetune``'s ``model/``) as an MLflow model: a ``LoggedModel``
with a pyfunc flavour whose ``predict`` takes rows of the task's input columns (a DataFrame
or a list of dicts) and returns `plm predict`'s columns (``prediction`` and, where there is
one, ``probability`` / ``scores``) as a DataFrame, one row per input row. The folder sits
inside it as the artifact ``finetuned``. Logged from code (``pyfunc_entry.py``) like a
pretrained bundle (``pipeline.models.pyfunc``)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import mlflow.pyfunc

from pipeline.models.pyfunc import log_model

FINETUNED_ARTIFACT = "finetuned"


def _rows(model_input: Any) -> list[dict[str, Any]]:
    """Rows from a DataFrame (what pyfunc passes after checking the signature), a list of
    dicts or one dict."""
    if hasattr(model_input, "to_dict"):
        return model_input.to_dict("records")
    return [model_input] if isinstance(model_input, dict) else list(model_input)


# MLflow checks predict's type hints when the class is defined and warns without them
# (see pipeline.models.pyfunc): the signature is given when the model is logged.
with warnings.catch_warnings(record=True):
    warnings.simplefilter("always")

    class FinetunedModel(mlflow.pyfunc.PythonModel):
        """`plm predict` of a fine-tuned model for rows of its task's columns."""

        def load_context(self, context) -> None:
            from pipeline.finetune.predict import Predictor

            self.predictor = Predictor(Path(context.artifacts[FINETUNED_ARTIFACT]))

        def predict(self, context, model_input, params: dict[str, Any] | None = None):
            import pandas as pd

            rows = _rows(model_input)
            return pd.DataFrame(self.predictor.predict(rows, "the pyfunc model's input"))


def log_finetuned_model(model_dir: str | Path, name: str = "model"):
    """Log a fine-tuned folder as a LoggedModel of the active run; returns MLflow's
    ModelInfo. The signature: the task's input columns, as strings."""
    import yaml
    from mlflow.models import infer_signature

    from pipeline.finetune.config import TaskSection
    from pipeline.finetune.data import needed_columns
    from pipeline.finetune.source import FINETUNE_FILE

    meta = yaml.safe_load((Path(model_dir) / FINETUNE_FILE).read_text(encoding="utf-8"))
    task = TaskSection.model_validate(meta["task"])
    columns = [c for c in needed_columns(task) if c not in (task.label_column,
                                                            task.answers_column)]  # fmt: skip
    signature = infer_signature([dict.fromkeys(columns, "a text")])
    entry = Path(__file__).with_name("pyfunc_entry.py")
    return log_model(entry, FINETUNED_ARTIFACT, model_dir, name, signature)
