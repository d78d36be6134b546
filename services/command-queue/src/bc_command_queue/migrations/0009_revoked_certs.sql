-- Issue 23 L4: a certificate bc-pki revoked (learnt from its revocation event, confirmed with
-- bc-pki). Its agent is shown disconnected and loses its boot lease at once; an event it signed
-- that was checked before the revocation reached this service (a cached certificate) can then
-- neither bring its presence back nor renew its lease.
CREATE TABLE revoked_certs (
    cert_id    text PRIMARY KEY,
    revoked_at timestamptz NOT NULL DEFAULT now()
);
