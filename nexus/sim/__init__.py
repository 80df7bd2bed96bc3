"""Environment Service, worker side (resource ``SIM``): simulator back-ends (ManiSkill3, robosuite, vector envs),
rollout producers, environment sessions, the simulator worker's host and tasks."""
