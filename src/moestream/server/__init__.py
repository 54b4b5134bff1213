"""The server's APIs: what `moestream serve` speaks over HTTP.

http_app.py is the FastAPI app (routes, the API key, errors in each API's shape, server-sent events,
/metrics); openai_api.py (chat completions, completions), responses_api.py (OpenAI's Responses API) and
anthropic_api.py (Anthropic's Messages API) translate requests into generations and results back;
answer_stream.py tells an answer's text, reasoning and tool calls apart as it streams, in the tool-call
formats of tool_calls.py; run.py runs the app with uvicorn and stops it cleanly.

It may import generation (the worker that runs the model, the sampling parameters, the KV caches), the
loaded model's core.runtime, and the layers below; nothing in generation, core or the store imports it
(pyproject.toml's import-linter contracts).
"""
