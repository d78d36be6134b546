-- The engine's own schema: nodes, profiles, workflows and their steps, the reconciler
-- work queue and shard leases. PostgreSQL is the source of truth for every state here.

CREATE TABLE nodes (
    id                  text PRIMARY KEY,
    tenant_id           text NOT NULL DEFAULT 'root',
    site_id             text NOT NULL,
    labels              jsonb NOT NULL DEFAULT '{}',
    spec                jsonb NOT NULL DEFAULT '{}',
    -- Metal (DESIGN section 10). The BMC is {driver, address, credentialsRef (a sec_… SecretRef),
    -- systemId?, insecure?}: the password itself never enters the engine's tables.
    macs                text[] NOT NULL DEFAULT '{}',
    bmc                 jsonb,
    state               text NOT NULL DEFAULT 'enrolled' CHECK (state IN (
        'discovered', 'enrolled', 'inspecting', 'inspected', 'commissioning', 'ready', 'deploying',
        'deployed', 'releasing', 'retiring', 'retired', 'adopting', 'failed')),
    state_reason        jsonb,               -- failed: {workflowId, step, code, message}
    workflow_id         text,                -- the lifecycle workflow moving the node now
    host_section        jsonb,               -- the NodeSpec bcd converges to (generation)
    inventory           jsonb,               -- the latest inventory
    power_state         text,                -- the observed power state
    last_error          jsonb,
    image               text,                -- name@version deployed (or being deployed)
    generation          bigint NOT NULL DEFAULT 1,
    observed_generation bigint NOT NULL DEFAULT 0,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now()
);
-- nodes.list of one site, by id.
CREATE INDEX nodes_site ON nodes (site_id, id);
-- A MAC belongs to one node: discovery and enrolment find the node by it.
CREATE INDEX nodes_macs ON nodes USING gin (macs);

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
    shard           int NOT NULL,         -- rkey's shard: each engine's command watch reads its own
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
-- A reconciler pass reads the running workflows of its key and the aborted ones that still
-- have commands to cancel.
CREATE INDEX workflows_rkey_live ON workflows (rkey) WHERE state = 'running' OR cancel_commands;
-- workflows.list: newest first (ids sort by time), optionally by node, state, profile or tenant.
CREATE INDEX workflows_node ON workflows (node_id, id);
CREATE INDEX workflows_state ON workflows (state, id);
CREATE INDEX workflows_profile ON workflows (profile_id, id);
CREATE INDEX workflows_tenant ON workflows (tenant_id, id);
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
    -- What this attempt minted through ctx.pki / ctx.secrets ('pki', 'secrets'): the next
    -- attempt (or an abort) revokes it first.
    minted      text[] NOT NULL DEFAULT '{}',
    -- What the step waits for now, shown in workflows.get: one of our services that does not
    -- answer, or the previous attempt's commands that still run at their agents.
    waiting_for jsonb,
    -- A random secret per step, made the first time a run of it mints a join token through
    -- ctx.pki: its tokens are derived from it and bc-pki's token key, so a re-run of the attempt
    -- (on any engine) gets them back and no other caller of tokens.issue can. Never shown.
    mint_secret bytea,
    PRIMARY KEY (workflow_id, idx)
);
-- Steps waiting on a command, for the engine's bulk look at their commands every poll interval.
CREATE INDEX workflow_steps_waiting ON workflow_steps (workflow_id)
    WHERE state = 'running' AND command_id IS NOT NULL;

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
-- A fixed number of shards (bc_engine.queue.SHARDS); every engine process must agree on it.
INSERT INTO shard_leases (shard) SELECT generate_series(0, 63);

-- Engine processes that are alive, so each knows how many shards are its fair share.
CREATE TABLE members (
    instance   text PRIMARY KEY,
    expires_at timestamptz NOT NULL
);

-- == Images (metal's catalog; bc_engine/images_api.py, better_compute/metal/images.py) ==========
-- Signers allowed to sign images: [images] signers of bc.toml, written here by every engine at
-- start, so a step resolving an image (resolve_image_ref) sees the allowlist in the database.
-- A signer removed from the settings disappears here, and its images no longer resolve.
CREATE TABLE image_signers (
    id         text PRIMARY KEY,
    algorithm  text NOT NULL CHECK (algorithm IN ('ed25519', 'ecdsa-p256-sha256')),
    public_key bytea NOT NULL,            -- DER SubjectPublicKeyInfo
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- Images by name@version per tenant, registered by digest with the signature over it.
-- signer is NULL when the app's image_verifier accepted the image instead of the allowlist.
CREATE TABLE images (
    tenant_id  text NOT NULL,
    name       text NOT NULL,
    version    text NOT NULL,
    public     boolean NOT NULL DEFAULT false,
    url        text NOT NULL,
    sha256     text NOT NULL CHECK (sha256 ~ '^[0-9a-f]{64}$'),
    format     text NOT NULL,
    size       bigint CHECK (size IS NULL OR size >= 0),
    signer     text,
    signature  bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, name, version)
);
CREATE INDEX images_public ON images (name, version) WHERE public;

-- provisioned_target_resolver(): a provisioned join token back to the workflow (and node) whose
-- userdata.render minted it.
CREATE INDEX workflow_steps_join_token ON workflow_steps ((result->>'joinTokenId'))
    WHERE action = 'userdata.render' AND state = 'succeeded';
