"""A model bundle as an MLflow model (an MLflow 3 ``LoggedModel`` with a pyfunc flavour).

``mlflow.pyfunc.load_model("models:/NAME@ALIAS").predict(texts)`` gives one embedding per
text: the mean of the model's last hidden states over the text's tokens (no special
tokens), ``[n, hidden]`` float32. ``params={"output": "logits"}`` gives the model's
output logits instead, one ``[tokens, vocab]`` array per text (the LM head's, or the
first ``*logits`` output the architecture returns), without the vocabulary padding.

The bundle itself sits inside the logged model as the artifact ``bundle``
(``artifacts/bundle/``), so `plm` commands that take ``models:/...`` find it there too.

A fine-tuned model (``plm finetune``) is logged the same way by ``pipeline.finetune.pyfunc``
(``log_model`` here), as the artifact ``finetuned``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import mlflow.pyfunc

BUNDLE_ARTIFACT = "bundle"


def _texts(model_input: Any) -> list[str]:
    """The texts, from what pyfunc passes after checking the signature (a one-column
    DataFrame), or a list, a Series, an array or one string when called directly."""
    if isinstance(model_input, str):
        return [model_input]
    columns = getattr(model_input, "columns", None)
    if columns is not None:
        model_input = model_input["text" if "text" in columns else columns[0]]
    if hasattr(model_input, "tolist"):
        model_input = model_input.tolist()
    return [str(x) for x in model_input]


# MLflow checks predict's type hints when the class is defined and warns without them:
# type hints cannot declare the ``output`` parameter, so the signature is given when the
# model is logged. The warning is caught here (recorded, then dropped).
with warnings.catch_warnings(record=True):
    warnings.simplefilter("always")

    class BundleModel(mlflow.pyfunc.PythonModel):
        """Embeddings (default) or logits of a plm bundle for a list of texts."""

        def load_context(self, context) -> None:
            import inspect

            from tokenizers import Tokenizer

            from pipeline.models.bundle import load_bundle

            folder = Path(context.artifacts[BUNDLE_ARTIFACT])
            self.model, self.config = load_bundle(folder)
            self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
            self.tokenizer.encode_special_tokens = True  # text, never control tokens
            self.vocab_size = int(self.config["model"]["vocab_size"])
            roles = self.config.get("vocab", {}).get("roles", {})
            self.pad_id = int(roles.get("pad", 0))
            names = inspect.signature(self.model.forward).parameters
            self.takes_mask = "attention_mask" in names
            self.takes_heads = "pretrain_heads" in names  # every architecture's (base.py)

        def predict(self, context, model_input, params: dict[str, Any] | None = None):
            import numpy as np
            import torch

            output = (params or {}).get("output", "embeddings")
            if output not in ("embeddings", "logits"):
                raise ValueError(f"params output={output!r}: 'embeddings' or 'logits'")
            texts = _texts(model_input)
            encoded = [self.tokenizer.encode(t, add_special_tokens=False).ids or [self.pad_id]
                       for t in texts]  # fmt: skip
            width = max(len(ids) for ids in encoded)
            ids = torch.full((len(encoded), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(encoded), width), dtype=torch.long)
            for i, row in enumerate(encoded):
                ids[i, : len(row)] = torch.tensor(row)
                mask[i, : len(row)] = 1
            kwargs = {"attention_mask": mask} if self.takes_mask else {}
            if self.takes_heads:  # embeddings: the features alone, no head computed
                kwargs["pretrain_heads"] = output == "logits"
            with torch.no_grad():
                out = self.model(ids, **kwargs)
            if output == "logits":
                keys = [k for k in out if k.endswith("logits")]
                if not keys:
                    arch = self.config["arch"]
                    raise ValueError(f"a {arch} bundle has no logits: use 'embeddings'")
                key = "logits" if "logits" in keys else keys[0]
                logits = out[key][..., : self.vocab_size].float().numpy()
                return [logits[i, : len(row)] for i, row in enumerate(encoded)]
            hidden = out["hidden_states"].float()
            m = mask.unsqueeze(-1).float()
            return ((hidden * m).sum(1) / m.sum(1).clamp(min=1.0)).numpy().astype(np.float32)


def log_bundle_model(bundle_dir: str | Path, name: str = "model", **log_kwargs):
    """Log ``bundle_dir`` as a LoggedModel of the active run; returns MLflow's ModelInfo.
    The signature (a string column, a ``output`` parameter) is given, not inferred from
    type hints (those cannot declare parameters). ``log_kwargs``: for
    ``mlflow.pyfunc.log_model`` (``step``; ``model_id``: into a LoggedModel made before)."""
    from mlflow.models import infer_signature

    signature = infer_signature(["a text"], params={"output": "embeddings"})
    entry = Path(__file__).with_name("pyfunc_entry.py")
    return log_model(entry, BUNDLE_ARTIFACT, bundle_dir, name, signature, **log_kwargs)


def log_model(entry: Path, artifact: str, folder: str | Path, name: str, signature, **log_kwargs):
    """``mlflow.pyfunc.log_model`` of a model from code (``entry``, a file that calls
    ``mlflow.models.set_model``: no pickle of our objects) with ``folder`` as its artifact; quiet unless ``plm -v``: MLflow warns about the missing
    type hints and input example (one would load and run the model)."""
    from importlib.metadata import PackageNotFoundError, version

    from pipeline import output

    try:
        requirement = f"plm-pipeline=={version('plm-pipeline')}"
    except PackageNotFoundError:
        requirement = "plm-pipeline"
    with warnings.catch_warnings():
        if not output.VERBOSE:
            warnings.simplefilter("ignore", UserWarning)
        return mlflow.pyfunc.log_model(
            name=name,
            python_model=str(entry),
            artifacts={artifact: str(folder)},
            pip_requirements=[requirement],  # no inference: it would import and run the model
            signature=signature,
            **log_kwargs,
        )
