"""bc_site_agent: the site agent (BMC drivers, network boot, site cache, HTTP relay)."""

__version__ = "0.1.0"
