"""SQL of the cmdq schema, as named statements.

Every statement of the service is here, and only here (over 400 lines for that reason: one
place to read and review every query the service runs). ``storage.PgStore`` runs most of them
behind the ``Store`` protocol (agents' presence and the metrics' counts included). Every state change is a
compare-and-set: an ``UPDATE … WHERE state IN (…)`` that returns the row it changed, so a
duplicate or late event changes nothing. Loops that several instances run at once take their
rows with ``FOR UPDATE SKIP LOCKED``, in one statement: no row stays locked while the service
talks to NATS.
"""

from __future__ import annotations

from typing import Final

from better_compute.service import fences
from better_compute.wire.cmdq import TERMINAL_STATES

__all__ = [
    "ACK",
    "AGENTS_CONNECTED",
    "AGENTS_HEARD",
    "AGENTS_LIST",
    "AGENT_AGAIN",
    "AGENT_CANCELLING",
    "AGENT_COMMANDS_TO_REPUBLISH",
    "AGENT_HEARTBEAT",
    "AGENT_LEAVE",
    "AGENT_UPSERT",
    "ALL_CANCELLING",
    "APPROVALS_OF",
    "APPROVALS_OF_BATCHES",
    "APPROVAL_INSERT",
    "BATCHES_BY_IDS",
    "BATCHES_EXPIRY_DUE",
    "BATCHES_EXPIRY_PUBLISHED",
    "BATCHES_LIST",
    "BATCHES_UNEXPIRED",
    "BATCHES_WAITING",
    "BATCH_BY_ID",
    "BATCH_BY_ID_FOR_UPDATE",
    "BATCH_BY_KEY",
    "BATCH_CLOSE",
    "BATCH_INSERT",
    "BATCH_REOPEN",
    "BATCH_SET_APPROVED",
    "BATCH_UNDISPATCH",
    "CANCEL_BY_ID",
    "CANCEL_BY_PREFIX",
    "CANCEL_SUPERSEDED",
    "CERT_REVOKED_CUT_OFF",
    "CERT_REVOKED_LEASES",
    "CERT_REVOKED_MARK",
    "CERT_REVOKED_REASSIGN",
    "CLAIMED_UNDER_PREFIX",
    "CLAIM_BACK_TO_PENDING",
    "CLAIM_BATCH_EXPIRED",
    "CLAIM_INTERRUPTED",
    "CLAIM_MANY",
    "CLAIM_RERUN",
    "CLAIM_STATE",
    "COMMAND_BY_ID",
    "COMMAND_BY_NODE_KEY",
    "COMMAND_INSERT",
    "COMMAND_INSERT_MANY",
    "COMMAND_STATE",
    "COMMAND_STATES",
    "DISPATCH_PENDING",
    "EXPIRE_BATCH_EXPIRED",
    "EXPIRE_DUE",
    "FAIL_LOST",
    "JOURNAL_SEEN",
    "KEY_FENCED",
    "KEY_FENCE_INSERT",
    "LATE_END",
    "LEASE_RELEASE",
    "LEASE_RENEW",
    "LIST_COMMANDS",
    "LIVE_BY_STATE",
    "LIVE_WITH_PREFIX",
    "MUST_STOP",
    "PICK_SITE_AGENT",
    "PROGRESS",
    "PROGRESS_MANY",
    "PUBLISHED",
    "PUBLISHED_MANY",
    "PURGE_FINISHED",
    "REASSIGN_SILENT",
    "REPUBLISH_DUE",
    "RESULT",
    "RESULT_MANY",
    "SITE_OF_NODE",
]

_COLS: Final = (
    "c.id, c.node_id, c.site_id, c.tenant_id, c.key, c.kind, c.destructive, c.target,"
    " c.payload, c.agent_id, c.state, c.reason, c.progress, c.batch_id, c.workflow_id, c.step,"
    " c.result, c.attested, c.created_at, c.updated_at, c.not_after, c.dispatched_at, c.publishes,"
    " c.version"
)
_LIVE: Final = "('pending', 'dispatched', 'acked', 'running')"
_TERMINAL: Final = "(" + ", ".join(f"'{state}'" for state in sorted(TERMINAL_STATES)) + ")"
_KEY_UNDER: Final = "(c.key = {p} OR starts_with(c.key, {p} || ':') OR starts_with(c.key, {p} || '#'))"
_SECS: Final = "make_interval(secs => {p}::double precision / 1000)"
# How long agent {a} may go unheard before the rule of {p} (silent_after_ms or lost_after_ms)
# counts it: {p}, or three times the gap it announced until its next heartbeat, whichever is
# longer (a machine's agent with nothing to do heartbeats every cmdq.idle_heartbeat; migration
# 0012). Every silence rule below goes through it; only a leave and a revocation, which end the
# agent's presence at once, set the gap back to 0.
_QUIET: Final = "make_interval(secs => greatest({p}::double precision, 3 * {a}.beat_gap_ms) / 1000)"

# -- commands -------------------------------------------------------------------------

COMMAND_BY_ID: Final = f"SELECT {_COLS} FROM commands c WHERE c.id = $1"
COMMAND_BY_NODE_KEY: Final = f"SELECT {_COLS} FROM commands c WHERE c.node_id = $1 AND c.key = $2"
COMMAND_STATES: Final = "SELECT id, state FROM commands WHERE id = ANY($1::text[])"
# $1 ids, $2 agent: which of the commands an agent runs must stop (a check before a try):
# all but those still acked or running for it (an unknown id stops too, and says nothing more)
MUST_STOP: Final = """
SELECT x.id FROM unnest($1::text[]) AS x (id)
WHERE NOT EXISTS (SELECT 1 FROM commands c WHERE c.id = x.id AND c.agent_id = $2
                  AND c.state IN ('acked', 'running'))
"""
# $1 agent: its commands cancelled after it claimed them (told in each heartbeat's reply)
AGENT_CANCELLING: Final = (
    "SELECT id FROM commands WHERE agent_id = $1 AND state = 'cancelling' ORDER BY id LIMIT 256"
)
# Every claimed command cancelled since, by agent (the partial index commands_cancelling): read once
# per presence write and answered from memory in the node agents' heartbeats.
ALL_CANCELLING: Final = (
    "SELECT agent_id, id FROM commands WHERE state = 'cancelling' AND agent_id IS NOT NULL"
    " ORDER BY agent_id, id LIMIT 100000"
)
COMMAND_STATE: Final = (
    "SELECT id, node_id, kind, state, agent_id, digest, not_after > now() AS live FROM commands WHERE id = $1"
)

