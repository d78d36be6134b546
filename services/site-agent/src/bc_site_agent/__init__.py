"""bc_site_agent."""
