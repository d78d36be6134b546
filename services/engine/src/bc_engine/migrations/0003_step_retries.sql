-- Retry policies (docs/engine.md, Retries): the policy a step resolved with (the profile step's
-- retry, else its definition's default), when its next attempt may start after a failure, the
-- failed attempts it had (each one's error and times), and the attempt an operator's retry or
-- resume started counting from.
ALTER TABLE workflow_steps ADD COLUMN retry jsonb;
ALTER TABLE workflow_steps ADD COLUMN retry_at timestamptz;
ALTER TABLE workflow_steps ADD COLUMN attempts jsonb NOT NULL DEFAULT '[]';
ALTER TABLE workflow_steps ADD COLUMN retry_base int NOT NULL DEFAULT 0;