# A site agent to deliver to: connected, implementing the kind when it said which it runs,
# the boot-lease holder first.
_PICK: Final = (
    "SELECT a.id FROM agents a"
    " LEFT JOIN boot_leases l ON l.site_id = a.site_id AND l.agent_id = a.id"
    "  AND l.expires_at > now()"
    " WHERE a.site_id = {site} AND a.role = 'site'"
    f"  AND a.last_seen > now() - {_QUIET.format(p='{silent}', a='a')}"
    "  AND ({kind}::text IS NULL OR a.kinds IS NULL OR {kind} = ANY (a.kinds))"
    " ORDER BY (l.agent_id IS NOT NULL) DESC, a.last_seen DESC LIMIT 1"
)
PICK_SITE_AGENT: Final = _PICK.format(site="$1", silent="$2", kind="$3")

# $1 id … $13 step, $14 not_after_ms, $15 may_dispatch, $16 silent_after_ms. A site command goes out at
# once when it may and an agent is there; a node command always has its agent (the node id).
COMMAND_INSERT: Final = f"""
WITH pick AS (
    SELECT CASE WHEN $8 = 'node' THEN $2
                ELSE ({_PICK.format(site="$3", silent="$16", kind="$6")}) END AS agent_id
)
INSERT INTO commands AS c (id, node_id, site_id, tenant_id, key, kind, destructive, target,
                           payload, digest, batch_id, workflow_id, step, not_after,
                           agent_id, state, dispatched_at)
SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13,
       to_timestamp($14::bigint / 1000.0),
       CASE WHEN $15::bool OR $8 = 'node' THEN pick.agent_id END,
       CASE WHEN $15::bool AND pick.agent_id IS NOT NULL THEN 'dispatched' ELSE 'pending' END,
       CASE WHEN $15::bool AND pick.agent_id IS NOT NULL THEN now() END
FROM pick
ON CONFLICT (node_id, key) DO NOTHING
RETURNING {_COLS}
"""

# COMMAND_INSERT for many commands at once (GroupCommit), each row on COMMAND_INSERT's terms:
# $1 ids … $13 steps, $14 not_after_ms, $15 may_dispatch (arrays), $16 silent_after_ms. One row per
# command, in order: the command inserted, or NULLs where its (node, key) exists. A group holds a
# (node, key) once (GroupCommit's key), and its rows are inserted in id order.
COMMAND_INSERT_MANY: Final = f"""
WITH n AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[],
                         $7::bool[], $8::text[], $9::text[], $10::bytea[], $11::text[], $12::text[],
                         $13::int[], $14::bigint[], $15::bool[])
        WITH ORDINALITY AS n (id, node_id, site_id, tenant_id, key, kind, destructive, target, payload,
                              digest, batch_id, workflow_id, step, not_after_ms, may_dispatch, ord)
), pick AS (
    SELECT n.*, CASE WHEN n.target = 'node' THEN n.node_id
                     ELSE ({_PICK.format(site="n.site_id", silent="$16", kind="n.kind")}) END AS agent_id
    FROM n
), ins AS (
    INSERT INTO commands AS c (id, node_id, site_id, tenant_id, key, kind, destructive, target,
                               payload, digest, batch_id, workflow_id, step, not_after,
                               agent_id, state, dispatched_at)
    SELECT p.id, p.node_id, p.site_id, p.tenant_id, p.key, p.kind, p.destructive, p.target,
           p.payload::json, p.digest, p.batch_id, p.workflow_id, p.step,
           to_timestamp(p.not_after_ms / 1000.0),
           CASE WHEN p.may_dispatch OR p.target = 'node' THEN p.agent_id END,
           CASE WHEN p.may_dispatch AND p.agent_id IS NOT NULL THEN 'dispatched' ELSE 'pending' END,
           CASE WHEN p.may_dispatch AND p.agent_id IS NOT NULL THEN now() END
    FROM pick p ORDER BY p.id
    ON CONFLICT (node_id, key) DO NOTHING
    RETURNING {_COLS}
)
SELECT ins.* FROM n LEFT JOIN ins ON ins.id = n.id ORDER BY n.ord
"""

PUBLISHED: Final = (
    "UPDATE commands SET published_at = now(), publishes = publishes + 1, stream_seq = $3"
    " WHERE id = $1 AND agent_id = $2 AND state IN ('dispatched', 'acked')"
)
# PUBLISHED for many deliveries at once (GroupCommit): $1 ids (distinct), $2 agents, $3 seqs.
# Its rows are locked in id order, as every statement over many commands of an agent event does:
# a group of marks and a group of claims over the same commands (an agent claims what was just
# published) would otherwise deadlock, each holding a row the other waits for.
PUBLISHED_MANY: Final = """
WITH p AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[]) AS p (id, agent, seq)
), locked AS (
    SELECT c.id FROM commands c JOIN p ON p.id = c.id ORDER BY c.id FOR UPDATE OF c
)
UPDATE commands c SET published_at = now(), publishes = c.publishes + 1, stream_seq = p.seq
FROM p
WHERE c.id = p.id AND c.id IN (SELECT id FROM locked) AND c.agent_id = p.agent
  AND c.state IN ('dispatched', 'acked')
"""

# $1 quorum on, $2 site (or NULL), $3 batch (or NULL), $4 limit, $5 silent_after_ms: pending
# commands that may go now, dispatched in one statement, each site command to the agent picked
# for its site and kind (a node command to its node). Site commands of a site without a
# connected agent are left out, so they never starve the others.
DISPATCH_PENDING: Final = f"""
WITH due AS (
    SELECT c.id, c.site_id, c.target, c.kind, c.node_id FROM commands c
    LEFT JOIN batches b ON b.id = c.batch_id
    WHERE c.state = 'pending' AND c.not_after > now()
      AND (NOT c.destructive OR NOT $1::bool
           OR (b.approved_at IS NOT NULL AND b.expires_at > now()))
      AND ($2::text IS NULL OR c.site_id = $2)
      AND ($3::text IS NULL OR c.batch_id = $3)
      AND (c.target = 'node' OR EXISTS (
          SELECT 1 FROM agents a WHERE a.site_id = c.site_id AND a.role = 'site'
            AND a.last_seen > now() - {_QUIET.format(p="$5", a="a")}))
    ORDER BY c.created_at LIMIT $4
    FOR UPDATE OF c SKIP LOCKED
), pick AS (
    SELECT s.site_id, s.kind, ({_PICK.format(site="s.site_id", silent="$5", kind="s.kind")}) AS agent_id
    FROM (SELECT DISTINCT site_id, kind FROM due WHERE target = 'site') s
), go AS (
    SELECT due.id, CASE WHEN due.target = 'node' THEN due.node_id ELSE pick.agent_id END AS agent_id
    FROM due LEFT JOIN pick
      ON due.target = 'site' AND pick.site_id = due.site_id AND pick.kind = due.kind
)
UPDATE commands c SET state = 'dispatched', agent_id = go.agent_id, dispatched_at = now(),
    published_at = NULL, reason = NULL, updated_at = now()
FROM go WHERE c.id = go.id AND go.agent_id IS NOT NULL AND c.state = 'pending'
RETURNING {_COLS}
"""

