"""The engine's schema as the code sees it: every SQL statement of the service, and the typed rows
the reconciler reads. Metal's statements over nodes are in ``metal_store`` and the image catalog's
in ``images_store``, in the same style; everything else is here (over 400 lines for that reason:
one place to read and review every query the reconciler, the work queue, the shard leases and the
routes run).

Each statement is written out once, here, with ``$n`` parameters, and never assembled at run time.
The fence (``this life still holds the key's shard under the epoch it started with``) is spelled
out in each statement that needs it so that it commits in the same statement as the write.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec

__all__ = ["NodeRow", "StepRow", "WorkflowRow", "step_row", "workflow_row"]


class WorkflowRow(msgspec.Struct, kw_only=True):
    """A row of ``workflows``; the reconciler updates ``state`` and ``batch_id`` as it goes."""

    id: str
    tenant_id: str
    node_id: str | None
    rkey: str
    profile_tenant: str
    profile_id: str
    profile_version: int
    state: str
    owner: str | None
    command_kinds: list[str]
    batch_id: str | None
    cancel_commands: bool
    error: Any = None
    site_id: str | None = None
    admitted: bool = True


class StepRow(msgspec.Struct, kw_only=True):
    """A row of ``workflow_steps``; JSON columns come decoded."""

    workflow_id: str
    idx: int
    action: str
    runs_on: str
    mode: str
    command: str | None
    input: Any
    timeout_ms: int
    state: str
    attempt: int
    started_at: datetime | None
    deadline: datetime | None
    finished_at: datetime | None
    result: Any = None
    error: Any = None
    command_id: str | None = None
    sends: list[str] = []
    sent_commands: bool = False
    minted: list[str] = []
    waiting_for: Any = None
    retry: Any = None
    retry_at: datetime | None = None
    attempts: list[Any] = []
    retry_base: int = 0

    @property
    def step(self) -> int:
        """The step's index, so a row stands for its attempt's coordinates (``step_command_key``)."""
        return self.idx


class NodeRow(msgspec.Struct, kw_only=True):
    id: str
    tenant_id: str
    site_id: str
    labels: dict[str, str]
    macs: list[str] = []
    bmc: dict[str, Any] | None = None
    state: str = "enrolled"


def workflow_row(record: Any) -> WorkflowRow:
    """A fetched ``workflows`` row (extra columns are ignored)."""
    return msgspec.convert(dict(record), WorkflowRow)


def step_row(record: Any) -> StepRow:
    """A fetched ``workflow_steps`` row, or one that came back as JSON (``row_to_json``)."""
    return msgspec.convert(record if isinstance(record, dict) else dict(record), StepRow)


def node_row(record: Any) -> NodeRow:
    """A fetched ``nodes`` row, or the ``node_info`` object of ``PASS_WORKFLOWS``; JSON columns may
    come as text."""
    raw = dict(record)
    for key in ("labels", "bmc"):
        if isinstance(raw.get(key), str):
            raw[key] = msgspec.json.decode(raw[key])
    return msgspec.convert(raw, NodeRow)


# -- the reconciler pass (engine.py) --------------------------------------------------------

# The workflows a pass over a key looks at, with the key's work-queue seq and each workflow's node
# as its steps see it (``node_info``, NULL without one): one round trip. The node's inventory is
# not read along (a pass seldom runs a control-plane step), only which one it is
# (``inventory_version``, NULL without one: steps/host.py keeps the inventory of each version).
PASS_WORKFLOWS = (
    "SELECT (SELECT seq FROM work_queue WHERE rkey = $1) AS queue_seq,"
    " (SELECT json_build_object('id', n.id, 'tenant_id', n.tenant_id, 'site_id', n.site_id,"
    "   'labels', n.labels, 'macs', n.macs, 'bmc', n.bmc, 'state', n.state,"
    "   'inventory_version', CASE WHEN n.inventory IS NOT NULL THEN n.inventory_version END)"
    "  FROM nodes n WHERE n.id = w.node_id) AS node_info, w.* FROM workflows w"
    " WHERE w.rkey = $1 AND (w.state = 'running' OR w.cancel_commands) ORDER BY w.created_at"
)
WORKFLOW = "SELECT * FROM workflows WHERE id = $1"
SET_BATCH = "UPDATE workflows SET batch_id = $2, updated_at = now() WHERE id = $1 AND batch_id IS NULL"
SET_BATCH_RETURNING = "UPDATE workflows SET batch_id = $2 WHERE id = $1 RETURNING *"
# $1-$3: shard, owner, epoch.
HOLDS_SHARD = (
    "SELECT EXISTS (SELECT 1 FROM shard_leases WHERE shard = $1 AND owner = $2 AND epoch = $3"
    " AND expires_at > now())"
)
# The usual case, the first step to start, in one statement; only if no earlier attempt of it sent
# commands or minted tokens or secrets (those are dealt with first). $2-$4 the fence.
START_FIRST = """
UPDATE workflow_steps SET state = 'running', attempt = attempt + 1, started_at = clock_timestamp(),
    deadline = clock_timestamp() + make_interval(secs => timeout_ms / 1000.0), finished_at = NULL,
    sent_commands = false, minted = ARRAY[]::text[], waiting_for = NULL, result = NULL, error = NULL,
    command_id = NULL
