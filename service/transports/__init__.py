"""Transports: thin adapters from a wire protocol to :class:`service.dataplane.DataPlane`.

``rest`` (FastAPI, served by uvicorn) and ``grpc`` (grpc.aio); both run on the one
event loop built in :mod:`service.app`.
"""
