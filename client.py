"""``alignzoo.client``: the client of ``alignzoo serve`` (``alignzoo.serve.client``)."""
from .serve.client import Client, ServerError, output_logprobs

__all__ = ["Client", "ServerError", "output_logprobs"]
