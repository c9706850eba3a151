"""Report rendering: JSON, JUnit XML and the Markdown gate checklist."""
