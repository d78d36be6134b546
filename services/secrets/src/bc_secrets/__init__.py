"""bc_secrets."""
