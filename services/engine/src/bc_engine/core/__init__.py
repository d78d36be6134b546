"""The engine's generic core: the reconciler pass, its scheduler, work queue and shard leases, the
clean-up of earlier attempts, retry policies."""
