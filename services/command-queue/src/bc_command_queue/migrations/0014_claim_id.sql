-- Issue 25, item 5 (the command path's cost): a claim names the random id its agent journaled
-- with the command before it sent it (wire Ack.claim_id). A claim with one marks the command
-- `running` at once, so the agent sends no `running` mark of its own (a signed event and a
-- statement a command); a claim of a running command is taken again only from the same journal
-- with the same id (its answer was lost, or the agent died before it journaled the start). NULL:
-- the claim named none (an older agent): `acked`, and the agent's first progress marks it running.
ALTER TABLE commands ADD COLUMN claim_id text;
