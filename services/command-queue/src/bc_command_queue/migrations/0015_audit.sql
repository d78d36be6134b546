-- Operator actions (docs/audit.md), written by the service skeleton after an audited route
-- succeeded; read by audit.list. Numbered 0015 so that migrations added meanwhile keep theirs.
CREATE TABLE audit (
    id       bigserial PRIMARY KEY,
    at       timestamptz NOT NULL DEFAULT now(),
    actor    text,
    action   text NOT NULL,
    target   text,
    detail   json NOT NULL DEFAULT '{}',
    instance text
);
CREATE INDEX audit_at ON audit (at);
CREATE INDEX audit_actor ON audit (actor, id);
