"""bc_pki."""
