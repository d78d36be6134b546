-- Which journal of its agent claimed a command (the agent SDK's journal id) and when that claim
-- was signed. A claim of the same command from another journal of the same agent (a wiped state
-- folder, a RAM-disk agent, a node's bcd back in its new OS) means the first journal may have
-- started it and forgotten: the command is then settled, never run again.
ALTER TABLE commands ADD COLUMN claim_journal text, ADD COLUMN claim_signed_ms bigint;
