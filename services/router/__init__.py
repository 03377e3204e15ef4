"""The router's decision-making core: the global prefix index built from KV events,
the live worker pool with router-local in-flight load, and the routing policies."""
