"""The resident-model harness: JSONL over stdio (``pipe``), WebSocket with sessions (``host``), a web client."""
