"""Workloads: seeded prompts (prompts), sessions (sessions) and routing (router)."""
