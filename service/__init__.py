"""attnscope service: FastAPI app, model runtime and attention analyses."""
