"""SQLite with the process's write transactions queued in Python (see base.py)."""
