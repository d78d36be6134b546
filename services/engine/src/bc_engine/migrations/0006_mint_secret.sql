-- A random secret per step, made the first time a run of it mints a join token through
-- ctx.pki: the tokens are derived from it and bc-pki's token key, so a re-run of the attempt
-- (here, on any engine) gets them back and no other caller of tokens.issue can. Never shown.
ALTER TABLE workflow_steps ADD COLUMN mint_secret bytea;
