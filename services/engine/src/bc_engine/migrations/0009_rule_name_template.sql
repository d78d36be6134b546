-- Issue 26: an enrollment rule names the nodes it enrolls (`--name-template rack1-{inventory.serial}`);
-- NULL: the node keeps the name its reported host name gave it at discovery.
ALTER TABLE enrollment_rules ADD COLUMN name_template text;
