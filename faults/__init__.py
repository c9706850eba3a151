"""Fault injectors ("nemesis") and the seeded fault schedule. Each injector wraps a
real component (the pool client, the transport, the copy engine, the connector) and
records its actions in the run's history together with its heal step."""
