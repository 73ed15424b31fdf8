"""`agent-kv serve --replicas N`: the server as N model replicas on Ray Serve, with
session-affine routing and sessions that survive a replica (`launch` starts it)."""
