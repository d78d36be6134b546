-- Issue 26: an enrollment rule names the nodes it enrolls (`--name-template rack1-{inventory.serial}`);
-- NULL: the node keeps the name its reported host name gave it at discovery.
ALTER TABLE enrollment_rules ADD COLUMN name_template text;
-- Issue 26: image signers an operator adds while the engines run (`bcx images signers add`),
-- beside those of [images] signers and plugins that every engine writes at its start. added_by:
-- who added it; NULL for a configured one. An engine's start replaces only the configured ones.
ALTER TABLE image_signers ADD COLUMN added_by text;
-- Issue 26: the ramdisk an operator sets while the engines run (`bcx ramdisk set`), one row:
-- the shipped lifecycle profiles boot it over [ramdisk] of bc.toml (metal.ensureRamdisk reads it
-- at each run). doc: {kernel, initrd, kernelSha256, initrdSha256, cmdline, script}.
CREATE TABLE ramdisk_override (
    id         int PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    doc        jsonb NOT NULL,
    set_by     text NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
