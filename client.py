"""``alignzoo.client``: the client of ``alignzoo serve`` (``alignzoo.serve.client``)."""
from .serve.client import Client, ServerError, choice_logprobs, join_stream, output_logprobs

__all__ = ["Client", "ServerError", "choice_logprobs", "join_stream", "output_logprobs"]
