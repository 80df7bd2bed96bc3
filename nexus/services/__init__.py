"""Worker side: training (actor), inference engine, rollout producers, tracking."""
