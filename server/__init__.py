"""FastAPI app, routes, settings and the ``streamdet`` command line."""
