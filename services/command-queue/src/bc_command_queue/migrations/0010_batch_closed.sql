-- Issue 26: a batch closed by its workflow's engine once the workflow failed or was aborted (and
-- no other workflow of a bulk batch still runs). A closed batch takes no approvals, dispatches
-- nothing, and no longer counts among the batches awaiting approval.
ALTER TABLE batches ADD COLUMN closed_at timestamptz;
ALTER TABLE batches ADD COLUMN closed_reason text;
