-- A cancel is a handshake (docs/command-queue.md, Cancel): a command its agent had claimed is
-- `cancelling` until the agent says it stopped it, or never started it; only then `cancelled`,
-- which means nothing more of it reaches a machine.
ALTER TABLE commands DROP CONSTRAINT commands_state_check;
ALTER TABLE commands ADD CONSTRAINT commands_state_check CHECK (state IN ('pending', 'dispatched',
    'acked', 'running', 'cancelling', 'succeeded', 'failed', 'rejected', 'expired', 'cancelled'));
-- an agent's heartbeat and checks ask for its cancelling commands
CREATE INDEX commands_cancelling ON commands (agent_id) WHERE state = 'cancelling';
