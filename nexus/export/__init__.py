"""An exported policy directory: load and run it without a service (``policy``), its files and their check (``files``),
and the same directory as an MLflow model (``mlflow_model``)."""
