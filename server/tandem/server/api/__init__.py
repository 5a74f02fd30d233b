"""The engine's HTTP face: an OpenAI-compatible FastAPI app plus LMDeploy's and Ollama's native routes.

``serve_cli`` is ``tandem serve``; ``app.build_app`` assembles the app around an
``engine_loop.AsyncEngine``, the one thread that owns the ``LLMEngine``.
"""
