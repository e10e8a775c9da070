"""The API front ends: gRPC and OpenAI HTTP side by side on one engine client, with what they
own (validation, tokenization and chat templates, tenants, TLS, RPC and HTTP metrics)."""
