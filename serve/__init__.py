"""``alignzoo serve``: the aligned engine behind SGLang's RL HTTP API (``server.py``), its request and
response shapes (``api.py``), weight payloads as bytes (``wire.py``) and a small client
(``client.py``, also ``alignzoo.client``).

The folder is ``serve``, not ``http``: the repository root is the package, so a root folder named
``http`` would shadow the standard library's ``http`` for any process started there (pytest, ``python
-m alignzoo.cli``), and with it urllib, uvicorn and requests.

This module stays light (no FastAPI import): the CLI's argument types live here.
"""
from __future__ import annotations

import argparse
import socket

# Weight updates and control: with an admin API key, only it opens them (``server.ApiKeys``).
ADMIN_ROUTES = frozenset({"/update_weights_from_disk", "/update_weights_from_tensor", "/init_weights_update_group",
                          "/update_weights_from_distributed", "/destroy_weights_update_group", "/pause_generation",
                          "/continue_generation", "/abort_request", "/flush_cache"})


def port_arg(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"a port is in [1, 65535], got {v}")
    return v


def host_arg(text: str) -> str:
    if not text or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a host name or address")
    try:
        socket.getaddrinfo(text, None)
    except (socket.gaierror, UnicodeError) as e:
        raise argparse.ArgumentTypeError(f"cannot resolve host {text!r}: {e}") from None
    return text
