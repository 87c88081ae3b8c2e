"""What both aiohttp processes (the HTTP server and the router) share: OpenAI-shaped errors (errors.py),
the SSE writer (sse.py) and the middlewares (middlewares.py). Never imports paddle."""
