"""The soak: a seeded plan of mixed traffic, its clients, probes of the server, and the verdict."""
