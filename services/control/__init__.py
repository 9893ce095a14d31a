"""Control service: REST control endpoints, the live page, and the fleet's Prometheus view (`app.py`)."""
