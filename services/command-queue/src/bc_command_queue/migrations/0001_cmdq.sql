-- The command queue's own schema: commands, agents, boot leases, batches, approvals.
-- PostgreSQL is the source of truth; the per-site JetStream streams only deliver.

CREATE TABLE batches (
    id              text PRIMARY KEY,
    tenant_id       text NOT NULL,
    kinds           text[] NOT NULL,
    nodes           text[] NOT NULL,
    workflow_id     text,
    workflow_ids    text[] NOT NULL DEFAULT '{}', -- a bulk verb's batch: the workflows it admits
    note            text,
    idempotency_key text UNIQUE,
    -- the canonical document approvers sign (see cmdq_client.batch_document)
    document        bytea NOT NULL,
    threshold       int NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz NOT NULL,
    -- the expiry exactly as signed (milliseconds since the epoch)
    expires_at_ms   bigint NOT NULL,
    approved_at     timestamptz
);
CREATE INDEX batches_workflow ON batches (workflow_id) WHERE workflow_id IS NOT NULL;

CREATE TABLE approvals (
    batch_id    text NOT NULL REFERENCES batches (id),
    approver_id text NOT NULL,
    signature   bytea NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (batch_id, approver_id)
);

CREATE TABLE commands (
    id               text PRIMARY KEY,
    node_id          text NOT NULL,
    site_id          text NOT NULL,
    tenant_id        text NOT NULL,
    key              text NOT NULL,
    kind             text NOT NULL,
    destructive      boolean NOT NULL,
    target           text NOT NULL CHECK (target IN ('site', 'node')),
    -- the payload exactly as delivered (canonical JSON), and sha256 of kind and payload:
    -- an agent's claim names the digest of what it received, so a forged delivery is refused
    payload          json NOT NULL,
    digest           bytea NOT NULL,
    agent_id         text,
    state            text NOT NULL CHECK (state IN ('pending', 'dispatched', 'acked', 'running',
                         'succeeded', 'failed', 'rejected', 'expired', 'cancelled')),
    reason           text,
    progress         text,
    batch_id         text REFERENCES batches (id),
    workflow_id      text,
    step             int,
    result           bytea,
    result_signature bytea,
    attested         boolean NOT NULL DEFAULT false,
    publishes        int NOT NULL DEFAULT 0,
    stream_seq       bigint,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    dispatched_at    timestamptz,
    published_at     timestamptz,
    acked_at         timestamptz,
    finished_at      timestamptz,
    not_after        timestamptz NOT NULL,
    UNIQUE (node_id, key)
);
CREATE INDEX commands_live ON commands (not_after)
    WHERE state IN ('pending', 'dispatched', 'acked', 'running');
CREATE INDEX commands_pending ON commands (created_at) WHERE state = 'pending';
CREATE INDEX commands_agent_live ON commands (agent_id)
    WHERE state IN ('dispatched', 'acked', 'running');
CREATE INDEX commands_workflow ON commands (workflow_id, id) WHERE workflow_id IS NOT NULL;
CREATE INDEX commands_node ON commands (node_id, id);
CREATE INDEX commands_batch ON commands (batch_id) WHERE batch_id IS NOT NULL;

CREATE TABLE agents (
    id             text PRIMARY KEY,
    site_id        text NOT NULL,
    tenant_id      text NOT NULL,
    role           text NOT NULL,
    cert_id        text NOT NULL,
    incarnation    text,
    version        text,
    kinds          text[],
    connected_at   timestamptz NOT NULL DEFAULT now(),
    last_seen      timestamptz NOT NULL DEFAULT now(),
    -- the newest signed presence event applied: an older one (a replay) changes nothing
    last_signed_ms bigint NOT NULL DEFAULT 0
);
CREATE INDEX agents_site ON agents (site_id, role, last_seen);

CREATE TABLE boot_leases (
    site_id    text PRIMARY KEY,
    agent_id   text NOT NULL,
    expires_at timestamptz NOT NULL
);
