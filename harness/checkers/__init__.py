"""The checkers: one library that reads a run's history and returns verdicts.

  verdict      Verdict (true / false / unknown, reason, evidence, what is not checked),
               all_of, Checks
  history      reading the history: windows, records, audit digests, namespaces
  byte_exact   installed, read and pooled blocks against their producers' bytes
  miss_causes  every lookup and load a hit or exactly one cause; each fault its cause
  requests     none lost, within bound, errors only where policy fail met a failed load
  outcome      ok / crash / liveness / correctness
"""
