-- The engine's own schema: nodes, profiles, workflows and their steps, the reconciler
-- work queue and shard leases. PostgreSQL is the source of truth for every state here.

CREATE TABLE nodes (
    id                  text PRIMARY KEY,
    tenant_id           text NOT NULL DEFAULT 'root',
    site_id             text NOT NULL,
    labels              jsonb NOT NULL DEFAULT '{}',
    spec                jsonb NOT NULL DEFAULT '{}',
    generation          bigint NOT NULL DEFAULT 1,
    observed_generation bigint NOT NULL DEFAULT 0,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now()
);

-- Stored profiles of tenants. Shipped profiles live in code (tenant 'builtin'), never here.
CREATE TABLE profiles (
    tenant_id     text NOT NULL,
    id            text NOT NULL,
    version       int NOT NULL,
    public        boolean NOT NULL DEFAULT false,
    document      jsonb NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    first_used_at timestamptz,           -- set by the first workflow: immutable from then on
    PRIMARY KEY (tenant_id, id, version)
);
CREATE INDEX profiles_public ON profiles (id, version) WHERE public;

CREATE TABLE workflows (
    id              text PRIMARY KEY,
    tenant_id       text NOT NULL,
    node_id         text REFERENCES nodes (id),
    rkey            text NOT NULL,        -- reconciler key: node id, else workflow id
    profile_tenant  text NOT NULL,
    profile_id      text NOT NULL,
    profile_version int NOT NULL,
    state           text NOT NULL CHECK (state IN ('running', 'succeeded', 'failed', 'aborted')),
    owner           text,
    command_kinds   text[] NOT NULL DEFAULT '{}',
    batch_id        text,
    cancel_commands boolean NOT NULL DEFAULT false, -- aborted with live commands to cancel
    error           jsonb,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz
);
CREATE INDEX workflows_rkey_running ON workflows (rkey) WHERE state = 'running';
CREATE INDEX workflows_node ON workflows (node_id, created_at);
CREATE INDEX workflows_state ON workflows (state, created_at);
CREATE INDEX workflows_profile ON workflows (profile_id, created_at);
-- One running workflow per node: two workflows driving one machine at once is never right.
CREATE UNIQUE INDEX workflows_one_running_per_node ON workflows (node_id)
    WHERE state = 'running' AND node_id IS NOT NULL;

CREATE TABLE workflow_steps (
    workflow_id text NOT NULL REFERENCES workflows (id) ON DELETE CASCADE,
    idx         int NOT NULL,
    action      text NOT NULL,          -- the resolved `use`
    runs_on     text NOT NULL,          -- control-plane | site | node
    mode        text NOT NULL CHECK (mode IN ('control-plane', 'agent', 'driver')),
    command     text,                   -- agent / driver steps: the command kind sent
    input       jsonb NOT NULL DEFAULT '{}',
    timeout_ms  bigint NOT NULL,
    state       text NOT NULL CHECK (state IN ('pending', 'running', 'succeeded', 'failed', 'cancelled')),
    attempt     int NOT NULL DEFAULT 0,
    started_at  timestamptz,
    deadline    timestamptz,
    finished_at timestamptz,
    result      jsonb,
    error       jsonb,
    command_id  text,
    sends       text[] NOT NULL DEFAULT '{}',  -- kinds a control-plane step declared
    sent_commands boolean NOT NULL DEFAULT false, -- this attempt enqueued commands
    PRIMARY KEY (workflow_id, idx)
);

-- The reconciler work queue: one entry per key, the earliest not_before wins.
-- seq changes on every wake-up so a pass never overwrites a wake that came during it.
-- Keys: a node id or workflow id for the workflow reconciler, '<owner>:<workflow id>'
-- for an owner's reconciler.
CREATE SEQUENCE work_seq;
CREATE TABLE work_queue (
    rkey       text PRIMARY KEY,
    shard      int NOT NULL,
    not_before timestamptz NOT NULL,
    seq        bigint NOT NULL DEFAULT nextval('work_seq')
);
CREATE INDEX work_queue_due ON work_queue (shard, not_before);

CREATE TABLE shard_leases (
    shard      int PRIMARY KEY,
    owner      text,
    epoch      bigint NOT NULL DEFAULT 0,
    expires_at timestamptz NOT NULL DEFAULT 'epoch'
);

-- Engine processes that are alive, so each knows how many shards are its fair share.
CREATE TABLE members (
    instance   text PRIMARY KEY,
    expires_at timestamptz NOT NULL
);
