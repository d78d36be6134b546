-- A value stored by a workflow step attempt that was superseded (a retry, a resume, an abort)
-- is revoked: nobody reads it any more.
ALTER TABLE secrets ADD COLUMN revoked_at timestamptz, ADD COLUMN revoke_reason text;
-- Keys of superseded step attempts (``wf:<workflow>:<step>#<attempt>``): nothing is stored
-- under one of them any more, even by an engine that lost its shard and still runs it.
CREATE TABLE key_fences (
    prefix     text PRIMARY KEY,
    reason     text,
    created_at timestamptz NOT NULL DEFAULT now()
);
-- In byte order the keys under one prefix are one range of this index (see store.UNDER_KEY).
CREATE INDEX secrets_key_bytes ON secrets ((idempotency_key COLLATE "C"));
