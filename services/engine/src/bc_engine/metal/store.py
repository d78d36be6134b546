"""Metal's statements over ``nodes`` (the lifecycle, node facts) in the style of ``store``: each
written once, with ``$n`` parameters."""

from __future__ import annotations

# Nodes of a bulk verb, locked in id order (two bulks over the same nodes never deadlock).
LOCK_NODES = "SELECT * FROM nodes WHERE id = ANY($1::text[]) ORDER BY id FOR UPDATE"
NODES_BY_IDS = "SELECT * FROM nodes WHERE id = ANY($1::text[])"
RUNNING_ON_NODES = "SELECT node_id, id FROM workflows WHERE node_id = ANY($1::text[]) AND state = 'running'"
# By selector: $1 site (NULL: any), $2 labels that must all match, $3 tenant (NULL: any).
NODES_BY_SELECTOR = (
    "SELECT id FROM nodes WHERE ($1::text IS NULL OR site_id = $1) AND labels @> $2::jsonb"
    " AND ($3::text IS NULL OR tenant_id = $3) ORDER BY id LIMIT $4"
)
# A verb starts: the node's …ing state and its workflow; $4 the image (deploy; NULL keeps it).
# Only inspect and retire start on a quarantined node: the operator's look, which clears it.
BEGIN_VERB = (
    "UPDATE nodes SET state = $2, workflow_id = $3, state_reason = NULL, image = coalesce($4, image),"
    " quarantine = NULL,"
    " updated_at = now() WHERE id = $1 RETURNING *"
)
# enroll of a discovered node: its BMC, MACs and labels given; $5 a name (NULL keeps its own).
ENROLL_DISCOVERED = (
    "UPDATE nodes SET state = 'enrolled', bmc = coalesce($2::jsonb, bmc), name = coalesce($5, name),"
    " macs = CASE WHEN cardinality($3::text[]) > 0 THEN $3::text[] ELSE macs END,"
    " labels = labels || $4::jsonb, updated_at = now() WHERE id = $1 AND state = 'discovered' RETURNING *"
)
# The node a metal workflow moves: running it now, or failed by it (a retry may still succeed).
NODE_OF_WORKFLOW = (
    "SELECT * FROM nodes WHERE id = $1 AND (workflow_id = $2"
    " OR (state = 'failed' AND state_reason ->> 'workflowId' = $2)) FOR UPDATE"
)
# Success: the next state; $3 a new host section (bumps generation) or NULL; $4 drop the image.
FINISH_OK = """
UPDATE nodes SET state = $2, workflow_id = NULL, state_reason = NULL,
    host_section = coalesce($3::jsonb, host_section),
    generation = generation + CASE WHEN $3::jsonb IS NULL THEN 0 ELSE 1 END,
    image = CASE WHEN $4 THEN NULL ELSE image END, updated_at = now()
WHERE id = $1 RETURNING *
"""
# workflows.retry / resume of the workflow that failed the node: the node runs the verb again
# (a deploy names the image it installs again: stateReason.image).
REOPEN_NODE = (
    "UPDATE nodes SET state = $3, workflow_id = $2, state_reason = NULL,"
    " image = coalesce(state_reason ->> 'image', image), updated_at = now()"
    " WHERE id = $1 AND state = 'failed' AND state_reason ->> 'workflowId' = $2 RETURNING *"
)
# Failure or abort: $3 drops the image (a deploy that did not finish installed none whole).
FINISH_FAILED = (
    "UPDATE nodes SET state = 'failed', workflow_id = NULL, state_reason = $2, last_error = $2,"
    " image = CASE WHEN $3 THEN NULL ELSE image END, updated_at = now() WHERE id = $1 RETURNING *"
)
# Another workflow of the batch $1 (a bulk verb's) still running: the batch stays open for it.
BATCH_STILL_RUNNING = (
    "SELECT id FROM workflows WHERE batch_id = $1 AND id <> $2 AND state = 'running' LIMIT 1"
)
# The step that stopped a workflow: failed, else cancelled by an abort.
STOPPED_STEP = (
    "SELECT idx, action, state, error FROM workflow_steps WHERE workflow_id = $1"
    " AND state IN ('failed', 'cancelled') ORDER BY state = 'failed' DESC, idx LIMIT 1"
)
# The power the workflow's last succeeded power step left (an agent step or metal's relaying one).
LAST_POWER_ACTION = (
    "SELECT input ->> 'action' FROM workflow_steps WHERE workflow_id = $1 AND state = 'succeeded'"
    " AND (action = 'power.setPower' OR command = 'power.setPower') ORDER BY idx DESC LIMIT 1"
)
# The running step of a workflow and what it waits for (nodes.get).
RUNNING_STEP = (
    "SELECT w.state AS workflow_state, w.profile_id, w.batch_id, w.admitted, w.site_id, s.idx, s.action,"
    " s.waiting_for"
    " FROM workflows w LEFT JOIN workflow_steps s ON s.workflow_id = w.id AND s.state = 'running'"
    " WHERE w.id = $1 ORDER BY s.idx LIMIT 1"
)
# bcd's report of a host section applied whole (never goes back).
OBSERVED_GENERATION = (
    "UPDATE nodes SET observed_generation = $2, updated_at = now()"
    " WHERE id = $1 AND observed_generation < $2 AND $2 <= generation RETURNING *"
)
SET_LAST_ERROR = "UPDATE nodes SET last_error = $2, updated_at = now() WHERE id = $1 RETURNING *"
POWER_STATE = (
    "UPDATE nodes SET power_state = $2, updated_at = now()"
    " WHERE id = $1 AND power_state IS DISTINCT FROM $2 RETURNING *"
)
# The hostConfig of a workflow that was no lifecycle verb: a new host section, when it differs
# (so a second run for the same workflow bumps nothing).
SET_HOST_SECTION = """
UPDATE nodes SET host_section = $2::jsonb, generation = generation + 1, updated_at = now()
WHERE id = $1 AND host_section IS DISTINCT FROM $2::jsonb RETURNING *
"""
LOCK_NODE = "SELECT * FROM nodes WHERE id = $1 FOR UPDATE"
# A workflow started on the node after $2: the hostConfig of $2 is no longer the latest word.
NEWER_WORKFLOW = (
    "SELECT id FROM workflows WHERE node_id = $1 AND id <> $2"
    " AND created_at > (SELECT created_at FROM workflows WHERE id = $2) LIMIT 1"
)
