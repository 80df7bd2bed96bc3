"""Data at rest: trajectories (Arrow), offline datasets (ours and LeRobot's), tenant output dirs."""
