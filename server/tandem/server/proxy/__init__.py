"""The P/D proxy: one OpenAI endpoint over prefill, decode and aggregated engines."""