# Dispatched and never published (the stream did not take it, or the instance died before),
# or published long ago and still not claimed although its agent is connected. Read without a
# lock: instances that publish the same row at once publish the same message id, which the
# stream keeps once; a row that changed meanwhile records nothing (PUBLISHED checks its agent).
REPUBLISH_DUE: Final = f"""
SELECT {_COLS} FROM commands c LEFT JOIN agents a ON a.id = c.agent_id
WHERE c.state = 'dispatched' AND (
    (c.published_at IS NULL AND c.dispatched_at < now() - interval '2 seconds')
    OR (c.published_at < now() - {_SECS.format(p="$1")}
        AND a.last_seen > now() - {_QUIET.format(p="$2", a="a")}))
ORDER BY c.dispatched_at LIMIT 200
"""
AGENT_COMMANDS_TO_REPUBLISH: Final = (
    f"SELECT {_COLS} FROM commands c"
    " WHERE c.agent_id = $1 AND c.state IN ('dispatched', 'acked') ORDER BY c.dispatched_at"
)

# $1 retention in days: finished commands untouched that long go, a thousand at a time
# (index commands_retention; the ids as an array, so the delete probes the primary key rather
# than joining against the whole table)
PURGE_FINISHED: Final = f"""
WITH gone AS (
    DELETE FROM commands WHERE id = ANY (ARRAY(
        SELECT id FROM commands WHERE state IN {_TERMINAL}
           AND updated_at < now() - make_interval(days => $1)
        LIMIT 1000 FOR UPDATE SKIP LOCKED))
    RETURNING 1)
SELECT count(*) FROM gone
"""

# $1 quorum on
EXPIRE_DUE: Final = f"""
WITH due AS (
    SELECT id FROM commands WHERE state IN {_LIVE} AND not_after <= now()
    ORDER BY not_after LIMIT 500 FOR UPDATE SKIP LOCKED
)
UPDATE commands c SET state = 'expired', finished_at = now(), updated_at = now(),
    reason = CASE c.state
        WHEN 'pending' THEN CASE
            WHEN c.destructive AND $1::bool AND NOT EXISTS (
                SELECT 1 FROM batches b WHERE b.id = c.batch_id AND b.approved_at IS NOT NULL)
            THEN 'quorum-not-reached'
            ELSE 'not-dispatched' END
        WHEN 'dispatched' THEN 'not-claimed'
        ELSE 'not-finished' END
FROM due WHERE c.id = due.id
RETURNING {_COLS}
"""
# Pending or dispatched but unclaimed: a destructive command of an expired batch never runs.
EXPIRE_BATCH_EXPIRED: Final = f"""
WITH due AS (
    SELECT c.id FROM commands c JOIN batches b ON b.id = c.batch_id
    WHERE c.state IN ('pending', 'dispatched') AND c.destructive AND b.expires_at <= now()
    LIMIT 500 FOR UPDATE OF c SKIP LOCKED
)
UPDATE commands c SET state = 'expired', reason = 'batch-expired', finished_at = now(),
    updated_at = now()
FROM due WHERE c.id = due.id
RETURNING {_COLS}
"""
# $1 silent_after_ms: unclaimed, non-destructive site commands of a silent agent go back to
# pending for another agent (the old one can no longer claim them).
REASSIGN_SILENT: Final = f"""
WITH due AS (
    SELECT c.id FROM commands c JOIN agents a ON a.id = c.agent_id
    WHERE c.state = 'dispatched' AND c.target = 'site' AND NOT c.destructive
      AND a.last_seen < now() - {_QUIET.format(p="$1", a="a")}
    LIMIT 500 FOR UPDATE OF c SKIP LOCKED
)
UPDATE commands c SET state = 'pending', agent_id = NULL, published_at = NULL,
    reason = 'agent-silent', updated_at = now()
FROM due WHERE c.id = due.id
RETURNING {_COLS}
"""
# $1 lost_after_ms, $2 silent_after_ms: claimed commands of an agent silent that long (and
# untouched since) fail; their outcome is unknown. Unclaimed ones wait for the agent (a node's bcd
# may be rebooting into its new OS) until their not_after. The silence counts only while the
# agent's site is heard: another agent of the site heard now and connected without a break for
# lost_after (AGENT_HEARTBEAT restarts connected_at after a silence). A site silent as a whole
# (its leaf's link to the hub cut, or every agent of it stopped: the same from here) is
# unreachable, not lost: its agents' journals say what ran when they come back.
FAIL_LOST: Final = f"""
WITH due AS (
    SELECT c.id FROM commands c JOIN agents a ON a.id = c.agent_id
    WHERE c.state IN ('acked', 'running', 'cancelling')
      AND a.last_seen < now() - {_QUIET.format(p="$1", a="a")}
      AND c.updated_at < now() - {_SECS.format(p="$1")}
      AND EXISTS (SELECT 1 FROM agents b WHERE b.site_id = a.site_id AND b.id <> a.id
                  AND b.last_seen > now() - {_QUIET.format(p="$2", a="b")}
                  AND b.connected_at < now() - {_SECS.format(p="$1")})
    LIMIT 500 FOR UPDATE OF c SKIP LOCKED
)
UPDATE commands c SET state = 'failed', reason = 'agent-lost', finished_at = now(),
    updated_at = now()
FROM due WHERE c.id = due.id
RETURNING {_COLS}
"""

# $1 id, $2 agent, $3 digest, $4 journal (NULL: not named), $5 signed_at_ms, $6 quorum on, $7 the
# claim's id (NULL: none, an older agent): the claim. Taken when the command is dispatched, or
# claimed by this very journal already (its answer was lost: the journal has not started it, or
# it would not ask): acked by it, or running under this claim's id. With an id the claim marks
# it running (the agent sends no running mark), else acked. A destructive command's batch must
# be unexpired and, under the quorum, approved; without a batch it needs the quorum off.
_CLAIM_AGAIN: Final = """(c.state = 'dispatched' OR (c.state = 'acked' AND c.claim_journal = {j})
       OR (c.state = 'running' AND c.claim_id = {claim} AND c.claim_journal = {j}))"""
