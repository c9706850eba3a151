"""The harness: assembles a live system (pool + replicas), drives seeded workloads,
reads the history with checkers, and hosts the pytest plugin and the `kvgate` command."""
