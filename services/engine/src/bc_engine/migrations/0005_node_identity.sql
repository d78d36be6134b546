-- Issue 23 (identity on the boot network). A node whose one-time ramdisk token was seen twice
-- (its boot entry asked for again, or a second join) is quarantined: {reason, message, at,
-- joinTokenId, mac}. Only inspect and retire start on it (an operator's look), and clear it.
ALTER TABLE nodes ADD COLUMN quarantine jsonb;
-- A discovery that showed this node's hardware with other claims (other MACs, serial, ...):
-- {certId, agentId, claims, at}; never applied without an operator.
ALTER TABLE nodes ADD COLUMN discovery_conflict jsonb;
-- A rule matched this discovered node with a BMC address taken from the machine's own report:
-- {ruleId, ruleName, bmc: {driver, address, systemId}, at}; enrolled only once an operator
-- confirms it (enrollmentRules.confirm).
ALTER TABLE nodes ADD COLUMN pending_enrollment jsonb;
