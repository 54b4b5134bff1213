"""What users drive: the generation core (generate), chat, and the OpenAI-compatible server (server,
http_app, openai_api, worker)."""
