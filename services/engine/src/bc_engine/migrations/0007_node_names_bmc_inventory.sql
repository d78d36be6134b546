-- Issue 26: an operator's name for a node (`bcx nodes enroll --name lab1-m001`), unique in its
-- site; NULL for a node nobody named. bcx takes it wherever it takes a node id.
ALTER TABLE nodes ADD COLUMN name text;
CREATE UNIQUE INDEX nodes_site_name ON nodes (site_id, name) WHERE name IS NOT NULL;
-- What the node's BMC says of the machine (management.inventory: system, processors, memory,
-- NICs), kept by the metal.enroll profile's enroll.readBmc step; NULL until it ran.
ALTER TABLE nodes ADD COLUMN bmc_inventory jsonb;