WHERE workflow_id = $1 AND state = 'pending'
  AND (attempt = 0 OR NOT (sent_commands OR cardinality(minted) > 0))
  AND (retry_at IS NULL OR retry_at <= clock_timestamp())
  AND idx = (SELECT min(idx) FROM workflow_steps WHERE workflow_id = $1 AND state <> 'succeeded')
  AND EXISTS (SELECT 1 FROM shard_leases WHERE shard = $2 AND owner = $3 AND epoch = $4
              AND expires_at > now())
RETURNING *
"""
NEXT_STEP = (
    "SELECT * FROM workflow_steps WHERE workflow_id = $1 AND state <> 'succeeded' ORDER BY idx LIMIT 1"
)
# A new attempt starts only if what the previous one sent or minted is what the pass saw (and
# dealt with): an engine that lost its shard may still run the previous attempt meanwhile.
# $1 workflow, $2 idx, $3 attempt seen, $4 sent_commands seen, $5 minted seen, $6-$8 the fence.
MARK_RUNNING = """
UPDATE workflow_steps SET state = 'running', attempt = attempt + 1, started_at = clock_timestamp(),
    deadline = clock_timestamp() + make_interval(secs => timeout_ms / 1000.0), finished_at = NULL,
    sent_commands = false, minted = ARRAY[]::text[], waiting_for = NULL, result = NULL, error = NULL,
    command_id = NULL
WHERE workflow_id = $1 AND idx = $2 AND state = 'pending' AND attempt = $3
  AND sent_commands = $4 AND minted = $5::text[]
  AND EXISTS (SELECT 1 FROM shard_leases WHERE shard = $6 AND owner = $7 AND epoch = $8
              AND expires_at > now())