ACK: Final = f"""
UPDATE commands c SET state = CASE WHEN $7::text IS NULL THEN 'acked' ELSE 'running' END,
    acked_at = coalesce(c.acked_at, now()), updated_at = now(), claim_journal = $4, claim_id = $7,
    claim_signed_ms = CASE WHEN c.state = 'dispatched' THEN $5 ELSE c.claim_signed_ms END
WHERE c.id = $1 AND c.agent_id = $2 AND c.not_after > now() AND c.digest = $3
  AND {_CLAIM_AGAIN.format(j="$4", claim="$7")}
  AND (NOT c.destructive OR CASE
      WHEN c.batch_id IS NULL THEN NOT $6::bool
      ELSE EXISTS (SELECT 1 FROM batches b WHERE b.id = c.batch_id AND b.expires_at > now()
                   AND (NOT $6::bool OR b.approved_at IS NOT NULL)) END)
RETURNING {_COLS}
"""
# JOURNAL_SEEN (not present) and ACK for many claims at once, one statement (GroupCommit): $1 ids
# (distinct), $2 agents, $3 digests, $4 journals (NULL: not named), $5 signed_at_ms, $6 quorum on,
# $7 the claims' ids (NULL: none). Each claim is taken on the same terms as ACK alone; every named
# journal is seen (given its generation at first sight) whether its claim is taken or not. One row
# per claim, in order: its journal's generation and presence, and the command when the claim was
# taken. A journal's last_seen moves at most once a second here (it counts against lost_after, a
# minute or more): two groups of claims of one journal do not queue on its row. Rows are locked in
# one order: the journals first (new and a second old alike, in one upsert by agent and journal, the
# order AGENTS_HEARD takes them in), then the commands by id; so two groups, or a group and a batch
# of heartbeats, wait for each other instead of deadlocking.
CLAIM_MANY: Final = f"""
WITH a AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[], $4::text[], $5::bigint[], $6::bool[],
                         $7::text[])
        WITH ORDINALITY AS a (id, agent, digest, journal, signed_ms, quorum, claim, n)
), named AS (
    SELECT DISTINCT agent, journal FROM a WHERE journal IS NOT NULL
), known AS (
    SELECT j.agent_id, j.journal_id, j.generation, j.present, j.last_seen FROM journals j
    JOIN named ON j.agent_id = named.agent AND j.journal_id = named.journal
), made AS (
    INSERT INTO journals AS j (agent_id, journal_id, present)
    SELECT named.agent, named.journal, false FROM named
    LEFT JOIN known ON known.agent_id = named.agent AND known.journal_id = named.journal
    WHERE known.agent_id IS NULL OR known.last_seen < now() - interval '1 second'
    ORDER BY named.agent, named.journal
    ON CONFLICT (agent_id, journal_id) DO UPDATE SET last_seen = now()
    RETURNING j.agent_id, j.journal_id, j.generation, j.present
), j AS (
    SELECT agent_id, journal_id, generation, present FROM made
    UNION ALL
    SELECT agent_id, journal_id, generation, present FROM known
    WHERE NOT EXISTS (SELECT 1 FROM made
                      WHERE made.agent_id = known.agent_id AND made.journal_id = known.journal_id)
), locked AS (
    SELECT c.id FROM commands c JOIN a ON a.id = c.id
    WHERE (SELECT count(*) FROM made) >= 0  -- the journals' rows first
    ORDER BY c.id FOR UPDATE OF c
), acked AS (
    UPDATE commands c SET state = CASE WHEN a.claim IS NULL THEN 'acked' ELSE 'running' END,
        acked_at = coalesce(c.acked_at, now()), updated_at = now(),
        claim_journal = a.journal, claim_id = a.claim,
        claim_signed_ms = CASE WHEN c.state = 'dispatched' THEN a.signed_ms ELSE c.claim_signed_ms END
    FROM a
    WHERE c.id = a.id AND c.id IN (SELECT id FROM locked) AND c.agent_id = a.agent
      AND c.not_after > now() AND c.digest = a.digest
      AND {_CLAIM_AGAIN.format(j="a.journal", claim="a.claim")}
      AND (NOT c.destructive OR CASE
          WHEN c.batch_id IS NULL THEN NOT a.quorum
          ELSE EXISTS (SELECT 1 FROM batches b WHERE b.id = c.batch_id AND b.expires_at > now()
                       AND (NOT a.quorum OR b.approved_at IS NOT NULL)) END)
    RETURNING {_COLS}, a.n AS claim_n
)
SELECT j.generation AS journal_generation, j.present AS journal_present, acked.*
FROM a LEFT JOIN j ON j.agent_id = a.agent AND j.journal_id = a.journal
LEFT JOIN acked ON acked.claim_n = a.n
ORDER BY a.n
"""
# Why a claim was not taken: the command as its claim sees it, with its batch.
CLAIM_STATE: Final = """
SELECT c.id, c.state, c.kind, c.payload, c.agent_id, c.digest, c.not_after > now() AS live, c.destructive,
       c.claim_journal, c.claim_signed_ms, c.claim_id, b.id IS NOT NULL AS has_batch,
       coalesce(b.expires_at <= now(), false) AS batch_expired,
       coalesce(b.approved_at IS NOT NULL, false) AS batch_approved
FROM commands c LEFT JOIN batches b ON b.id = c.batch_id
WHERE c.id = $1
"""
# $1 id, $2 agent, $3 journal (NULL: not named), $4 signed_at_ms, $5 the journal's generation,
# $6 whether the journal said hello itself: another journal of the agent (or one that does not
# say which it is) claims a command that may have started. It fails as interrupted and never
# runs again. A claim from a journal older than the one that claimed it (a late copy from a
# journal that was replaced, signed again by its retry) changes nothing: journals are ordered
# by generation, which a retry cannot change. A journal that never said hello (an older SDK
# names it in claims only) got its generation from this very claim, so a claim of it signed
# before the recorded one counts as older as well; a claim that names no journal is ordered by
# signing time only. ``ended_at`` stays NULL: the journal that claimed it may still be running
# it (CLAIMED_UNDER_PREFIX).
CLAIM_INTERRUPTED: Final = f"""
UPDATE commands c SET state = 'failed', reason = 'interrupted', finished_at = now(),
    updated_at = now()
WHERE c.id = $1 AND c.agent_id = $2 AND c.state IN ('acked', 'running')
  AND ($3::text IS NULL OR c.claim_journal IS DISTINCT FROM $3)
  AND CASE WHEN $3::text IS NULL THEN coalesce(c.claim_signed_ms, 0) < $4
      ELSE coalesce((SELECT j.generation FROM journals j
                     WHERE j.agent_id = c.agent_id AND j.journal_id = c.claim_journal), 0) < $5
           AND ($6::bool OR coalesce(c.claim_signed_ms, 0) < $4) END
RETURNING {_COLS}
"""
# $1 id, $2 agent, $3 journal: the journal that claimed an idempotent command and died while
# running it runs it again (claims.py checks the kind); nothing else may.
CLAIM_RERUN: Final = f"""
UPDATE commands c SET updated_at = now()
WHERE c.id = $1 AND c.agent_id = $2 AND c.state IN ('acked', 'running') AND c.claim_journal = $3
  AND c.not_after > now()
RETURNING {_COLS}
"""
# $1 id, $2 agent, $3 journal, $4 the claim's id: a destructive command claimed while its batch is
# not approved (an approver was withdrawn) goes back to pending; a new approval dispatches it again.
CLAIM_BACK_TO_PENDING: Final = f"""
UPDATE commands c SET state = 'pending', reason = 'batch-not-approved', published_at = NULL,
    agent_id = CASE WHEN c.target = 'node' THEN c.agent_id END, claim_journal = NULL,
    claim_signed_ms = NULL, claim_id = NULL, updated_at = now()
WHERE c.id = $1 AND c.agent_id = $2
  AND {_CLAIM_AGAIN.format(j="$3", claim="$4")}
RETURNING {_COLS}
"""
# $1 id, $2 agent, $3 journal, $4 the claim's id: claimed after its batch expired; it never can run now.
CLAIM_BATCH_EXPIRED: Final = f"""
UPDATE commands c SET state = 'expired', reason = 'batch-expired', finished_at = now(),
    updated_at = now()
WHERE c.id = $1 AND c.agent_id = $2
  AND {_CLAIM_AGAIN.format(j="$3", claim="$4")}
RETURNING {_COLS}
"""
PROGRESS: Final = f"""
WITH old AS (
    SELECT id, state FROM commands
    WHERE id = $1 AND agent_id = $2 AND state IN ('acked', 'running', 'cancelling') FOR UPDATE
)
UPDATE commands c SET state = CASE old.state WHEN 'cancelling' THEN 'cancelling' ELSE 'running' END,
    progress = coalesce($3, c.progress),
    updated_at = now()
FROM old WHERE c.id = old.id
RETURNING {_COLS}, old.state AS old_state
"""
# PROGRESS for many events at once (GroupCommit): $1 ids (distinct), $2 agents, $3 messages
# (NULL: none). One row per command it changed, with its place in the arrays (said_n).
PROGRESS_MANY: Final = f"""
WITH p AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS p (id, agent, message, n)
), old AS (
    SELECT c.id, c.state, p.message, p.n FROM commands c JOIN p ON p.id = c.id AND p.agent = c.agent_id
    WHERE c.state IN ('acked', 'running', 'cancelling')
    ORDER BY c.id FOR UPDATE OF c
)
UPDATE commands c SET state = CASE old.state WHEN 'cancelling' THEN 'cancelling' ELSE 'running' END,
    progress = coalesce(old.message, c.progress),
    updated_at = now()
FROM old WHERE c.id = old.id
RETURNING {_COLS}, old.state AS old_state, old.n AS said_n
"""
# A cancelling command's result is the agent's word that it stopped it (or never started it):
# it becomes cancelled, its outcome is kept in progress, and its result counts for nothing. Only
# the journal that claimed it can say so ($8, '' when the agent does not name its journal);
# another journal's word leaves its outcome unknown: failed, interrupted.
RESULT: Final = f"""
WITH cur AS (
    SELECT id, state = 'cancelling' AS cancelling,
           state = 'cancelling' AND ($8::text = '' OR claim_journal IS NULL OR claim_journal = $8)
               AS confirmed
    FROM commands WHERE id = $1 AND agent_id = $2 AND state IN ('acked', 'running', 'cancelling')
    FOR UPDATE
)
UPDATE commands c SET
    state = CASE WHEN cur.confirmed THEN 'cancelled' WHEN cur.cancelling THEN 'failed' ELSE $3::text END,
    reason = CASE WHEN cur.confirmed THEN c.reason WHEN cur.cancelling THEN 'interrupted'
                  ELSE $4::text END,
    progress = CASE WHEN cur.cancelling
        THEN left(coalesce(c.progress || '; ', '') || 'the agent stopped: ' || $3::text
                  || coalesce(' (' || $4::text || ')', ''), 500)
        ELSE c.progress END,
    result = CASE WHEN cur.cancelling THEN NULL ELSE $5::bytea END,
    result_signature = CASE WHEN cur.cancelling THEN NULL ELSE $6::bytea END,
    attested = NOT cur.cancelling AND $7::bool,
    ended_at = CASE WHEN cur.confirmed THEN now() ELSE c.ended_at END,
    finished_at = now(), updated_at = now()
FROM cur WHERE c.id = cur.id
RETURNING {_COLS}
"""

