-- Each journal of an agent (the agent SDK's journal id), numbered in the order the queue first
-- heard of it: its process's hello, else its first claim. A retry re-signs a claim, so signing
-- time cannot tell an old journal from a new one; this number can, and a claim from an older
-- journal never changes a command a newer one claimed. ``last_seen`` is that journal's own
-- presence (hello, heartbeat, claim): a command it claimed may still run there until it reports
-- the end, or until it is silent for cmdq.lost_after, even while another process of the same
-- agent heartbeats. ``present``: it said hello or heartbeat itself (an older SDK names its
-- journal in claims only; then the agent's presence stands for it).
CREATE SEQUENCE journal_generations;
CREATE TABLE journals (
    agent_id   text NOT NULL,
    journal_id text NOT NULL,
    generation bigint NOT NULL DEFAULT nextval('journal_generations'),
    first_seen timestamptz NOT NULL DEFAULT now(),
    last_seen  timestamptz NOT NULL DEFAULT now(),
    present    boolean NOT NULL DEFAULT false,
    PRIMARY KEY (agent_id, journal_id)
);
