"""The OpenAI-compatible server and what faces a chat client: the HTTP app (`app.py`, `make_app`), its metrics,
tool calls, JSON output (`grammar.py`) and the container's tokenizer (`tokenizer.py`, also the CLI's). Over the
runtime; the runtime imports nothing from here."""
