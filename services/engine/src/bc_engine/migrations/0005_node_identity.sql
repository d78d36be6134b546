-- Issue 23 (identity on the boot network). A node whose one-time ramdisk token was seen twice
-- (its boot entry asked for again, or a second join) is quarantined: {reason, message, at,
-- joinTokenId, mac}. Only inspect and retire start on it (an operator's look), and clear it.
ALTER TABLE nodes ADD COLUMN quarantine jsonb;
-- A discovery that showed this node's hardware with other claims (other MACs, serial, ...):
-- {certId, agentId, claims, at}; never applied without an operator.
ALTER TABLE nodes ADD COLUMN discovery_conflict jsonb;
