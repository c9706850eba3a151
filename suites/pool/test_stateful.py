"""The pool daemon against the reference model, step by step (kvpool.testing).

CI runs the `kvgate` Hypothesis profile (bounded examples); `--slow` loads
`kvgate-slow` (many more examples and longer runs).
"""

from kvpool.testing import PoolMachine

TestPoolAgainstModel = PoolMachine.TestCase
