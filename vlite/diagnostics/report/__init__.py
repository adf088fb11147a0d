"""How the leak checker tells it: one reporter family (``target_report``) prints and writes any
target's run (terminal, report.json, report.md, report.html, samples.csv, plots); the per-mode
modules (``report``, ``blackbox_report``, ``watch_report``, ``fleet_report``) build its sections."""
