-- Enrollment rules (docs/metal.md, "Enrollment rules"): a discovered node whose labels and
-- inventory facts match a rule's selector is enrolled by it when its discovery inventory arrives.
-- The BMC template names its credential by a template secret's ref; the node gets its own copy.
CREATE TABLE enrollment_rules (
    id          text PRIMARY KEY,
    tenant_id   text NOT NULL,
    name        text NOT NULL,
    priority    int NOT NULL DEFAULT 100,    -- lower first; then by name
    site_id     text,                        -- only nodes discovered at this site (NULL: any)
    selector    text NOT NULL,               -- a label expression over labels and inventory facts
    labels      jsonb NOT NULL DEFAULT '{}', -- given to the node
    bmc         jsonb,                       -- {driver, address (template), credentialsRef?, ...}
    created_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (tenant_id, name)
);
-- Which rule enrolled a node (NULL: an operator, or not enrolled).
ALTER TABLE nodes ADD COLUMN enrolled_by_rule text;
