"""The workload client: the harness's one HTTP client (http)."""