# RESULT for many results at once (GroupCommit), each row on RESULT's terms: $1 ids
# (distinct), $2 agents, $3 statuses, $4 reasons, $5 results, $6 signatures, $7 attested,
# $8 journals. One row per command it settled, with its place in the arrays (report_n).
RESULT_MANY: Final = f"""
WITH r AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[], $6::bytea[],
                         $7::bool[], $8::text[])
        WITH ORDINALITY AS r (id, agent, status, reason, result, signature, attested, journal, n)
), cur AS (
    SELECT c.id, r.n, c.state = 'cancelling' AS cancelling,
           c.state = 'cancelling'
               AND (r.journal = '' OR c.claim_journal IS NULL OR c.claim_journal = r.journal) AS confirmed
    FROM commands c JOIN r ON r.id = c.id AND r.agent = c.agent_id
    WHERE c.state IN ('acked', 'running', 'cancelling')
    ORDER BY c.id FOR UPDATE OF c
)
UPDATE commands c SET
    state = CASE WHEN cur.confirmed THEN 'cancelled' WHEN cur.cancelling THEN 'failed' ELSE r.status END,
    reason = CASE WHEN cur.confirmed THEN c.reason WHEN cur.cancelling THEN 'interrupted'
                  ELSE r.reason END,
    progress = CASE WHEN cur.cancelling
        THEN left(coalesce(c.progress || '; ', '') || 'the agent stopped: ' || r.status
                  || coalesce(' (' || r.reason || ')', ''), 500)
        ELSE c.progress END,
    result = CASE WHEN cur.cancelling THEN NULL ELSE r.result END,
    result_signature = CASE WHEN cur.cancelling THEN NULL ELSE r.signature END,
    attested = NOT cur.cancelling AND r.attested,
    ended_at = CASE WHEN cur.confirmed THEN now() ELSE c.ended_at END,
    finished_at = now(), updated_at = now()
FROM cur JOIN r ON r.n = cur.n WHERE c.id = cur.id
RETURNING {_COLS}, cur.n AS report_n
"""

