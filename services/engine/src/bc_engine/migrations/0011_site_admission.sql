-- Issue 25: per-site admission (docs/engine.md, "Admission"). A workflow on a node of a site runs
-- its steps only once admitted; at most [engine] site_admission of a site's running workflows are
-- admitted at once, and the others wait in the order they were started, with no step started, so
-- no deadline of theirs runs while they wait. site_id is the node's site when the workflow
-- started (NULL: a workflow with no node, never queued). Workflows running before this migration
-- are admitted.
ALTER TABLE workflows ADD COLUMN site_id text;
ALTER TABLE workflows ADD COLUMN admitted boolean NOT NULL DEFAULT true;
UPDATE workflows w SET site_id = n.site_id FROM nodes n WHERE n.id = w.node_id AND w.state = 'running';
-- the admitted running workflows of a site (counted at every start and admission) ...
CREATE INDEX workflows_site_admitted ON workflows (site_id)
    WHERE state = 'running' AND admitted AND site_id IS NOT NULL;
-- ... and the queued ones, oldest first
CREATE INDEX workflows_site_queued ON workflows (site_id, created_at, id)
    WHERE state = 'running' AND NOT admitted;
