-- A command's events are published in the order of its states (docs/command-queue.md,
-- Commands): `version` counts the command's state changes, so an instance that has published a
-- later state drops an earlier one that reaches its publisher after it (a claim's `running`
-- that comes out behind the command's end). A trigger keeps it, whatever statement changes the
-- state; an update that leaves the state as it was (progress, a publication) leaves it too.
ALTER TABLE commands ADD COLUMN version integer NOT NULL DEFAULT 0;

CREATE FUNCTION command_state_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.version := OLD.version + 1;
    RETURN NEW;
END
$$;

CREATE TRIGGER commands_version BEFORE UPDATE OF state ON commands
    FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION command_state_changed();
