-- What an attempt of a control-plane step minted through ctx.pki / ctx.secrets ('pki',
-- 'secrets'): the next attempt (or an abort) revokes it first.
ALTER TABLE workflow_steps ADD COLUMN minted text[] NOT NULL DEFAULT '{}';
-- What a step waits for now, shown in workflows.get: one of our services that does not answer,
-- or the previous attempt's commands that still run at their agents.
ALTER TABLE workflow_steps ADD COLUMN waiting_for jsonb;