# A command its agent claimed may run there: it is cancelling until the agent says it stopped.
_CANCEL_SET: Final = """
    state = CASE WHEN c.state IN ('acked', 'running') THEN 'cancelling' ELSE 'cancelled' END,
    finished_at = CASE WHEN c.state IN ('acked', 'running') THEN NULL ELSE now() END,
    updated_at = now()"""
CANCEL_BY_ID: Final = f"""
UPDATE commands c SET reason = $2, {_CANCEL_SET}
WHERE c.id = $1 AND c.state IN {_LIVE}
RETURNING {_COLS}
"""
# $1 node (or NULL), $2 prefix, $3 reason, $4 workflow (or NULL): every node it sent to
CANCEL_BY_PREFIX: Final = f"""
UPDATE commands c SET reason = $3, {_CANCEL_SET}
WHERE ($1::text IS NULL OR c.node_id = $1) AND ($4::text IS NULL OR c.workflow_id = $4)
  AND c.state IN {_LIVE} AND {_KEY_UNDER.format(p="$2")}
RETURNING {_COLS}
"""
# Claimed commands under a prefix that may still run at their agents: cancel and expiry do not
# recall a claimed command, and a claim from another journal of its agent (interrupted) does not
# stop the journal that claimed it. It ends with that journal's result (even a late one: ended_at)
# or when that journal is lost: silent for lost_after (its own presence when it reports it, else
# its agent's). Same parameters as CANCEL_BY_PREFIX, $3 lost_after_ms.
CLAIMED_UNDER_PREFIX: Final = f"""
SELECT c.id, c.agent_id, c.claim_journal FROM commands c JOIN agents a ON a.id = c.agent_id
LEFT JOIN journals j ON j.agent_id = c.agent_id AND j.journal_id = c.claim_journal
WHERE ($1::text IS NULL OR c.node_id = $1) AND ($4::text IS NULL OR c.workflow_id = $4)
  AND c.acked_at IS NOT NULL AND c.ended_at IS NULL
  AND (c.state IN ('acked', 'running', 'cancelling', 'cancelled', 'expired')
       OR (c.state = 'failed' AND c.reason = 'interrupted'))
  AND CASE WHEN j.present THEN j.last_seen ELSE a.last_seen END
      > now() - {_QUIET.format(p="$3", a="a")}
  AND {_KEY_UNDER.format(p="$2")}
ORDER BY c.id
"""
# $1 id, $2 agent: the end of a claimed command's run, reported after it was cancelled, expired
# or interrupted (claimed by another journal meanwhile)
LATE_END: Final = f"""
UPDATE commands c SET ended_at = now(), updated_at = now()
WHERE c.id = $1 AND c.agent_id = $2
  AND (c.state IN ('cancelled', 'expired') OR (c.state = 'failed' AND c.reason = 'interrupted'))
  AND c.acked_at IS NOT NULL AND c.ended_at IS NULL
RETURNING {_COLS}
"""
# $1 prefix, $2 workflow, $3 reason
KEY_FENCE_INSERT: Final = (
    "INSERT INTO key_fences (prefix, workflow_id, reason) VALUES ($1, $2, $3) ON CONFLICT (prefix) DO NOTHING"
)
KEY_FENCED: Final = fences.KEY_FENCED
# A command created under a fenced key (it raced with the fence): cancelled before it goes out
CANCEL_SUPERSEDED: Final = f"""
UPDATE commands c SET reason = 'attempt-superseded', {_CANCEL_SET}
WHERE c.id = $1 AND c.state IN {_LIVE}
RETURNING {_COLS}
"""
LIVE_WITH_PREFIX: Final = f"""
SELECT c.id, c.payload FROM commands c
WHERE c.agent_id = $1 AND c.state IN ('dispatched', 'acked', 'running')
  AND c.not_after > now()  -- past its deadline it opens nothing, swept or not
  AND ($3::text IS NULL OR c.node_id = $3)
  AND {_KEY_UNDER.format(p="$2")}
ORDER BY c.id
"""
LIST_COMMANDS: Final = f"""
SELECT {_COLS} FROM commands c
WHERE ($1::text IS NULL OR c.node_id = $1)
  AND ($2::text IS NULL OR c.workflow_id = $2)
  AND ($3::text IS NULL OR c.state = $3)
  AND ($4::text IS NULL OR c.kind = $4)
  AND ($5::text IS NULL OR c.site_id = $5)
  AND ($6::text IS NULL OR c.agent_id = $6)
  AND ($7::text IS NULL OR c.batch_id = $7)
  AND ($8::text IS NULL OR c.id < $8)
ORDER BY c.id DESC LIMIT $9
"""

# -- agents and boot leases ---------------------------------------------------------

# $1 agent, $2 journal, $3 presence (a hello or heartbeat, not a claim): the journal's
# generation, given at its first sight and never changed; its last_seen is now.
JOURNAL_SEEN: Final = """
WITH seen AS (
    UPDATE journals SET last_seen = now(), present = present OR $3
    WHERE agent_id = $1 AND journal_id = $2
    RETURNING generation, present
), made AS (
    INSERT INTO journals (agent_id, journal_id, present)
    SELECT $1, $2, $3 WHERE NOT EXISTS (SELECT 1 FROM seen)
    ON CONFLICT (agent_id, journal_id) DO UPDATE SET last_seen = now()
    RETURNING generation, present
)
SELECT generation, present FROM seen UNION ALL SELECT generation, present FROM made
"""

