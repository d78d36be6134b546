-- Values behind SecretRefs, sealed with AES-256-GCM under the key file (see bc_pki.keyring);
-- the associated data is the ref, so a sealed value copied to another row does not open.
CREATE TABLE secrets (
    ref text PRIMARY KEY,
    tenant_id text NOT NULL,
    workflow_id text,                     -- the workflow step that stored it, or …
    step int NOT NULL CHECK (step >= 0),
    node_id text,                         -- … the node whose standing secret it is (its BMC credential)
    CHECK ((workflow_id IS NULL) <> (node_id IS NULL)),
    idempotency_key text UNIQUE,
    label text,
    size int NOT NULL,
    key_id text NOT NULL,
    sealed bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX secrets_workflow ON secrets (workflow_id, step);
CREATE INDEX secrets_tenant ON secrets (tenant_id, created_at DESC);
CREATE INDEX secrets_key ON secrets (key_id);

-- Every agent fetch, granted or denied.
CREATE TABLE fetch_audit (
    id bigserial PRIMARY KEY,
    at timestamptz NOT NULL DEFAULT now(),
    outcome text NOT NULL CHECK (outcome IN ('granted', 'denied')),
    ref text,
    code text,
    reason text,
    signer_id text,
    agent_id text,
    command_id text,
    instance text
);
CREATE INDEX fetch_audit_ref ON fetch_audit (ref, id);
