"""HTTP routes: thin, typed dependencies in deps.py, work in services/."""
