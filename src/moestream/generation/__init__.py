"""Generation: turning prompts into tokens with a loaded model, for every verb that generates.

generate.py holds sampling and one sequence's forward pass (`Forward`, `SamplingParams`, grammars applied
through constraints.py); batching.py admits, prefills and decodes many sequences together over the KV
caches of kv_cache.py (built on kv_layer.py's growing layers); serving.py is the scheduler on top (`add`,
`abort`, `step`) and the one loop every generation runs through (generate, timed, teacher-forced,
streamed); worker.py is the server's model thread and job queue, and chat.py the terminal conversation.

It may import the loaded model's core.runtime (and attention's int8 KV format), the store and the layers
below; never the server or the command line (pyproject.toml's import-linter contracts).
"""
