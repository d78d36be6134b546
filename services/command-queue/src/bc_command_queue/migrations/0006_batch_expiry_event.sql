-- When a batch's expiry was published (bc.events.batch.<id>, state expired): once, by a sweeper.
ALTER TABLE batches ADD COLUMN expiry_published_at timestamptz;
-- Batches already expired when this column came: their expiry is old news, not an event now.
UPDATE batches SET expiry_published_at = expires_at WHERE expires_at <= now();
CREATE INDEX batches_expiry_unpublished ON batches (expires_at) WHERE expiry_published_at IS NULL;
