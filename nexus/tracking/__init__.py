"""MLflow tracking: one experiment per service, one run per job, hosted by one worker."""
