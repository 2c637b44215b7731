"""Small real servers the test suite starts: a fault-injecting OpenAI-compatible endpoint and real
``transformers serve`` processes. They are test infrastructure, not datagen code."""
