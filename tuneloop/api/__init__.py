"""The OpenAI-compatible HTTP API over the serving engines, with the gateway and the request
log as hooks around each request: create_app() in app.py; the layer above gateway/,
requestlog/ and serving/ (nothing below imports it)."""
