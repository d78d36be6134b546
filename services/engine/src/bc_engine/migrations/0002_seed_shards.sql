-- A fixed number of shards; every engine process must agree on it, so it lives here.
INSERT INTO shard_leases (shard) SELECT generate_series(0, 63);
