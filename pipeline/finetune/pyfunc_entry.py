"""What MLflow runs to build a fine-tuned model's pyfunc model ("models from code": no
pickle of our objects; loading needs the `pipeline` package installed)."""

import mlflow

from pipeline.finetune.pyfunc import FinetunedModel

mlflow.models.set_model(FinetunedModel())
