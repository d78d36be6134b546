-- A template secret (an enrollment rule's BMC credential) belongs to neither a workflow step nor a
-- node: the engine copies it into the standing secret of each node the rule enrolls, and the
-- fetch gate refuses it to every agent. A secret still never belongs to both.
ALTER TABLE secrets DROP CONSTRAINT secrets_check;
ALTER TABLE secrets ADD CONSTRAINT secrets_one_owner CHECK (workflow_id IS NULL OR node_id IS NULL);
