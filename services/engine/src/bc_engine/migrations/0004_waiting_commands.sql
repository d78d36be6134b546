-- Steps waiting on a command, for the engine's bulk look at their commands every poll interval.
CREATE INDEX workflow_steps_waiting ON workflow_steps (workflow_id)
    WHERE state = 'running' AND command_id IS NOT NULL;
