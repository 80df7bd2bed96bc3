"""What a tenant runs: the Python API, the CLI, the demo, reports."""