# $1 id … $8 kinds, $9 signed_at_ms, $10 status, $11 the gap it announced until its next
# heartbeat (beyond cmdq.heartbeat); a replayed (older) hello changes nothing
AGENT_UPSERT: Final = """
INSERT INTO agents AS a (id, site_id, tenant_id, role, cert_id, incarnation, version, kinds,
                         connected_at, last_seen, last_signed_ms, status, beat_gap_ms)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, now(), now(), $9, $10::jsonb, $11)
ON CONFLICT (id) DO UPDATE SET site_id = EXCLUDED.site_id, tenant_id = EXCLUDED.tenant_id,
    role = EXCLUDED.role, cert_id = EXCLUDED.cert_id, incarnation = EXCLUDED.incarnation,
    version = EXCLUDED.version, kinds = EXCLUDED.kinds, connected_at = now(),
    last_seen = now(), last_signed_ms = EXCLUDED.last_signed_ms, status = EXCLUDED.status,
    beat_gap_ms = EXCLUDED.beat_gap_ms
WHERE a.last_signed_ms < EXCLUDED.last_signed_ms
  AND NOT EXISTS (SELECT 1 FROM revoked_certs r WHERE r.cert_id = EXCLUDED.cert_id)
RETURNING a.id
"""
# $5 silent_after_ms: a heartbeat after a silence starts a new connection (connected_at), as a
# hello does: the first word of an agent whose site's link came back may be either
AGENT_HEARTBEAT: Final = f"""
UPDATE agents SET last_seen = now(), last_signed_ms = $2, cert_id = $3,
    status = COALESCE($4::jsonb, status),
    connected_at = CASE WHEN last_seen < now() - {_QUIET.format(p="$5", a="agents")} THEN now()
                        ELSE connected_at END,
    beat_gap_ms = 0
WHERE id = $1 AND last_signed_ms < $2 AND NOT EXISTS (SELECT 1 FROM revoked_certs r WHERE r.cert_id = $3)
RETURNING site_id, role
"""
# Node agents' heartbeats held in memory since the last write, in one statement (one commit):
# $1 ids, $2 signed_at_ms, $3 cert ids, $4 status (NULL: unchanged), $5 journal ids ('' none),
# $6 how long ago each was heard (ms), $7 silent_after_ms, $8 the gaps each announced until its
# next heartbeat (beyond cmdq.heartbeat). Each row as AGENT_HEARTBEAT would have changed it when it
# was heard (last_seen: now minus its age; a silence before it, longer than the gap the previous
# heartbeat announced allowed, starts a new connection), and its journal as JOURNAL_SEEN (present);
# rows are locked in id order, so two instances writing at once wait for each other instead of
# deadlocking. Returns the ids applied
# (the others: unknown, older than one applied, or of a revoked certificate).
AGENTS_HEARD: Final = f"""
WITH h AS (
    SELECT h.id, h.signed_ms, h.cert_id, h.status, h.journal_id, h.gap_ms,
           now() - {_SECS.format(p="h.age_ms")} AS heard
    FROM unnest($1::text[], $2::bigint[], $3::text[], $4::text[], $5::text[], $6::double precision[],
                $8::integer[])
         AS h (id, signed_ms, cert_id, status, journal_id, age_ms, gap_ms)
), locked AS (
    SELECT a.id FROM agents a JOIN h ON h.id = a.id ORDER BY a.id FOR UPDATE OF a
), seen AS (
    UPDATE agents a SET last_seen = greatest(a.last_seen, h.heard), last_signed_ms = h.signed_ms,
        cert_id = h.cert_id, status = COALESCE(h.status::jsonb, a.status),
        connected_at = CASE WHEN a.last_seen < h.heard - {_QUIET.format(p="$7", a="a")} THEN h.heard
                            ELSE a.connected_at END,
        beat_gap_ms = h.gap_ms
    FROM h
    WHERE a.id = h.id AND a.id IN (SELECT id FROM locked) AND a.last_signed_ms < h.signed_ms
      AND NOT EXISTS (SELECT 1 FROM revoked_certs r WHERE r.cert_id = h.cert_id)
    RETURNING a.id
), journal AS (
    INSERT INTO journals AS j (agent_id, journal_id, present, last_seen)
    SELECT h.id, h.journal_id, true, h.heard FROM h JOIN seen ON seen.id = h.id
    WHERE h.journal_id <> '' ORDER BY h.id
    ON CONFLICT (agent_id, journal_id) DO UPDATE SET last_seen = greatest(j.last_seen, EXCLUDED.last_seen),
        present = true
)
SELECT id FROM seen
"""
AGENT_AGAIN: Final = "SELECT site_id, role FROM agents WHERE id = $1"
# $2 signed_at_ms, $3 silent_after_ms: shown disconnected at once (its announced gap gone too)
AGENT_LEAVE: Final = f"""
UPDATE agents SET last_seen = now() - {_SECS.format(p="$3")} - interval '1 second',
    last_signed_ms = $2, beat_gap_ms = 0
WHERE id = $1 AND last_signed_ms < $2
RETURNING site_id, role
"""
# The site a node is known in here: its own agent's certificate, else its latest command.
SITE_OF_NODE: Final = """
SELECT coalesce(
    (SELECT site_id FROM agents WHERE id = $1),
    (SELECT site_id FROM commands WHERE node_id = $1 ORDER BY id DESC LIMIT 1))
"""
# $1 site, $2 agent, $3 ttl ms: renew when ours or free (never for a revoked certificate's agent)
LEASE_RENEW: Final = f"""
INSERT INTO boot_leases AS l (site_id, agent_id, expires_at)
SELECT $1, $2, now() + {_SECS.format(p="$3")}
WHERE NOT EXISTS (SELECT 1 FROM agents a JOIN revoked_certs r ON r.cert_id = a.cert_id WHERE a.id = $2)
ON CONFLICT (site_id) DO UPDATE SET agent_id = EXCLUDED.agent_id,
    expires_at = EXCLUDED.expires_at
WHERE l.agent_id = EXCLUDED.agent_id OR l.expires_at <= now()
RETURNING agent_id
"""
LEASE_RELEASE: Final = "DELETE FROM boot_leases WHERE site_id = $1 AND agent_id = $2"
# $1 cert id, $2 silent_after_ms: bc-pki revoked it; its agent is shown disconnected at once, its
# boot lease goes, and its unclaimed site commands go back to pending for another agent.
CERT_REVOKED_MARK: Final = "INSERT INTO revoked_certs (cert_id) VALUES ($1) ON CONFLICT DO NOTHING"
CERT_REVOKED_CUT_OFF: Final = f"""
UPDATE agents SET last_seen = least(last_seen, now() - {_SECS.format(p="$2")} - interval '1 second'),
    beat_gap_ms = 0
WHERE cert_id = $1
RETURNING id, site_id, role
"""
CERT_REVOKED_LEASES: Final = (
    "DELETE FROM boot_leases l USING agents a WHERE a.cert_id = $1 AND l.agent_id = a.id"
)
CERT_REVOKED_REASSIGN: Final = f"""
WITH due AS (
    SELECT c.id FROM commands c JOIN agents a ON a.id = c.agent_id
    WHERE a.cert_id = $1 AND c.state = 'dispatched' AND c.target = 'site'
    FOR UPDATE OF c SKIP LOCKED
)
UPDATE commands c SET state = 'pending', agent_id = NULL, published_at = NULL,
    reason = 'agent-revoked', updated_at = now()
FROM due WHERE c.id = due.id
RETURNING {_COLS}
"""
# $1 site, $2 role, $3 connected, $4 silent_after_ms, $5 limit
AGENTS_LIST: Final = f"""
SELECT a.id, a.site_id, a.tenant_id, a.role, a.cert_id, a.version, a.kinds, a.connected_at,
       a.status, a.last_seen, a.last_seen > now() - {_QUIET.format(p="$4", a="a")} AS connected,
       l.agent_id IS NOT NULL AS boot_lease,
       (SELECT count(*) FROM commands c
        WHERE c.agent_id = a.id AND c.state IN ('dispatched', 'acked', 'running')) AS live
FROM agents a
LEFT JOIN boot_leases l ON l.site_id = a.site_id AND l.agent_id = a.id AND l.expires_at > now()
WHERE ($1::text IS NULL OR a.site_id = $1) AND ($2::text IS NULL OR a.role = $2)
  AND ($3::bool IS NULL OR (a.last_seen > now() - {_QUIET.format(p="$4", a="a")}) = $3)
  AND ($6::text IS NULL OR (a.site_id, a.id) > ($6, $7::text))
ORDER BY a.site_id, a.id LIMIT $5
"""

