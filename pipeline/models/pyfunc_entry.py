"""What MLflow runs to build a bundle's pyfunc model ("models from code": no pickle of
our objects; loading needs the `pipeline` package installed)."""

import mlflow

from pipeline.models.pyfunc import BundleModel

mlflow.models.set_model(BundleModel())
