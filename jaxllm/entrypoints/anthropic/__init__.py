"""Anthropic's Messages API (`POST /v1/messages`), served beside the OpenAI routes."""
