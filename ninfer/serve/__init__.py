"""OpenAI-compatible HTTP gateway over the public NInfer Engine (``ninfer serve``).

``create_app(engine_or_loader, ServeConfig(...), frontend=...)`` builds the FastAPI app;
``serve_forever`` runs it under uvicorn and ``BackgroundServer`` runs it on a thread.
"""

from ninfer.serve.app import create_app
from ninfer.serve.gateway import ServeConfig
from ninfer.serve.images import ImageInput
from ninfer.serve.server import BackgroundServer, serve_forever

__all__ = ["BackgroundServer", "ImageInput", "ServeConfig", "create_app", "serve_forever"]
