"""Repository-level pytest configuration.

kvgate's pytest plugin (harness/plugin.py: --kv-seed, --slow, markers, the replay key
in the report header) is registered through the `pytest11` entry point of the
installed distribution, so it loads here and in any project that installs kvgate.
"""
