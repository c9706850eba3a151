"""Repository-level pytest configuration.

kvgate's pytest plugin (harness/plugin.py, installed as kvgate.harness.plugin: --kv-seed,
--kv-slow, --kv-profile, markers, the replay key in the report header) is registered through
the `pytest11` entry point of the installed distribution and turned on by this repository's
ini (`kvgate = true` in pyproject.toml). Named here too, for a checkout that is not installed
(a GPU host given the tree alone) or a run with plugin autoloading disabled; where the entry
point has registered it already, this changes nothing.
"""

pytest_plugins = ["kvgate.harness.plugin"]
