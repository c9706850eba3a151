"""Repository-level pytest configuration.

kvgate's pytest plugin (harness/plugin.py: --kv-seed, --slow, --kv-profile, markers, the
replay key in the report header) is opt-in: this repository loads it here; another
project loads it with `-p harness.plugin` or `pytest_plugins = ["harness.plugin"]` in its
own conftest.py. Installing kvgate changes nothing in another project's pytest run.
"""

pytest_plugins = ["harness.plugin"]
