-- Issue 25: every run of a control-plane step read its node's inventory (`ctx.node.inventory`),
-- eleven statements a machine in a deploy, though the inventory changes once an inspection.
-- `inventory_version` names the inventory a node has: a new number from one sequence whenever
-- the inventory is set or changed, whatever statement does it (a trigger), so no two inventories
-- of any node ever share one. The engine's pass reads it with the node and keeps the inventory
-- of the version it read last (steps/host.py); a node without an inventory reads none.
CREATE SEQUENCE inventory_versions;
ALTER TABLE nodes ADD COLUMN inventory_version bigint NOT NULL DEFAULT nextval('inventory_versions');

-- the sequence is named as the migration's search path finds it, whatever the session's is
CREATE FUNCTION node_inventory_changed() RETURNS trigger LANGUAGE plpgsql
    SET search_path FROM CURRENT AS $$
BEGIN
    NEW.inventory_version := nextval('inventory_versions');
    RETURN NEW;
END
$$;

CREATE TRIGGER nodes_inventory_version BEFORE UPDATE OF inventory ON nodes
    FOR EACH ROW WHEN (OLD.inventory IS DISTINCT FROM NEW.inventory)
    EXECUTE FUNCTION node_inventory_changed();
