"""Monitoring: the signals' state, accounting and metering, the status view, the dashboard page, predict latency and
the link to the MLflow tracker."""
