"""Rendering of what the harness measured; the results themselves are committed under
the repository's reports/ folder, which holds no code.

  render     a gate run as run.json, junit.xml and checklist.md (Criterion, GateRun,
             write_reports) and the one Markdown table writer (table).
  html       one self-contained HTML page per gate run, benchmark or plan, plots as
             inline SVG (matplotlib).
  plan       a `kvgate plan` document as Markdown.
  gpu_live   a `kvgate gpu-live` result as a Markdown checklist.

Rendering reads documents and the harness's leaf modules (checkers.verdict, measure,
provenance, system.gpu's constants); nothing here imports a command (kvgate.harness.plan,
kvgate.harness.gate, kvgate.harness.cli), and those import it.
"""
