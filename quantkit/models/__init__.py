"""Model access: role-based architecture adapters, lazy checkpoint sources, and decoder-block construction."""
