"""What users drive: the generation core (generate), chat, the OpenAI-compatible server (server,
http_app, openai_api, worker), inspect, and the options the verbs share."""
