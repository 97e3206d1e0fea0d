"""REST transport (FastAPI): V2 JSON + binary tensor extension, repository extension, /v1 predict, /metrics."""
from .app import create_rest_app, error_response

__all__ = ["create_rest_app", "error_response"]
