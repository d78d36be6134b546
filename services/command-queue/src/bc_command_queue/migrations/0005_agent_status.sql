-- What an agent says of itself in its hello and heartbeats (drivers, cache use, last error),
-- shown by bcx agents list; bounded by the command-queue before it is stored.
ALTER TABLE agents ADD COLUMN status jsonb;
