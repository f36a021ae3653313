"""The online front end: `serve --http`, an OpenAI-compatible HTTP server on the disaggregated engine.

Nothing below this room knows HTTP: the attention workers take requests and send tokens over ZeroMQ
(`serving.workers.online`); this room turns them into OpenAI's API.

- `server`: the server's life: checks, workers in online mode, uvicorn, the ready line, the drain on
  SIGTERM/SIGINT, the exit code.
- `engine_client`: `EngineClient`, the ZeroMQ sockets to the attention workers, the engine thread, the
  least-loaded worker for each request, each request's token stream, aborts, the drain.
- `app`: the FastAPI routes (`/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`, `/metrics`),
  the API key, server-sent events, disconnects.
- `openai_api`: OpenAI's request checks (strict JSON, text, every number in the range the engine honours;
  errors naming the field) and its response and chunk shapes.
- `schema`: the OpenAPI description of the routes (`/openapi.json`), with the limits the checks enforce.
- `connections`: the body read (413, 408), the open-connection limit (503), and uvicorn's protocol with a
  timeout on a request head that does not come.
- `text`: the tokenizer and chat template (as `transformers` renders it), and text that streams with stop strings.
- `metrics`: `ServerMetrics`, the Prometheus metrics and their names.

Nothing is imported here, so importing the package stays cheap.
"""
