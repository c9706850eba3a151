"""Gate any V1 connector: the connector-agnostic scenarios and the conformance matrix."""
