"""What crosses between the service's processes: control-plane <-> worker messages, the callers' side of the engines
and simulator workers, monitoring signals, latency types, pages of views, observation and array checks, uploaded
episodes and a job's metric history. No torch."""
