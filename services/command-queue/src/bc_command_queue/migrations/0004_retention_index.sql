-- Retention deletes finished commands untouched for its days (PURGE_FINISHED): the finished
-- rows are nearly the whole table, so it reads them by time, not all of them.
CREATE INDEX commands_retention ON commands (updated_at)
    WHERE state IN ('cancelled', 'expired', 'failed', 'rejected', 'succeeded');
