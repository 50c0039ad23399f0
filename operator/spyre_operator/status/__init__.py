"""The SpyreModel's status: its conditions as a pure function of what was observed (conditions.py), and the
writer of the status and its Events (report.py)."""
