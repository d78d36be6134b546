"""bc_engine."""
