-- Keys of superseded workflow step attempts (``wf:<workflow>:<step>#<attempt>``): nothing is
-- minted under one of them any more, even by an engine that lost its shard and still runs it.
CREATE TABLE key_fences (
    prefix     text PRIMARY KEY,
    reason     text,
    created_at timestamptz NOT NULL DEFAULT now()
);
-- In byte order the keys under one prefix are one range of this index (see store.UNDER_KEY).
CREATE INDEX join_tokens_key_bytes ON join_tokens ((idempotency_key COLLATE "C"));
