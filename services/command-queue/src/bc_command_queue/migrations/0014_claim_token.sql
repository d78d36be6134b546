-- A claim that starts its command (docs/command-queue.md, Claims): the agent journals the command
-- started, with a token of its own, before it sends the claim; the claim marks the command
-- running at once, and only a claim with the same token from the same journal (its answer was
-- lost) is answered "go on" again. A journal restored from an older copy has no such entry, so
-- its claim carries another token and is refused: the command may have run.
ALTER TABLE commands ADD COLUMN claim_token text;
