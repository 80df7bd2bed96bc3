"""Health and membership: the health manager, the supervisor that restarts roles in place, the actor group and its
placement, the inference engine pool and its membership."""
