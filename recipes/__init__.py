"""Per-architecture recipes (data files): HF tensor names -> sparkq roles."""
