"""bc_command_queue."""