RETURNING *
"""
# Settle successes, start each one's next step, or finish its workflow (and queue its owner): one
# statement for every step the process's passes settle at once (``GroupCommit``), so one round
# trip and one commit for all of them. Each row is settled, started or finished only on its own
# terms (its attempt, its fence), as if alone. Arrays, one element per step: $1 workflow, $2 idx,
# $3 attempt, $4 result (JSON text), $5-$7 fence, $8 owner's work-queue key (or NULL), $9 its shard.
SETTLE_OK = """
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::int[], $3::int[], $4::text[], $5::int[], $6::text[],
                         $7::bigint[], $8::text[], $9::int[])
        AS i(workflow_id, idx, attempt, result, shard, owner, epoch, owner_rkey, owner_shard)
), settled AS (
    UPDATE workflow_steps s SET state = 'succeeded', result = i.result::jsonb,
        finished_at = clock_timestamp(), waiting_for = NULL
    FROM input i
    WHERE s.workflow_id = i.workflow_id AND s.idx = i.idx AND s.state = 'running' AND s.attempt = i.attempt
      AND EXISTS (SELECT 1 FROM shard_leases l WHERE l.shard = i.shard AND l.owner = i.owner
                  AND l.epoch = i.epoch AND l.expires_at > now())
    RETURNING s.workflow_id, s.idx
), following AS (
    SELECT d.workflow_id, (SELECT min(f.idx) FROM workflow_steps f WHERE f.workflow_id = d.workflow_id
                           AND f.idx > d.idx AND f.state <> 'succeeded') AS idx
    FROM settled d
), started AS (
    UPDATE workflow_steps s SET state = 'running', attempt = s.attempt + 1, started_at = clock_timestamp(),
        deadline = clock_timestamp() + make_interval(secs => s.timeout_ms / 1000.0), finished_at = NULL,
        sent_commands = false, minted = ARRAY[]::text[], waiting_for = NULL, result = NULL,
        error = NULL, command_id = NULL
    FROM following f
    WHERE s.workflow_id = f.workflow_id AND s.idx = f.idx AND s.state = 'pending'
      AND (s.attempt = 0 OR NOT (s.sent_commands OR cardinality(s.minted) > 0))
    RETURNING s.*
), finished AS (
    UPDATE workflows w SET state = 'succeeded', finished_at = now(), updated_at = now()
    FROM following f
    WHERE w.id = f.workflow_id AND f.idx IS NULL AND w.state = 'running'
    RETURNING w.id
), owner_queued AS (
    INSERT INTO work_queue (rkey, shard, not_before)
    SELECT i.owner_rkey, i.owner_shard, now() FROM finished f JOIN input i ON i.workflow_id = f.id
    WHERE i.owner_rkey IS NOT NULL
    ON CONFLICT (rkey) DO UPDATE SET not_before = now(), seq = nextval('work_seq')
)
SELECT i.workflow_id,
       EXISTS (SELECT 1 FROM settled d WHERE d.workflow_id = i.workflow_id) AS settled,
       EXISTS (SELECT 1 FROM finished f WHERE f.id = i.workflow_id) AS finished,
       (SELECT row_to_json(st) FROM started st WHERE st.workflow_id = i.workflow_id) AS next
FROM input i
"""
# $1 workflow, $2 idx, $3 attempt, $4 error, $5-$7 the fence. The failed attempt joins the step's
# attempts (its error and times), so an operator's retry still shows it.
SETTLE_FAILED = """
UPDATE workflow_steps SET state = 'failed', result = NULL, error = $4, finished_at = clock_timestamp(),
    waiting_for = NULL,
    attempts = attempts || jsonb_build_array(jsonb_build_object('attempt', attempt,
        'startedAt', started_at, 'finishedAt', clock_timestamp(), 'error', $4::jsonb))
WHERE workflow_id = $1 AND idx = $2 AND state = 'running' AND attempt = $3
  AND EXISTS (SELECT 1 FROM shard_leases WHERE shard = $5 AND owner = $6 AND epoch = $7
              AND expires_at > now())
RETURNING true
"""
# A failed attempt its retry policy retries: the step goes back to pending, its next attempt not
# before $8 seconds from now. $1 workflow, $2 idx, $3 attempt, $4 error, $5-$7 the fence, $8 delay.
SETTLE_RETRY = """
UPDATE workflow_steps SET state = 'pending', result = NULL, error = $4, finished_at = clock_timestamp(),
    waiting_for = NULL, retry_at = clock_timestamp() + make_interval(secs => $8),
    attempts = attempts || jsonb_build_array(jsonb_build_object('attempt', attempt,
        'startedAt', started_at, 'finishedAt', clock_timestamp(), 'error', $4::jsonb,
        'retryAt', clock_timestamp() + make_interval(secs => $8)))
WHERE workflow_id = $1 AND idx = $2 AND state = 'running' AND attempt = $3
  AND EXISTS (SELECT 1 FROM shard_leases WHERE shard = $5 AND owner = $6 AND epoch = $7
              AND expires_at > now())
