-- Issue 25 (10,000 machines): a machine's agent with nothing to do heartbeats every
-- cmdq.idle_heartbeat (30 s), not every 5 s. Each hello and heartbeat says the gap until its
-- next heartbeat; the gap beyond cmdq.heartbeat is kept here (0: the usual cadence, an older
-- agent, a site agent), and every silence rule counts an agent silent after
-- greatest(cmdq.silent_after, 3 × this gap), lost after greatest(cmdq.lost_after, 3 × it).
ALTER TABLE agents ADD COLUMN beat_gap_ms integer NOT NULL DEFAULT 0;
