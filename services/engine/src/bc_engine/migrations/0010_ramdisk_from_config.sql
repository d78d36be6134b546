-- Issue 26: [ramdisk] of bc.toml changed while the engines run. Row 2 of ramdisk_override holds
-- {doc: the new ramdisk, replaces: the one the engines started with}, written by an engine that
-- read its bc.toml again (set_by NULL: the configuration, not an operator); metal.ensureRamdisk
-- boots doc instead of replaces (better_compute.metal.steps.ramdisk.configured_in_force). Row 1
-- stays the operator's (bcx ramdisk set), which wins.
ALTER TABLE ramdisk_override DROP CONSTRAINT ramdisk_override_id_check;
ALTER TABLE ramdisk_override ADD CONSTRAINT ramdisk_override_id_check CHECK (id IN (1, 2));
ALTER TABLE ramdisk_override ALTER COLUMN set_by DROP NOT NULL;
