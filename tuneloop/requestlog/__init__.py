"""The request log: every finished /v1 request recorded once, redacted, off the event loop
(record.py: what a record holds; store.py: where records go and how they are read back;
writer.py: the buffered background writer; asgi.py: the middleware that makes the records)."""
