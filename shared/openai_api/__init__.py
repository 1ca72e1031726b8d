"""The OpenAI HTTP API as Tandem speaks it, in one place for every service that speaks it.

`models`: request bodies (pydantic) and the endpoints they belong to; `translate`: a body
becomes a `GenerateRequest`; `responses`: `chat.completion` / `text_completion` objects, SSE
chunks and usage. The gateway uses them for synchronous requests and the queue service for
batch items, so a batch item's request and output body are exactly the synchronous endpoint's.
"""