# -- metrics (read on scrape) -----------------------------------------------------------
# Only the live ones (the commands_live partial index): finished commands pile up until retention,
# and a grouped count of them would grow with history (bench/bench_metrics.py); they are counted
# as they finish instead (metrics.RESULTS).
LIVE_BY_STATE: Final = (
    "SELECT kind, state, site_id AS site, count(*) AS n FROM commands"
    " WHERE state IN ('pending', 'dispatched', 'acked', 'running') GROUP BY kind, state, site_id"
)
# $1 silent_after_ms
AGENTS_CONNECTED: Final = (
    "SELECT site_id AS site, role, count(*) AS n FROM agents"
    f" WHERE last_seen > now() - {_QUIET.format(p='$1', a='agents')}"
    " GROUP BY site_id, role"
)
BATCHES_WAITING: Final = (
    "SELECT count(*) FROM batches WHERE approved_at IS NULL AND closed_at IS NULL AND expires_at > now()"
)

# -- batches ------------------------------------------------------------------------

_BATCH_COLS: Final = (
    "id, tenant_id, kinds, nodes, workflow_id, workflow_ids, note, idempotency_key, document, threshold,"
    " created_at, expires_at, expires_at_ms, approved_at, expires_at <= now() AS expired, closed_at,"
    " closed_reason"
)
BATCH_INSERT: Final = f"""
INSERT INTO batches (id, tenant_id, kinds, nodes, workflow_id, note, idempotency_key, document,
                     threshold, expires_at, expires_at_ms, workflow_ids)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, to_timestamp($10::bigint / 1000.0), $10, $11)
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING {_BATCH_COLS}
"""
BATCH_BY_ID: Final = f"SELECT {_BATCH_COLS} FROM batches WHERE id = $1"
BATCH_BY_ID_FOR_UPDATE: Final = f"SELECT {_BATCH_COLS} FROM batches WHERE id = $1 FOR UPDATE"
BATCH_BY_KEY: Final = f"SELECT {_BATCH_COLS} FROM batches WHERE idempotency_key = $1"
BATCHES_UNEXPIRED: Final = "SELECT id FROM batches WHERE expires_at > now()"
# Expired batches whose expiry is not published yet, held by one sweeper until it marked them.
BATCHES_EXPIRY_DUE: Final = f"""
SELECT {_BATCH_COLS} FROM batches
WHERE expiry_published_at IS NULL AND expires_at <= now() AND closed_at IS NULL
ORDER BY expires_at LIMIT 100 FOR UPDATE SKIP LOCKED
"""
BATCHES_EXPIRY_PUBLISHED: Final = "UPDATE batches SET expiry_published_at = now() WHERE id = ANY($1::text[])"
BATCH_SET_APPROVED: Final = (
    "UPDATE batches SET approved_at = CASE WHEN $2 THEN coalesce(approved_at, now()) END"
    " WHERE id = $1 RETURNING approved_at"
)
# $1 batch, no longer approved (an approver was withdrawn): its dispatched, unclaimed commands
# go back to pending until the batch is approved again.
BATCH_UNDISPATCH: Final = f"""
UPDATE commands c SET state = 'pending', reason = 'batch-not-approved', published_at = NULL,
    agent_id = CASE WHEN c.target = 'node' THEN c.agent_id END, updated_at = now()
WHERE c.batch_id = $1 AND c.state = 'dispatched' AND c.destructive
RETURNING {_COLS}
"""
# $1 workflow, $2 state, $3 limit
# A page of batches in two steps: ids and sizes (a batch may name 10,000 nodes), then the
# rows of the ids that fit in the page.
BATCHES_LIST: Final = """
SELECT id, octet_length(document) AS size FROM batches
WHERE ($1::text IS NULL OR workflow_id = $1)
  AND ($2::text IS NULL OR $2 = CASE WHEN closed_at IS NOT NULL THEN 'closed'
                                     WHEN expires_at <= now() THEN 'expired'
                                     WHEN approved_at IS NOT NULL THEN 'approved'
                                     ELSE 'open' END)
  AND ($3::text IS NULL OR id < $3)
ORDER BY id DESC LIMIT $4
"""
# $1 batch, $2 why: closed by its workflow's engine (idempotent: the first close's reason stays).
BATCH_CLOSE: Final = f"""
UPDATE batches SET closed_at = coalesce(closed_at, now()), closed_reason = coalesce(closed_reason, $2)
WHERE id = $1 RETURNING {_BATCH_COLS}
"""
BATCH_REOPEN: Final = (
    f"UPDATE batches SET closed_at = NULL, closed_reason = NULL WHERE id = $1 RETURNING {_BATCH_COLS}"
)
BATCHES_BY_IDS: Final = f"SELECT {_BATCH_COLS} FROM batches WHERE id = ANY($1::text[]) ORDER BY id DESC"
APPROVAL_INSERT: Final = (
    "INSERT INTO approvals (batch_id, approver_id, signature) VALUES ($1, $2, $3)"
    " ON CONFLICT (batch_id, approver_id) DO NOTHING RETURNING approver_id"
)
APPROVALS_OF: Final = (
    "SELECT approver_id, signature, created_at FROM approvals WHERE batch_id = $1"
    " ORDER BY created_at, approver_id"
)
APPROVALS_OF_BATCHES: Final = (
    "SELECT batch_id, approver_id, signature, created_at FROM approvals WHERE batch_id = ANY($1::text[])"
    " ORDER BY batch_id, created_at, approver_id"
)
