"""kvgate: the gate that proves KV connectors correct (kvgate.harness), the faults it
injects (kvgate.faults) and the models and scenarios it runs (kvgate.fixtures).

In the repository these are the top-level folders harness/, faults/ and fixtures/ (this
package links to them); installed, they lie inside this package, so kvgate installs no
generic top-level name. The pool and its vLLM connector are the package kvpool.
"""
