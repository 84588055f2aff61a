"""`transduce serve`: a model behind HTTP, with dynamic batching and an attention page.

    from transduce.serve import create_app
    app = create_app(transduce.load("runs/small/ema"))    # any ASGI server runs it

Modules, one job each: app (the routes a model's kind calls for), schemas (request and
response bodies), batcher (the queue and its one decoding thread), translation,
generation and encoding (the routes of each kind), limits and validation (what is
refused, and how), metrics and middleware (/metrics), page (the page at /, static/),
server (uvicorn with a draining shutdown).
"""

from transduce.serve.app import create_app
from transduce.serve.limits import Limits

__all__ = ["create_app", "Limits"]
