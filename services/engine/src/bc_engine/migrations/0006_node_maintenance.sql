-- Issue 26: a node in maintenance ({reason, by, at}; NULL when not) runs no lifecycle verb and
-- no workflow (INVALID_STATE, reason node-in-maintenance); bulk verbs skip it and say so.
-- `bcx nodes maintenance on|off` sets it (nodes.maintenance, audited with who asked).
ALTER TABLE nodes ADD COLUMN maintenance jsonb;
