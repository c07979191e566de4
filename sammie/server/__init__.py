"""The HTTP side: app.py (routes), requests.py (bodies -> validated requests), guard.py (hosts,
keys, cross-site requests, content types)."""
