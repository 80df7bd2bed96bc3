"""The worker side's Dask shell: the WorkerPlugin that hosts a process's roles, its RPC handlers and heartbeat."""
