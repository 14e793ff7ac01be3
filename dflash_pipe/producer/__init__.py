"""Producer: the process that owns the target GPUs, the data plan and the wire server."""