RETURNING retry_at
"""
FINISH_WORKFLOW = (
    "UPDATE workflows SET state = $2, error = $3, finished_at = now(), updated_at = now()"
    " WHERE id = $1 AND state = 'running' RETURNING true"
)
# Both record what an attempt did, and only for that attempt (a superseded one learns so).
MARK_SENT = (
    "UPDATE workflow_steps SET sent_commands = true"
    " WHERE workflow_id = $1 AND idx = $2 AND attempt = $3 RETURNING true"
)
MARK_MINTED = (
    "UPDATE workflow_steps SET minted = CASE WHEN $4 = ANY (minted) THEN minted ELSE minted || $4 END,"
    " mint_secret = COALESCE(mint_secret, $5)"
    " WHERE workflow_id = $1 AND idx = $2 AND attempt = $3 RETURNING mint_secret"
)
SET_WAITING = (
    "UPDATE workflow_steps SET waiting_for = $4 WHERE workflow_id = $1 AND idx = $2 AND attempt = $3"
)
SET_COMMAND = "UPDATE workflow_steps SET command_id = $3 WHERE workflow_id = $1 AND idx = $2"
# A control-plane step waits on a command of its attempt ($4, NULL: on none any more), and says
# so ($5, waitingFor); only for that attempt.
SET_WAITING_COMMAND = (
    "UPDATE workflow_steps SET command_id = $4, waiting_for = $5"
    " WHERE workflow_id = $1 AND idx = $2 AND attempt = $3"
)
# After an abort: the step it cancelled, and whether any attempt sent commands.
CANCELLED_STEP = (
    "SELECT * FROM workflow_steps WHERE workflow_id = $1 AND state = 'cancelled' ORDER BY idx LIMIT 1"
)
ANY_SENT = "SELECT bool_or(sent_commands) FROM workflow_steps WHERE workflow_id = $1"
# After an abort: every step attempt that minted tokens or secrets, succeeded ones included (a
# ramdisk's join token minted by an earlier step must stop working with the abort)
MINTED_STEPS = (
    "SELECT * FROM workflow_steps WHERE workflow_id = $1 AND attempt > 0 AND cardinality(minted) > 0"
    " AND state <> 'cancelled' ORDER BY idx"
)
CLEANED_UP = "UPDATE workflows SET cancel_commands = false WHERE id = $1"
STORED_PROFILE = "SELECT document FROM profiles WHERE tenant_id = $1 AND id = $2 AND version = $3"
NODE = "SELECT * FROM nodes WHERE id = $1"
NODE_SITE = "SELECT site_id FROM nodes WHERE id = $1"
NODE_INVENTORY = "SELECT inventory::text AS inventory, inventory_version FROM nodes WHERE id = $1"

# -- the service (service.py) ----------------------------------------------------------------

WORKFLOW_RKEY = "SELECT rkey FROM workflows WHERE id = $1"
# The work-queue poll of this process's shards. $1 shards, $2 how far ahead (seconds).
DUE_KEYS = (
    "SELECT rkey, extract(epoch FROM not_before) AS at FROM work_queue"
    " WHERE shard = ANY($1::int[]) AND not_before <= now() + make_interval(secs => $2)"
)
# Shards this process just took (its start, a dead engine's shards, a rebalance): every key of
# them not due within the poll. A pass that died (SIGKILL, a lost lease) may have been woken by an
# event, which lives in memory only, and have left its key due at an earlier wait's end: e.g.
# killed after it enqueued a step's next command and before it recorded that command as the one
# the step waits on. The new owner runs each such key once, so nothing hangs until a deadline.
GAINED_KEYS = (
    "SELECT rkey FROM work_queue"
    " WHERE shard = ANY($1::int[]) AND not_before > now() + make_interval(secs => $2)"
)
# The command watch: every command a running step of a workflow in these shards waits on.
WAITING_COMMANDS = (
    "SELECT s.command_id, w.rkey FROM workflows w JOIN workflow_steps s ON s.workflow_id = w.id"
    " WHERE w.state = 'running' AND w.shard = ANY($1::int[])"
    " AND s.state = 'running' AND s.command_id IS NOT NULL"
)
WAITING_ACTION = (
    "SELECT w.node_id, w.rkey, s.started_at FROM workflows w JOIN workflow_steps s ON s.workflow_id = w.id"
    " WHERE w.state = 'running' AND w.shard = ANY($1::int[]) AND w.node_id IS NOT NULL"
    " AND s.state = 'running' AND s.action = $2"
)

# -- the work queue (queue.py) ---------------------------------------------------------------

QUEUE_NOW = (
    "INSERT INTO work_queue (rkey, shard, not_before) VALUES ($1, $2, now())"
    " ON CONFLICT (rkey) DO UPDATE SET not_before = now(), seq = nextval('work_seq')"
)
QUEUE_SEQ = "SELECT seq FROM work_queue WHERE rkey = $1"
QUEUE_NEW_AT = (
    "INSERT INTO work_queue (rkey, shard, not_before) VALUES ($1, $2, to_timestamp($3))"
    " ON CONFLICT (rkey) DO NOTHING"
)
QUEUE_MOVE = "UPDATE work_queue SET not_before = to_timestamp($2) WHERE rkey = $1 AND seq = $3"
QUEUE_DONE = "DELETE FROM work_queue WHERE rkey = $1 AND seq = $2"

# -- shard leases (shards.py) ----------------------------------------------------------------
# An earlier (or later) life of our name: same "<instance>#" prefix, an incarnation of the same
# length, ordered by the incarnation's leading start time. $1 us, $2 "<instance>#".

MEMBER = (
    "INSERT INTO members (instance, expires_at) VALUES ($1, now() + make_interval(secs => $2))"
    " ON CONFLICT (instance) DO UPDATE SET expires_at = EXCLUDED.expires_at"
)
LATER_LIFE = (
    "SELECT true FROM members WHERE starts_with(instance, $2) AND length(instance) = length($1)"
    " AND instance > $1 AND expires_at > now()"
)
FORGET_EARLIER = (
    "DELETE FROM members WHERE starts_with(instance, $2) AND length(instance) = length($1) AND instance < $1"
)
ADOPT = (
    "UPDATE shard_leases SET owner = $1, epoch = epoch + 1, expires_at = now() + make_interval(secs => $3)"
    " WHERE starts_with(owner, $2) AND length(owner) = length($1) AND owner < $1 RETURNING shard, epoch"
)
LIVE_MEMBERS = "SELECT count(*) FROM members WHERE expires_at > now()"
RENEW = (
    "UPDATE shard_leases SET expires_at = now() + make_interval(secs => $2)"
    " WHERE owner = $1 AND expires_at > now() RETURNING shard, epoch"
)
TAKE = (
    "UPDATE shard_leases SET owner = $1, epoch = epoch + 1, expires_at = now() + make_interval(secs => $3)"
    " WHERE shard IN (SELECT shard FROM shard_leases WHERE owner IS NULL OR expires_at <= now()"
    "   ORDER BY shard LIMIT $2 FOR UPDATE SKIP LOCKED)"
    " RETURNING shard, epoch"
)
GIVE_BACK = (
    "UPDATE shard_leases SET owner = NULL, expires_at = now() WHERE owner = $1 AND shard = ANY($2::int[])"
)
RELEASE_ALL = "UPDATE shard_leases SET owner = NULL, expires_at = now() WHERE owner = $1"
LEAVE = "DELETE FROM members WHERE instance = $1"

# -- nodes and workflows (nodes_api.py, workflows_api.py) -----------------------------------

# A new node's generation 1 is the empty host section: nothing for bcd to apply, so it is
# observed from the start (a wait for observed >= generation must not wait for nothing).
# $7 the node's name (NULL: none); a name taken in the site is a unique violation
# (NODE_NAME_INDEX), answered CONFLICT.
CREATE_NODE = (
    "INSERT INTO nodes (id, tenant_id, site_id, labels, macs, bmc, observed_generation, name)"
    " VALUES ($1, $2, $3, $4, $5, $6, 1, $7) ON CONFLICT (id) DO NOTHING RETURNING *"
)
NODE_NAME_INDEX = "nodes_site_name"
# The node of a site with a name ($1 site, $2 name), other than $3: the one that holds it.
NAME_TAKEN = "SELECT id FROM nodes WHERE site_id = $1 AND name = $2 AND id IS DISTINCT FROM $3"
# A MAC belongs to one node: the node other than $2 that has one of $1.
MAC_TAKEN = "SELECT id, macs FROM nodes WHERE macs && $1::text[] AND id IS DISTINCT FROM $2 LIMIT 1"
# By id, optionally of one site or tenant. $3 the last id of the page before.
LIST_NODES = (
    "SELECT * FROM nodes WHERE ($1::text IS NULL OR site_id = $1)"
    " AND ($2::text IS NULL OR tenant_id = $2) AND ($3::text IS NULL OR id > $3)"
    " AND ($5::text IS NULL OR state = $5) AND ($6::jsonb IS NULL OR labels @> $6::jsonb)"
    " AND ($7::text IS NULL OR name = $7) ORDER BY id LIMIT $4"
)
LOCK_NODE = "SELECT id, state, quarantine, maintenance FROM nodes WHERE id = $1 FOR UPDATE"
# nodes.update / nodes.label: $2 site, $3 labels, $4 MACs, $5 BMC, $6 name (NULL keeps each);
# $7 true takes the name away.
UPDATE_NODE = (
    "UPDATE nodes SET site_id = coalesce($2, site_id), labels = coalesce($3::jsonb, labels),"
    " macs = coalesce($4::text[], macs), bmc = coalesce($5::jsonb, bmc),"
    " name = CASE WHEN $7::boolean THEN NULL ELSE coalesce($6::text, name) END,"
    " updated_at = now() WHERE id = $1 RETURNING *"
)
NODE_FOR_UPDATE = "SELECT * FROM nodes WHERE id = $1 FOR UPDATE"
# nodes.delete: finished workflows are kept (their rkey still names the node).
DETACH_NODE_WORKFLOWS = "UPDATE workflows SET node_id = NULL WHERE node_id = $1"
DELETE_NODE = "DELETE FROM nodes WHERE id = $1"
# The workflow running on a node, other than $2 (NULL: any).
NODE_BUSY = "SELECT id FROM workflows WHERE node_id = $1 AND state = 'running' AND id IS DISTINCT FROM $2"
# A workflow, its steps and its work-queue entry in one statement. $18 the key's shard, $19 each
# step's retry policy (JSON null for none). Admission (docs/engine.md): $20 the most running
# workflows of one site admitted at once (0: no limit), $21 whether this one may wait for that
# (false: a step's child, admitted at once). A workflow on a node is admitted when no workflow of
# its site waits and fewer than $20 run admitted; else it waits, with no work-queue entry, until
# an engine's admission pass (ADMIT_PICK, ADMIT_MARK) takes it. Two starts at the same instant in
# two transactions may both see room for one: the limit can be passed by the starts that race.
START_WORKFLOW = """
WITH site AS (
    SELECT n.site_id FROM nodes n WHERE n.id = $3
), wf AS (
    INSERT INTO workflows (id, tenant_id, node_id, rkey, shard, profile_tenant, profile_id,
                           profile_version, state, owner, command_kinds, site_id, admitted)
    VALUES ($1, $2, $3, $4, $18, $5, $6, $7, 'running', $8, $9, (SELECT site_id FROM site),
            NOT $21 OR $20 = 0 OR NOT EXISTS (SELECT 1 FROM site) OR (
                NOT EXISTS (SELECT 1 FROM workflows q WHERE q.site_id = (SELECT site_id FROM site)
                            AND q.state = 'running' AND NOT q.admitted)
                AND (SELECT count(*) FROM workflows a WHERE a.site_id = (SELECT site_id FROM site)
                     AND a.state = 'running' AND a.admitted) < $20))
    RETURNING *
), steps AS (
    INSERT INTO workflow_steps (workflow_id, idx, action, runs_on, mode, command, input, timeout_ms,
                                state, sends, retry)
    SELECT $1, s.idx, s.action, s.runs_on, s.mode, s.command, s.input, s.timeout_ms, 'pending',
           ARRAY(SELECT jsonb_array_elements_text(s.sends)), s.retry
    FROM unnest($10::int[], $11::text[], $12::text[], $13::text[], $14::text[], $15::jsonb[],
                $16::bigint[], $17::jsonb[], $19::jsonb[])
         AS s(idx, action, runs_on, mode, command, input, timeout_ms, sends, retry)
    RETURNING 1
), queued AS (
    INSERT INTO work_queue (rkey, shard, not_before) SELECT $4, $18, now() FROM wf WHERE wf.admitted
    ON CONFLICT (rkey) DO UPDATE SET not_before = now(), seq = nextval('work_seq')
    RETURNING 1
)
SELECT wf.*, (SELECT count(*) FROM steps) AS step_count FROM wf
"""
# An engine's admission pass (core/admission.py), under ADMIT_LOCK, in two statements: ADMIT_PICK
# chooses, at each site, the oldest waiting workflows, as many as the site has room for under $1;
# ADMIT_MARK admits them by id and queues their keys. Each is cheap when nothing waits (the partial
# index workflows_site_queued is empty), and neither joins the waiting rows back to the table: in
# one statement, right after a bulk verb inserted 10,000 rows and before PostgreSQL analyzed them,
# that join was planned as nested loops and ran for 10 minutes under the lock (10,000 machines).
ADMIT_LOCK = "SELECT pg_try_advisory_xact_lock(7302510225)"  # one admission pass at a time
ADMIT_TIMEOUT = "SET LOCAL statement_timeout = '10s'"  # a bad plan fails the pass, never holds the lock
ADMIT_PICK = """
WITH waiting AS (
    SELECT id, site_id, row_number() OVER (PARTITION BY site_id ORDER BY created_at, id) AS rn
    FROM workflows WHERE state = 'running' AND NOT admitted
), active AS (
    SELECT site_id, count(*) AS n FROM workflows
    WHERE state = 'running' AND admitted AND site_id IS NOT NULL
    GROUP BY site_id
)
SELECT q.id FROM waiting q LEFT JOIN active a ON a.site_id = q.site_id
WHERE q.rn <= $1 - coalesce(a.n, 0)
"""
ADMIT_MARK = """
WITH picked AS (
    UPDATE workflows SET admitted = true, updated_at = now()
    WHERE id = ANY($1::text[]) AND state = 'running' AND NOT admitted
    RETURNING id, rkey, shard, site_id
), queued AS (
    INSERT INTO work_queue (rkey, shard, not_before) SELECT rkey, shard, now() FROM picked
    ON CONFLICT (rkey) DO UPDATE SET not_before = now(), seq = nextval('work_seq')
)
SELECT id, rkey, site_id FROM picked
"""
# workflows.why of a waiting workflow: its site's admitted running workflows, and the waiting
# ones started before it ($2, $3: its created_at and id).
QUEUED_AHEAD = (
    "SELECT (SELECT count(*) FROM workflows WHERE site_id = $1 AND state = 'running' AND admitted)"
    " AS running, (SELECT count(*) FROM workflows WHERE site_id = $1 AND state = 'running'"
    " AND NOT admitted AND (created_at, id) < ($2, $3)) AS ahead"
)
# Sizes first, rows second: 512 steps with big results never sit in memory at once.
STEP_SIZES = (
    "SELECT idx, 512 + coalesce(octet_length(result::text), 0) + coalesce(octet_length(error::text), 0)"
    " AS size FROM workflow_steps WHERE workflow_id = $1 AND idx > $2 ORDER BY idx"
)
STEPS_BETWEEN = "SELECT * FROM workflow_steps WHERE workflow_id = $1 AND idx BETWEEN $2 AND $3 ORDER BY idx"
# Newest first; $5 the last id of the page before.
LIST_WORKFLOWS = (
    "SELECT * FROM workflows WHERE ($1::text IS NULL OR node_id = $1)"
    " AND ($2::text IS NULL OR state = $2) AND ($3::text IS NULL OR profile_id = $3)"
    " AND ($4::text IS NULL OR tenant_id = $4) AND ($5::text IS NULL OR id < $5)"
    " ORDER BY id DESC LIMIT $6"
)
LOCK_WORKFLOW = "SELECT * FROM workflows WHERE id = $1 FOR UPDATE"
# An abort has commands to cancel, or tokens and secrets the cancelled attempt minted to revoke.
ABORT_LEAVES_WORK = (
    "SELECT bool_or(sent_commands OR cardinality(minted) > 0) FROM workflow_steps WHERE workflow_id = $1"
)
ABORT_STEP = (
    "UPDATE workflow_steps SET state = 'cancelled', finished_at = now(), error = $2"
    " WHERE workflow_id = $1 AND state IN ('pending', 'running')"
    " AND idx = (SELECT min(idx) FROM workflow_steps WHERE workflow_id = $1"
    "   AND state IN ('pending', 'running'))"
)
ABORT_WORKFLOW = (
    "UPDATE workflows SET state = 'aborted', finished_at = now(), updated_at = now(),"
    " cancel_commands = $2, error = $3 WHERE id = $1"
)
# Retry and resume: the step that stopped the workflow goes back to pending.
# Its retry policy counts attempts afresh from there (retry_base).
REOPEN_STEP = (
    "UPDATE workflow_steps SET state = 'pending', finished_at = NULL, retry_base = attempt, retry_at = NULL"
    " WHERE workflow_id = $1 AND idx = (SELECT min(idx) FROM workflow_steps"
    "   WHERE workflow_id = $1 AND state = ANY($2::text[]))"
)
REOPEN_WORKFLOW = (
    "UPDATE workflows SET state = 'running', finished_at = NULL, error = NULL,"
    " cancel_commands = false, updated_at = now() WHERE id = $1"
)

# -- stored profiles (profiles.py) -------------------------------------------------------------

LOCK_PROFILE = (
    "SELECT first_used_at FROM profiles WHERE tenant_id = $1 AND id = $2 AND version = $3 FOR UPDATE"
)
REPLACE_PROFILE = (
    "UPDATE profiles SET document = $4, public = $5, created_at = now()"
    " WHERE tenant_id = $1 AND id = $2 AND version = $3"
)
INSERT_PROFILE = "INSERT INTO profiles (tenant_id, id, version, document, public) VALUES ($1, $2, $3, $4, $5)"
# A lookup: the tenant's own, then a public one of another tenant; the latest, or version $3.
OWN_PROFILE_LATEST = (
    "SELECT * FROM profiles WHERE tenant_id = $1 AND id = $2 ORDER BY version DESC, tenant_id LIMIT 1"
)
OWN_PROFILE_VERSION = (
    "SELECT * FROM profiles WHERE tenant_id = $1 AND id = $2 AND version = $3 ORDER BY tenant_id LIMIT 1"
)
PUBLIC_PROFILE_LATEST = (
    "SELECT * FROM profiles WHERE public AND tenant_id <> $1 AND id = $2"
    " ORDER BY version DESC, tenant_id LIMIT 1"
)
PUBLIC_PROFILE_VERSION = (
    "SELECT * FROM profiles WHERE public AND tenant_id <> $1 AND id = $2 AND version = $3"
    " ORDER BY tenant_id LIMIT 1"
)
PIN_PROFILE = (
    "UPDATE profiles SET first_used_at = now() WHERE tenant_id = $1 AND id = $2 AND version = $3"
    " AND first_used_at IS NULL RETURNING *"
)
PROFILE = "SELECT * FROM profiles WHERE tenant_id = $1 AND id = $2 AND version = $3"
# Text compares bytewise (COLLATE "C"), as Python does: the shipped profiles are merged in.
LIST_PROFILES = (
    "SELECT * FROM profiles WHERE (tenant_id = $1 OR public)"
    ' AND ($2::text IS NULL OR (id COLLATE "C", version, tenant_id COLLATE "C") > ($2, $3::int, $4::text))'
    ' ORDER BY id COLLATE "C", version, tenant_id COLLATE "C" LIMIT $5'
)
DELETE_PROFILE = "DELETE FROM profiles WHERE tenant_id = $1 AND id = $2 AND version = $3"
