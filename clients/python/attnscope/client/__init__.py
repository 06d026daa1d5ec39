"""attnscope's thin Python client: typed results, numpy arrays, retries, typed errors.

    from . import Client
    with Client() as c:                       # ATTNSCOPE_BASE_URL, ATTNSCOPE_API_KEY
        res = c.attention("Then I tried", layers=[0])
        res.attention.pattern.numpy()         # float32 [layer, head, query_pos, key_pos]

Installs without torch (httpx, pydantic, numpy; ``[plot]`` adds matplotlib). Plots live in
``attnscope.client.plots``, the command line in ``attnscope.client.cli``, the corpus
pipeline in ``attnscope.client.batch``.
"""

from ._client import (
    API_KEY_ENV,
    BASE_URL_ENV,
    DEFAULT_BASE_URL,
    AsyncClient,
    BaseClient,
    Client,
    __version__,
    resolve_base_url,
)
from ._errors import *  # noqa: F401,F403
from ._errors import ERROR_TYPES, STATUS_ERRORS
from ._errors import __all__ as _errors_all
from ._tensors import EncodedTensor, JsonTensor, to_numpy
from . import run as run  # noqa: PLC0414  (the builders: attnscope.client.run.zero, ...)
from .run import RunOutput

__all__ = [
    "API_KEY_ENV", "BASE_URL_ENV", "DEFAULT_BASE_URL", "AsyncClient", "BaseClient", "Client",
    "EncodedTensor", "ERROR_TYPES", "JsonTensor", "RunOutput", "STATUS_ERRORS", "resolve_base_url",
    "to_numpy", "__version__", *_errors_all,
]


def __getattr__(name: str):
    """Deprecated names (``ValidationError`` -> ``UnprocessableEntityError``), with a warning."""
    from . import _errors

    if name in _errors._DEPRECATED:
        return _errors._deprecated(name, 2)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
