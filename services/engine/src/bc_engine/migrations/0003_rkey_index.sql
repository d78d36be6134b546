-- A reconciler pass reads the running workflows of its key and the aborted ones that still
-- have commands to cancel; the partial index on running alone could not serve that OR.
DROP INDEX workflows_rkey_running;
CREATE INDEX workflows_rkey_live ON workflows (rkey) WHERE state = 'running' OR cancel_commands;
