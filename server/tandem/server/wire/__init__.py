"""The HTTP vocabulary the engine server (``tandem.server.api``) and the proxy
(``tandem.server.proxy``) share: error bodies, stream framing, the body and edge limits,
credentials, request ids, tenants and sessions, the OpenAI/LMDeploy/Ollama request models,
the P/D plane's HMAC trust and the node roles.

A leaf: it imports no other Tandem package and nothing of the engine (no torch), so the
proxy, which speaks this vocabulary but runs no model, starts without loading one.
"""
