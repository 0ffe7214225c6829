"""The model-agnostic serving engine (after nano-vllm's ``engine/``): a
sequence, a continuous-batching scheduler over the model's cache pools, a
model runner with CUDA-graph decode, and the engine that ties them together.
A model plugs in through ``model_api.ServeModel``."""
from .engine import Engine
from .model_api import ForwardBatch, HostLists, PagedRows, ServeModel
from .model_runner import capture_decode_graphs, graph_batch_sizes
from .sequence import Completion

__all__ = ["Completion", "Engine", "ForwardBatch", "HostLists", "PagedRows", "ServeModel", "capture_decode_graphs",
           "graph_batch_sizes"]
