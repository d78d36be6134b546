"""bc_secrets.

A service process imports nats-py and structlog at the top of its modules: import them here first,
without the optional extras they would load along (aiohttp, rich: better_compute._imports).
"""

from better_compute._imports import defer_optional_imports

defer_optional_imports()
