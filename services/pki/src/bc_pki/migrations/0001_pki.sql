-- The CA of the deployment: one row. Private material is sealed under the key file
-- (see bc_pki.keyring); the first instance to start creates it under an advisory lock.
CREATE TABLE ca (
    id smallint PRIMARY KEY CHECK (id = 1),
    certificate_pem text NOT NULL,
    fingerprint_sha256 text NOT NULL,
    key_sealed bytea NOT NULL,
    token_key_sealed bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- Join tokens. Only sha256(token) is stored, never the token.
CREATE TABLE join_tokens (
    id text PRIMARY KEY,
    token_hash bytea NOT NULL UNIQUE,
    idempotency_key text UNIQUE,
    tenant_id text NOT NULL,
    role text NOT NULL CHECK (role IN ('node', 'site', 'provisioned', 'discovery')),
    site_id text NOT NULL,
    node_id text,
    expect jsonb NOT NULL DEFAULT '{}',
    ttl_seconds int NOT NULL CHECK (ttl_seconds > 0),
    max_uses int NOT NULL CHECK (max_uses > 0),
    uses int NOT NULL DEFAULT 0 CHECK (uses >= 0 AND uses <= max_uses),
    expires_at timestamptz NOT NULL,
    revoked_at timestamptz,
    revoke_reason text,
    note text,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX join_tokens_tenant ON join_tokens (tenant_id, created_at DESC);

CREATE TABLE certificates (
    id text PRIMARY KEY,
    agent_id text NOT NULL,
    tenant_id text NOT NULL,
    site_id text NOT NULL,
    role text NOT NULL,
    join_token_id text REFERENCES join_tokens (id),
    serial text NOT NULL UNIQUE,
    key_type text NOT NULL,
    public_key bytea NOT NULL,
    certificate_pem text NOT NULL,
    claims jsonb NOT NULL DEFAULT '{}',
    not_before timestamptz NOT NULL,
    not_after timestamptz NOT NULL,
    revoked_at timestamptz,
    revoke_reason text,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX certificates_agent ON certificates (agent_id, created_at DESC);
CREATE INDEX certificates_join_token ON certificates (join_token_id);

-- Every join attempt, granted or refused.
CREATE TABLE join_audit (
    id bigserial PRIMARY KEY,
    at timestamptz NOT NULL DEFAULT now(),
    outcome text NOT NULL,
    code text,
    join_token_id text,
    cert_id text,
    agent_id text,
    claims jsonb,
    detail text,
    instance text
);
CREATE INDEX join_audit_token ON join_audit (join_token_id, id);

-- Signed data already verified with once=true, kept past the freshness window.
CREATE TABLE seen_signatures (
    signer text NOT NULL,
    digest bytea NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (signer, digest)
);
CREATE INDEX seen_signatures_expiry ON seen_signatures (expires_at);
