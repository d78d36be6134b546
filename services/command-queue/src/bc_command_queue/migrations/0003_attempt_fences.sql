-- When a claimed command's agent reported the end of its run although the command was
-- cancelled or expired meanwhile (the result no longer counts, but the agent is done with it):
-- until then a superseded step attempt's command may still be running at its agent.
ALTER TABLE commands ADD COLUMN ended_at timestamptz;
-- Key prefixes of superseded workflow step attempts (``wf:<workflow>:<step>#<attempt>``): an
-- enqueue under one is refused, even from an engine that lost its shard and still runs it.
CREATE TABLE key_fences (
    prefix      text PRIMARY KEY,
    workflow_id text NOT NULL,
    reason      text,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX key_fences_workflow ON key_fences (workflow_id);
