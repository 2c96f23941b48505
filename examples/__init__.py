"""Examples for kfac_optax (a package so tests can import them)."""
