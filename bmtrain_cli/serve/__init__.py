"""Talking to a model: the OpenAI-compatible HTTP server (`bmtrain serve`), its web chat page, and the
engine `bmtrain chat` shares with it (prompt encoding, bounds, streamed decoding with stop strings)."""
