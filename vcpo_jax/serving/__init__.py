"""The embedded SGLang-protocol server: request parsing, continuous-batching engine, HTTP app."""
